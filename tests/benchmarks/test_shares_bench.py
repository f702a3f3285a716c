"""``benchmarks/shares_bench.py`` runs against this tree's ``TrafficShares`` and
reports both calls it times (it broke once when a constructor argument changed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "shares_bench.py"


def test_the_shares_bench_times_observe_and_plan() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH)], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    for call in ("observe", "plan"):
        totals = re.findall(rf"{call} +p50 .* total +(\d+) ms", out)
        assert len(totals) == 2, out  # two rounds of the one tree
        assert all(int(ms) > 0 for ms in totals), out  # 40,000 calls each
