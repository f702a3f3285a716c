"""The client benchmark runs both pairs of clients through a mock worker (no timing
asserted): every request answered 200, the rounds and their ratios reported."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from meshkit.mock.thread import MockWorkerThread

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("pair", ["sync", "async"])
def test_client_bench_measures_both_clients(
    mock_factory: Callable[..., MockWorkerThread], pair: str
) -> None:
    worker = mock_factory(name="c")
    argv = [sys.executable, "client_bench.py", "--url", worker.url, "--requests", "100"]
    argv += ["--rounds", "2", "--warmup", "5", *(["--async"] if pair == "async" else [])]
    out = subprocess.run(argv, cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["async"] is (pair == "async")
    assert len(got["per_round"]) == 2
    for r in got["per_round"]:
        assert r["plain"] > 0 and r["mesh"] > 0
        assert r["ratio"] == pytest.approx(r["mesh"] / r["plain"])
    # warm-up, then two rounds of two blocks of 50 per client
    assert worker.worker.stats.requests_total["/v1/completions"] == 2 * (5 + 2 * 2 * 50)
