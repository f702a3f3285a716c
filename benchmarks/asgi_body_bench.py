"""What the shared ASGI body reader costs MeshMiddleware: one more coroutine per
request. Until 6053518 the middleware ran the reading loop in its own coroutine;
now it awaits :func:`~meshkit.frontends.asgi_body.receive_body`, which runs it.
So the loop awaited directly stands for the old path and the loop awaited through
one more coroutine for the new one. Interpreted, 1 KiB body in one message,
7 rounds of 200,000 reads; prints the medians and their ratio.

    PYTHONPATH=src python benchmarks/asgi_body_bench.py
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from meshkit.frontends.asgi_body import receive_body
from meshkit.types import Message, Receive

Reader = Callable[[Receive, int], Awaitable[bytes | None]]


async def through_one_more(receive: Receive, limit: int) -> bytes | None:
    """The middleware's ``_read_body`` now: it awaits the shared reader."""
    return await receive_body(receive, limit)


MSG: Message = {"type": "http.request", "body": b"x" * 1024, "more_body": False}


async def receive() -> Message:
    return MSG


async def loop(read: Reader, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        await read(receive, 1 << 20)
    return (time.perf_counter() - t) / n * 1e9


async def main() -> None:
    n = 200_000
    res: dict[str, list[float]] = {"inline": [], "shared": []}
    for _ in range(7):
        res["inline"].append(await loop(receive_body, n))
        res["shared"].append(await loop(through_one_more, n))
    for k, v in res.items():
        v.sort()
        print(k, "median ns/call", round(v[3]), "range", round(v[0]), round(v[-1]))
    print("ratio", round(res["shared"][3] / res["inline"][3], 3))


if __name__ == "__main__":
    asyncio.run(main())
