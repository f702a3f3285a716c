"""
Client side: ``MeshTransport`` CPU per request vs a plain ``httpx2.Client``
===========================================================================

``python benchmarks/client_bench.py --url http://127.0.0.1:9001 [--requests 3000]``

Both clients run in this process, taking turns in blocks of 50 requests (A/B,
the order swapping every block), sequentially posting the same
``/v1/completions`` body to one mock worker that runs in another process. CPU per
request is the ``time.process_time()`` delta over a block; a round is
``--requests`` requests per client (after a warm-up), and the figure is
``mesh / plain`` per round, median with min-max. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx2
from _common import bodies

from meshkit import Mesh
from meshkit.adapters.transport import MeshTransport

__all__ = ["run"]

#: requests per client before the other client's turn
BLOCK = 50


def _cpu_per_request(client: Any, body: bytes, n: int) -> float:
    headers = {"content-type": "application/json"}
    t0 = time.process_time()
    for _ in range(n):
        r = client.post("/v1/completions", content=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {r.text[:200]}")
    return (time.process_time() - t0) / n


def run(url: str, requests: int, rounds: int, size: int, warmup: int) -> dict[str, Any]:
    body = bodies(size, 1)[0]
    plain = httpx2.Client(base_url=url)
    mesh = Mesh(workers=[url], policy="round_robin")
    routed = httpx2.Client(base_url="http://mesh.invalid", transport=MeshTransport(mesh))
    per_round: list[dict[str, float]] = []
    try:
        for c in (plain, routed):
            _cpu_per_request(c, body, warmup)
        # Within a round the clients alternate in blocks of BLOCK requests (the
        # order swapping each block): both see the same machine, so drift and other
        # load on it move both figures, not their ratio.
        blocks = max(1, requests // BLOCK)
        for _ in range(rounds):
            spent = {"plain": 0.0, "mesh": 0.0}
            for b in range(blocks):
                order = [("plain", plain), ("mesh", routed)]
                if b % 2:
                    order.reverse()
                for name, c in order:
                    spent[name] += _cpu_per_request(c, body, BLOCK)
            got = {name: total / blocks for name, total in spent.items()}
            got["ratio"] = got["mesh"] / got["plain"]
            per_round.append(got)
    finally:
        plain.close()
        routed.close()
        mesh.close()

    def agg(key: str) -> dict[str, float]:
        xs = [p[key] for p in per_round]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    return {
        "requests_per_round": requests,
        "block": BLOCK,
        "rounds": rounds,
        "size": size,
        "plain_us": {k: v * 1e6 for k, v in agg("plain").items()},
        "mesh_us": {k: v * 1e6 for k, v in agg("mesh").items()},
        "ratio": agg("ratio"),
        "per_round": per_round,
        "httpx2": httpx2.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/client_bench.py")
    p.add_argument("--url", required=True, help="one mock worker's base URL")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=300)
    ns = p.parse_args(argv)
    print(json.dumps(run(ns.url, ns.requests, ns.rounds, ns.size, ns.warmup)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
