"""``benchmarks/routing_quality.py --routers K`` (``multi_router.py``): K router
processes over one fleet of mock workers with KV events, end to end, in small."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_quality.py"


def bench(*args: str) -> str:
    """What the benchmark prints, on conversations only, in its quick form (and the
    end of its stderr, where a process that died says why)."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--workloads", "conversations", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return done.stdout + "\n[stderr]\n" + done.stderr[-4000:]


def test_two_router_processes_place_over_one_fleet_with_and_without_events(
    tmp_path: Path,
) -> None:
    dump = tmp_path / "runs.jsonl"
    out = bench(
        "--routers", "1,2", "--configs", "prefix_hash,cache_aware+events", "--dump", str(dump)
    )
    # One line per run: every request answered, a hit ratio against the bound.
    lines = re.findall(r"conversations +(\S+) +K=(\d): .* ratio ([\d.]+) .* failed (\d+)", out)
    assert sorted((c, k) for c, k, _, _ in lines) == [
        ("cache_aware+events", "1"),
        ("cache_aware+events", "2"),
        ("prefix_hash", "1"),
        ("prefix_hash", "2"),
    ], out
    assert all(failed == "0" and 0.5 < float(ratio) <= 1.0 for _, _, ratio, failed in lines), out
    # One cache as large as the fleet's never beats the unlimited one, and holds
    # this small workload's prompts well enough to hit.
    refs = re.findall(r"conversations .* bound ([\d.]+)% fleet LRU ([\d.]+)%", out)
    assert len(refs) == 4 and all(0 < float(f) <= float(b) for b, f in refs), out
    # Every router of the events config matched every worker on KV events.
    events_rows = "| conversations | cache_aware+events"
    table = [row for row in out.splitlines() if row.startswith(events_rows)]
    assert len(table) == 2 and all("| 4/4 |" in row for row in table), out
    # ... and timed the batches from the engines' stamps into its index.
    ages = [re.search(r"\| 4/4 \| ≤([\d.]+)/≤([\d.]+) \|", row) for row in table]
    assert all(a and 0 < float(a[1]) <= float(a[2]) for a in ages), table
    plain = [row for row in out.splitlines() if row.startswith("| conversations | prefix_hash")]
    assert len(plain) == 2 and all("| — | — |" in row for row in plain), out
    # At K = 2 both router processes took requests (one shared queue).
    routers: dict[tuple[str, int], set[int]] = defaultdict(set)
    for line in dump.read_text().splitlines():
        rec = json.loads(line)
        assert rec["status"] == 200
        routers[(rec["config"], rec["k"])].add(rec["router"])
    assert routers[("prefix_hash", 2)] == routers[("cache_aware+events", 2)] == {0, 1}
    assert routers[("prefix_hash", 1)] == {0}


def test_two_router_processes_behind_a_kv_relay(tmp_path: Path) -> None:
    out = bench("--routers", "2", "--relay", "--configs", "cache_aware+events")
    lines = re.findall(r"conversations +(\S+) +K=(\d): .* ratio ([\d.]+) .* failed (\d+)", out)
    assert [(c, k) for c, k, _, _ in lines] == [("cache_aware+events", "2")], out
    assert all(failed == "0" and 0.5 < float(ratio) <= 1.0 for _, _, ratio, failed in lines), out
    # The routers never connect to an engine: every worker matched on events (by
    # both routers) is the relay's doing.
    table = [r for r in out.splitlines() if r.startswith("| conversations | cache_aware+events")]
    assert len(table) == 1 and "| 4/4 |" in table[0], out
    assert "aborted" not in out, out


def test_two_relays_the_first_killed_mid_run(tmp_path: Path) -> None:
    out = bench(
        *("--routers", "2", "--relays", "2", "--kill-relay-at", "0.3"),
        *("--configs", "cache_aware+events", "--out", str(tmp_path / "report.md")),
    )
    report = (tmp_path / "report.md").read_text()
    assert "relay 1 of 2 killed after" in report, report
    # each router moved its four workers to the second relay, nothing dropped
    moves = re.findall(r"router \d: KV-event sequence breaks \{([^}]*)\}", report)
    assert len(moves) == 2 and all("'relay move replayed': 4" in m for m in moves), report
    assert all("cleared" not in m for m in moves), report
    table = [r for r in report.splitlines() if r.startswith("| conversations | cache_aware+events")]
    assert len(table) == 1 and [c.strip() for c in table[0].split("|")][5] == "0", table  # failed
    assert "aborted" not in out, out
