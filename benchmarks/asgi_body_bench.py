"""What the shared ASGI body reader costs MeshMiddleware over the loop it kept inline
until 6053518: one more coroutine call per request. Interpreted, 1 KiB body in one
message, 7 rounds of 200,000 reads; prints the medians and their ratio.

    PYTHONPATH=src python benchmarks/asgi_body_bench.py
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from meshkit.errors import RequestTooLarge
from meshkit.frontends.asgi_body import receive_body
from meshkit.types import Message, Receive

Reader = Callable[[Receive, int], Awaitable[bytes | None]]


async def inline(receive: Receive, limit: int) -> bytes | None:
    """The loop as it stood in MeshMiddleware at 6053518 (the baseline)."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        if chunk:
            total += len(chunk)
            if total > limit:
                raise RequestTooLarge("x")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def shared(receive: Receive, limit: int) -> bytes | None:
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
        res["inline"].append(await loop(inline, n))
        res["shared"].append(await loop(shared, n))
    for k, v in res.items():
        v.sort()
        print(k, "median ns/call", round(v[3]), "range", round(v[0]), round(v[-1]))
    print("ratio", round(res["shared"][3] / res["inline"][3], 3))


if __name__ == "__main__":
    asyncio.run(main())
