"""benchmarks/accept_bench.py runs against a real ``serve --processes 2`` and reports
what it promises: each burst's connections per child, and the churn figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "accept_bench.py"


def test_the_accept_bench_reports_the_split_and_the_churn() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--bursts", "6", "--seconds", "0.5"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    splits = re.findall(r"burst of 6, #\d: connections per child \[(\d+), (\d+)\]", out)
    assert len(splits) == 3
    assert all(int(a) + int(b) == 6 for a, b in splits)
    churn = re.search(r"a new connection per request: (\d+)/s, (\d+) µs CPU each", out)
    assert churn is not None and int(churn.group(1)) > 0
