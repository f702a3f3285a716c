"""The in-process core benchmark runs its request path end to end (no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_core_bench_runs_requests_through_the_core() -> None:
    code = (
        "import core_bench\n"
        "us = core_bench.run(1024, 'round_robin', rounds=1, n=50)\n"
        "print(us > 0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
