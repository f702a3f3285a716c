"""``meshkit demo``: exits 0 and its report names every worker."""

from __future__ import annotations

import re
from typing import Any

import pytest

from harness import EXTPROC
from meshkit.server.cli import main


def test_demo_runs_and_names_every_worker(meshkit_run: Any) -> None:
    p = meshkit_run("demo", timeout=120)
    assert p.returncode == 0, p.stderr + p.stdout
    out = p.stdout
    assert out.isascii()
    lines = out.splitlines()
    assert len(lines) < 60
    rows = [
        line.split() for line in lines if re.match(r"^\s*\d+\s+(gateway|transport|envoy)\s", line)
    ]
    # the test extra installs Envoy: the fifth mode is in the tour
    vias = {"gateway", "transport"} | ({"envoy"} if EXTPROC else set())
    assert len(rows) == 6 * len(vias) + 6
    assert {r[1] for r in rows} == vias
    assert {r[2] for r in rows} == {"chat", "responses", "messages"}
    assert all(r[5] == "200" for r in rows)
    # every worker appears in the per-worker table (placement spreads the rest)
    for name in ("w0", "w1", "w2"):
        assert re.search(rf"^{name}\s+http://127\.0\.0\.1:\d+\s+\d+", out, re.M), out
    # the conversation hits the prefix cache after its first turn
    assert re.search(r"cache hits on [1-9]\d* of 5 later turns", out), out
    assert f"mesh_router_requests_total {len(rows)}" in out


def test_demo_real_runs_the_real_engine_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    """`meshkit demo --real` hands over to meshkit.testing.demo_real (run end to end
    on real engines in tests/engine/test_demo_real.py)."""
    import meshkit.testing.demo_real as demo_real

    calls: list[object] = []

    def fake(out: object = None) -> int:
        calls.append(out)
        return 0

    monkeypatch.setattr(demo_real, "run_real_demo", fake)
    assert main(["demo", "--real"]) == 0
    assert len(calls) == 1
