"""benchmarks/one_client.py builds the C load side, starts each frontend afresh per
round pinned beside it, loads them in turns over the round's windows, and reports
CPU per request with user and system apart and the per-round ratios' median with
its interval."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "one_client.py"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")
def test_one_client_compares_two_frontends_round_by_round(tmp_path: Path) -> None:
    rounds = tmp_path / "rounds.json"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--frontends", "meshkit,meshkit-interpreted",
         "--rounds", "2", "--duration", "0.6", "--windows", "2", "--warmup", "0.3",
         "--json", str(rounds)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout  # fmt: skip
    got = json.loads(rounds.read_text())
    assert sorted((r["frontend"], r["round"]) for r in got) == [
        ("meshkit", 0), ("meshkit", 1), ("meshkit-interpreted", 0), ("meshkit-interpreted", 1)
    ]  # fmt: skip
    for r in got:
        assert r["errors"] == 0, r
        assert r["rps"] > 0 and r["user_us"] > 0 and r["system_us"] >= 0, r
        assert r["requests"] > 0, r  # both windows' requests, each frontend's own
    assert "| frontend | CPU µs/req | user | system | req/s | errors |" in out
    assert "meshkit / meshkit-interpreted, CPU per request: median" in out
