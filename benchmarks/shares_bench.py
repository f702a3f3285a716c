"""
The traffic-share plan's cost on the placing thread
===================================================

``python benchmarks/shares_bench.py [SRC ...]`` feeds 40,000 observations (70 %
distinct prefixes, 30 % twelve hot ones) to ``TrafficShares`` over 4 workers and
times each ``observe`` and ``plan`` call, for the meshkit source tree(s) given
(default: this checkout's ``src``), so an old and a new tree run side by side.
Both calls run under the router's lock on the request path, so their tail is
what a request waits.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

_CHILD = """
import random, sys, time
sys.path.insert(0, sys.argv[1])
from meshkit.core.policies.ring import HashRing
from meshkit.core.policies.shares import TrafficShares

ring = HashRing([f"http://w{i}" for i in range(4)], 150)
shares = TrafficShares(owner_share=0.25, half_life_s=300, max_prefixes=4096)
rng = random.Random(1)
times = {"observe": [], "plan": []}
for i in range(40000):
    p = rng.getrandbits(64) if rng.random() < 0.7 else rng.randrange(12)
    a = time.perf_counter()
    shares.observe(p, i * 0.01)
    b = time.perf_counter()
    shares.plan(ring, ring.keys, i * 0.01)
    c = time.perf_counter()
    times["observe"].append(b - a)
    times["plan"].append(c - b)
for name, xs in times.items():
    xs.sort()
    print(f"  {name:8s} p50 {xs[len(xs) // 2] * 1e6:6.1f} us  "
          f"p99.9 {xs[int(len(xs) * 0.999)] * 1e6:7.0f} us  max {xs[-1] * 1e6:7.0f} us  "
          f"total {sum(xs) * 1e3:6.0f} ms")
"""


def main(argv: list[str]) -> int:
    trees = argv or [str(Path(__file__).resolve().parent.parent / "src")]
    for rnd in (1, 2):
        for src in trees:
            print(f"round {rnd}: {src}", flush=True)
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-I", "-c", _CHILD, src], check=True)
            print(f"  ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
