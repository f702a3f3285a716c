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
    assert len(lines) < 70
    rows = [
        line.split() for line in lines if re.match(r"^\s*\d+\s+(gateway|transport|envoy)\s", line)
    ]
    # the test extra installs Envoy: the fifth mode is in the tour
    vias = {"gateway", "transport"} | ({"envoy"} if EXTPROC else set())
    assert len(rows) == 6 * len(vias) + 6 + 3
    assert {r[1] for r in rows} == vias
    assert {r[2] for r in rows} == {"chat", "responses", "messages"}
    assert all(r[5] == "200" for r in rows)
    # every worker appears in the per-worker table (placement spreads the rest)
    for name in ("w0", "w1", "w2"):
        assert re.search(rf"^{name}\s+http://127\.0\.0\.1:\d+\s+\d+", out, re.M), out
    # The conversation takes the routers by turns and stays with its history: each
    # router reads the engines' KV events (the test extra installs pyzmq).
    talk = rows[6 * len(vias) : 6 * len(vias) + 6]
    assert {r[1] for r in talk} == vias and len({r[4] for r in talk}) == 1, out
    assert "cache hits on 5 of 5 later turns" in out, out
    # Each Responses turn names the one before, which another router created.
    follow = rows[-3:]
    assert len({r[1] for r in follow}) == min(3, len(vias)) and len({r[4] for r in follow}) == 1
    routers = {
        m[1]: (m[2], int(m[4]))
        for m in re.finditer(
            r"^(gateway|transport|envoy)\s+(events \d/\d)\s+(\d+)\s+(\d+)$", out, re.M
        )
    }
    assert set(routers) == vias, out
    assert all(kind == "events 3/3" for kind, _ in routers.values()), out
    assert sum(n for _, n in routers.values()) == len(rows)  # each router counted its own


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
