"""benchmarks/scaling.py builds its C load generator and workers, drives a real
``meshkit serve`` with one and with two processes through them, and reports every
point: answered requests, no errors, each component's CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "scaling.py"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")
def test_scaling_measures_one_and_two_processes(tmp_path: Path) -> None:
    points = tmp_path / "points.json"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--rounds", "1", "--duration", "0.5", "--warmup", "0.3",
         "--clients", "4", "--json", str(points)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout  # fmt: skip
    got = json.loads(points.read_text())
    assert sorted(p["processes"] for p in got) == [1, 2]
    for p in got:
        assert p["errors"] == 0, p
        assert p["rps"] > 0 and p["gateway_us"] > 0 and p["workers_us"] > 0, p
    assert "| processes | req/s | vs 1 process | expected |" in out
