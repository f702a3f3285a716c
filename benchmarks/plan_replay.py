"""
How many follow-ups the traffic-share plan alone moves, from a multi_router dump
================================================================================

``python benchmarks/plan_replay.py DUMP [--config prefix_hash]`` reads the answers
``multi_router.py --dump DUMP`` wrote and, for every run of ``--config`` with more
than one router, replays ``prefix_hash``'s traffic-share plan
(:class:`~meshkit.core.policies.shares.TrafficShares`): each request is observed by
the router that took it, in the order sent, and placed where that router's plan puts
its conversation. Nothing else of the policy runs (no in-flight bound,
no spill memory), and the ring is over ``w0..wN`` rather than the run's addresses,
so the replay says how much of a run's moves the plan's disagreement explains, not
which request moved.

Per tenant it prints its share of the requests, its follow-ups, and the follow-ups
moved in the run and in the replay: which tenants K routers disagree on.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from meshkit.core.policies.ring import HashRing, hash_bytes
from meshkit.core.policies.shares import TrafficShares

#: the policy's defaults (``PrefixHash``): owner_share, share_half_life_s, share_memory
_OWNER, _HALF_LIFE_S, _MEMORY = 0.25, 300.0, 4096


def replay(rows: Sequence[dict[str, Any]]) -> tuple[Counter[int], Counter[int], Counter[int]]:
    """Follow-ups, moved in the run, moved by the plan alone; per tenant."""
    rows = sorted(rows, key=lambda r: r["t_send"])
    workers = sorted({r["worker"] for r in rows})
    ring = HashRing(workers, 150)
    routers: dict[int, TrafficShares] = defaultdict(
        lambda: TrafficShares(owner_share=_OWNER, half_life_s=_HALF_LIFE_S, max_prefixes=_MEMORY)
    )
    t0 = rows[0]["t_send"] if rows else 0.0
    follow, moved_run, moved_plan = Counter[int](), Counter[int](), Counter[int]()
    last_run: dict[int, str] = {}
    last_plan: dict[int, str | None] = {}
    for r in rows:
        tenant, conv, now = r["tenant"], r["conv"], r["t_send"] - t0
        point = hash_bytes(b"tenant:%d" % tenant)
        shares = routers[r["router"]]
        shares.observe(point, now)
        plan = shares.plan(ring, ring.keys, now)
        planned = plan.worker(point, hash_bytes(b"conv:%d" % conv), ring)
        if conv in last_run:
            follow[tenant] += 1
            moved_run[tenant] += last_run[conv] != r["worker"]
            moved_plan[tenant] += last_plan[conv] != planned
        last_run[conv], last_plan[conv] = r["worker"], planned
    return follow, moved_run, moved_plan


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", help="a multi_router.py --dump file")
    ap.add_argument("--config", default="prefix_hash")
    args = ap.parse_args(argv)
    # A run is one workload, config and K; its conversation numbers start at 0, so
    # repeats are told apart by the run number (dumps without one: by where a
    # block of one workload, config and K ends).
    runs: list[tuple[tuple[Any, str, str, int], list[dict[str, Any]]]] = []
    with open(args.dump) as f:
        for line in f:
            r = json.loads(line)
            key = (r.get("run"), r["workload"], r["config"], r["k"])
            if not runs or runs[-1][0] != key:
                runs.append((key, []))
            runs[-1][1].append(r)
    runs = [
        (key, [r for r in rows if r["tenant"] >= 0])
        for key, rows in runs
        if key[2] == args.config and key[3] > 1
    ]
    if not runs:
        print(f"no run of {args.config} with more than one router in {args.dump}")
        return 1
    for (_, workload, _, k), rows in runs:
        follow, run, plan = replay(rows)
        share = Counter(r["tenant"] for r in rows)
        print(
            f"{workload}, K = {k}: follow-ups moved {sum(run.values())} in the run, "
            f"{sum(plan.values())} by the plan alone, of {sum(follow.values())}"
        )
        print("  tenant  share  follow-ups  moved (run)  moved (plan)")
        for tenant, n in share.most_common():
            print(
                f"  {tenant:6d}  {n / len(rows):5.3f}  {follow[tenant]:10d}"
                f"  {run[tenant]:11d}  {plan[tenant]:12d}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
