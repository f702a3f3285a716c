"""
How evenly the consistent-hash ring spreads keys
================================================

``python benchmarks/ring_balance.py [--points 150,1000] [--fleets 100]`` builds
rings over random port sets (``http://127.0.0.1:<port>``, consecutive ports, as
the mock fleets are) and prints, per worker count and points per worker:

* the longest arcs against the mean (median, 90th percentile, worst): the share
  of every hash-placed key the most loaded worker takes while the fleet stays;
* chats placed on their ring owner (2-10 turns each, drawn per fleet): requests
  per worker, max/mean (mean over the fleets, and the share of fleets over 1.25),
  so the ring's part and the conversations' own draw are seen together.

It reads this checkout's ``HashRing`` (``docs/policies.md``, "The ring's points").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from meshkit.core.policies.ring import HashRing

#: (chats, workers) simulated; the benchmark's sizes and a larger fleet's
CHATS = ((51, 4), (202, 4), (2000, 16))


def fleet(rng: random.Random, n: int) -> list[str]:
    base = rng.randrange(20_000, 60_000)
    return [f"http://127.0.0.1:{base + i}" for i in range(n)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="150,1000", help="points per worker, a list")
    ap.add_argument("--fleets", type=int, default=100, help="random port sets per cell")
    ap.add_argument("--workers", default="4,16,64")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    points = [int(p) for p in args.points.split(",")]
    print("longest arc / mean: median, p90, worst")
    for n in (int(w) for w in args.workers.split(",")):
        rng = random.Random(args.seed + n)
        ports = [fleet(rng, n) for _ in range(args.fleets)]
        for v in points:
            worst = sorted(max(HashRing(keys, v).arcs()) * n for keys in ports)
            mid, p90 = worst[len(worst) // 2], worst[int(len(worst) * 0.9)]
            print(f"  {n:3d} workers, {v:5d} points: {mid:.3f} {p90:.3f} {worst[-1]:.3f}")
    print("chats on their ring owner, requests per worker max/mean: mean (fleets over 1.25)")
    for chats, n in CHATS:
        rng = random.Random(args.seed * 1000 + chats)
        trials = []
        for _ in range(args.fleets):
            keys = fleet(rng, n)
            convs = [(rng.getrandbits(64), rng.randrange(2, 11)) for _ in range(chats)]
            trials.append((keys, convs))
        for v in points:
            ratios = []
            for keys, convs in trials:
                ring = HashRing(keys, v)
                count = dict.fromkeys(ring.keys, 0)
                for point, turns in convs:
                    count[ring.owner(point) or ""] += turns
                ratios.append(max(count.values()) * n / sum(count.values()))
            over = sum(r > 1.25 for r in ratios) / len(ratios)
            print(
                f"  {chats:5d} chats, {n:2d} workers, {v:5d} points: "
                f"{statistics.mean(ratios):.3f} ({over:.0%})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
