"""``meshkit demo --real`` (``run_real_demo``), on a shrunken workload."""

from __future__ import annotations

import io
import re

import pytest

from meshkit.testing import EngineUnavailable, check_available
from meshkit.testing.demo_real import run_real_demo

pytestmark = pytest.mark.engine


def test_real_demo_replays_both_policies_on_real_engines() -> None:
    try:
        check_available()
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    out = io.StringIO()
    assert run_real_demo(out, tenants=2, turns=2, system_tokens=120) == 0
    text = out.getvalue()
    rows = re.findall(
        r"^(round_robin|cache_aware) .* (engine-[01]) +(\d+) +(\d+) +([\d.]+)$", text, re.M
    )
    assert len(rows) == 8  # 2 policies x 2 tenants x 2 turns, each with its engine and TTFT
    assert all(int(prompt) > 0 for _, _, prompt, _, _ in rows)
    assert re.search(r"^cache_aware vs round_robin: mean TTFT x[\d.]+; turns 2\+", text, re.M)
    assert "0 failed request(s)" in text
