"""``meshkit demo``: exits 0 and its report names every worker."""

from __future__ import annotations

import re
from typing import Any

import pytest

from meshkit.server.cli import main


def test_demo_runs_and_names_every_worker(meshkit_run: Any) -> None:
    p = meshkit_run("demo", timeout=120)
    assert p.returncode == 0, p.stderr + p.stdout
    out = p.stdout
    assert out.isascii()
    lines = out.splitlines()
    assert len(lines) < 60
    rows = [line.split() for line in lines if re.match(r"^\s*\d+\s+(gateway|transport)\s", line)]
    assert len(rows) == 18
    assert {r[1] for r in rows} == {"gateway", "transport"}
    assert {r[2] for r in rows} == {"chat", "responses", "messages"}
    assert all(r[5] == "200" for r in rows)
    # every worker appears in the per-worker table (placement spreads the rest)
    for name in ("w0", "w1", "w2"):
        assert re.search(rf"^{name}\s+http://127\.0\.0\.1:\d+\s+\d+", out, re.M), out
    # the conversation hits the prefix cache after its first turn
    assert re.search(r"cache hits on [1-9]\d* of 5 later turns", out), out
    assert "mesh_router_requests_total 18" in out


def test_demo_real_is_reserved(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--real"]) == 2
    assert capsys.readouterr().err == "real engines: see issue 11 (not available yet)\n"
