"""
Client side: ``MeshTransport`` CPU per request vs a plain ``httpx2.Client``
===========================================================================

``python benchmarks/client_bench.py --url http://127.0.0.1:9001 [--requests 3000] [--async]``

Both clients run in this process, taking turns in blocks of 50 requests (A/B,
the order swapping every block), sequentially posting the same
``/v1/completions`` body to one mock worker that runs in another process. CPU per
request is the ``time.process_time()`` delta over a block; a round is
``--requests`` requests per client (after a warm-up), and the figure is
``mesh / plain`` per round, median with min-max. Prints JSON. With ``--async`` the
pair is ``httpx2.AsyncClient`` with ``AsyncMeshTransport`` against a plain
``httpx2.AsyncClient``, on one asyncio loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx2
from _common import bodies

from meshkit import Mesh
from meshkit.frontends.transport import AsyncMeshTransport, MeshTransport

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


async def _acpu_per_request(client: Any, body: bytes, n: int) -> float:
    headers = {"content-type": "application/json"}
    t0 = time.process_time()
    for _ in range(n):
        r = await client.post("/v1/completions", content=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {r.text[:200]}")
    return (time.process_time() - t0) / n


def _schedule(requests: int, rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, client)`` for each block of BLOCK requests.

    Within a round the clients alternate block by block (the order swapping each
    block): both see the same machine, so drift and other load on it move both
    figures, not their ratio.
    """
    for r in range(rounds):
        for b in range(max(1, requests // BLOCK)):
            order = ("plain", "mesh") if b % 2 == 0 else ("mesh", "plain")
            yield from ((r, name) for name in order)


def _per_round(spent: list[dict[str, float]], requests: int) -> list[dict[str, float]]:
    blocks = max(1, requests // BLOCK)
    out = []
    for r in spent:
        got = {name: total / blocks for name, total in r.items()}
        got["ratio"] = got["mesh"] / got["plain"]
        out.append(got)
    return out


def _sync_rounds(
    mesh: Mesh, url: str, body: bytes, requests: int, rounds: int, warmup: int
) -> list[dict[str, float]]:
    clients = {
        "plain": httpx2.Client(base_url=url),
        "mesh": httpx2.Client(base_url="http://mesh.invalid", transport=MeshTransport(mesh)),
    }
    spent = [{"plain": 0.0, "mesh": 0.0} for _ in range(rounds)]
    try:
        for c in clients.values():
            _cpu_per_request(c, body, warmup)
        for r, name in _schedule(requests, rounds):
            spent[r][name] += _cpu_per_request(clients[name], body, BLOCK)
    finally:
        for c in clients.values():
            c.close()
    return _per_round(spent, requests)


async def _async_rounds(
    mesh: Mesh, url: str, body: bytes, requests: int, rounds: int, warmup: int
) -> list[dict[str, float]]:
    transport = AsyncMeshTransport(mesh)
    spent = [{"plain": 0.0, "mesh": 0.0} for _ in range(rounds)]
    async with (
        httpx2.AsyncClient(base_url=url) as plain,
        httpx2.AsyncClient(base_url="http://mesh.invalid", transport=transport) as routed,
    ):
        clients = {"plain": plain, "mesh": routed}
        for c in clients.values():
            await _acpu_per_request(c, body, warmup)
        for r, name in _schedule(requests, rounds):
            spent[r][name] += await _acpu_per_request(clients[name], body, BLOCK)
    return _per_round(spent, requests)


def run(
    url: str, requests: int, rounds: int, size: int, warmup: int, *, use_async: bool = False
) -> dict[str, Any]:
    body = bodies(size, 1)[0]
    mesh = Mesh(workers=[url], policy="round_robin")
    try:
        if use_async:
            per_round = asyncio.run(_async_rounds(mesh, url, body, requests, rounds, warmup))
        else:
            per_round = _sync_rounds(mesh, url, body, requests, rounds, warmup)
    finally:
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
        "async": use_async,
        "httpx2": httpx2.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/client_bench.py")
    p.add_argument("--url", required=True, help="one mock worker's base URL")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--async", dest="use_async", action="store_true", help="the async pair")
    ns = p.parse_args(argv)
    got = run(ns.url, ns.requests, ns.rounds, ns.size, ns.warmup, use_async=ns.use_async)
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
