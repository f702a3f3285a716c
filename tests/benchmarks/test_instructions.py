"""``benchmarks/instructions.py``'s readers, and the interpreter ``run.py`` records
(no valgrind needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import instructions  # noqa: E402
import run  # noqa: E402

# The head and tail of real output files (valgrind 3.2x), cut to what is read.
CALLGRIND = """# callgrind format
version: 1
creator: callgrind-3.22.0
pid: 4242
cmd:  /usr/bin/python3.11 benchmarks/frontends/meshkit_builtin.py --port 40000
events: Ir
summary: 1122283837
fl=(1) ???
fn=(1) 0x0000000000001ab0
0 3
totals: 1122283837
"""

CACHEGRIND = """desc: I1 cache:         32768 B, 64 B, 8-way associative
desc: D1 cache:         49152 B, 64 B, 12-way associative
cmd: /usr/bin/python3.11 benchmarks/frontends/meshkit_builtin.py --port 40000
events: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw Bc Bcm Bi Bim
fl=???
fn=???
0 1 2 3 4 5 6 7 8 9 10 11 12
summary: 1034066483 17728531 34076 307316597 11031342 109791 149923714 1576975 329773 \
150010698 13147199 25015624 8487496
"""


def test_callgrind_totals(tmp_path: Path) -> None:
    f = tmp_path / "cg.out"
    f.write_text(CALLGRIND)
    assert instructions._events(f) == {"Ir": 1122283837}
    assert instructions._ir(f) == 1122283837


def test_cachegrind_totals_by_event(tmp_path: Path) -> None:
    f = tmp_path / "cg.out"
    f.write_text(CACHEGRIND)
    got = instructions._events(f)
    assert got["Ir"] == 1034066483
    assert got["Bim"] == 8487496
    assert got["D1mr"] == 11031342
    assert len(got) == 13


def test_a_file_without_totals_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "cg.out"
    f.write_text("events: Ir\n")
    with pytest.raises(RuntimeError, match="no totals"):
        instructions._events(f)


def test_chat_bodies_are_sent_to_the_chat_path() -> None:
    body, path = instructions._body("chat", 1024)
    assert path == "/v1/chat/completions"
    assert len(body) == 1024 and b'"messages"' in body
    body, path = instructions._body("completions", 64)
    assert path == "/v1/completions"
    assert body.startswith(b'{"model":"m","prompt":"') and b"x" * 64 in body


def test_the_interpreter_build_is_named() -> None:
    got = run.interpreter_build()
    assert got.startswith(str(Path(sys.executable).resolve()))
    assert ("shared libpython" in got) != ("static libpython" in got)


def test_no_probes_reaches_one_process_and_the_supervised_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sys.path.insert(0, str(BENCH / "frontends"))
    import _env
    import meshkit_builtin

    from meshkit.config import MeshConfig

    monkeypatch.setenv("MESHBENCH_WORKERS", "http://127.0.0.1:9,http://127.0.0.1:10")
    monkeypatch.setenv("MESHBENCH_WORKLOAD", "proxy")
    assert "lifecycle" not in _env.mesh_kwargs()
    monkeypatch.setenv("MESHBENCH_PROBES", "0")
    kw = _env.mesh_kwargs()
    assert kw["lifecycle"] == {"probe": False}
    assert MeshConfig.build(**kw).lifecycle.probe is False
    path = tmp_path / "serve.toml"
    path.write_text(meshkit_builtin.config_toml(kw))
    cfg = MeshConfig.from_file(path)
    assert cfg.lifecycle.probe is False
    assert [w.url for w in cfg.workers] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
