"""The async SDK clients doing their own placement with ``AsyncMeshTransport``.

Eight concurrent requests (OpenAI chat and Anthropic messages) are spread over
three local mock workers by the ``least_load`` policy; each line shows the
worker that answered.

Run it (starts three local mock workers, exits 0)::

    python examples/client_sdk/async_client.py
"""

from __future__ import annotations

import asyncio
from collections import Counter

import anthropic
import httpx2
import openai

from meshkit import AsyncMeshTransport, Mesh
from meshkit.mock import MockConfig, MockWorkerThread


async def ask_openai(client: openai.AsyncOpenAI, i: int) -> str:
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": f"question {i}"}]
    )
    return raw.headers["x-mock-worker"]


async def ask_anthropic(client: anthropic.AsyncAnthropic, i: int) -> str:
    raw = await client.messages.with_raw_response.create(
        model="m", max_tokens=32, messages=[{"role": "user", "content": f"question {i}"}]
    )
    return raw.headers["x-mock-worker"]


async def run(mesh: Mesh) -> Counter[str]:
    oa = openai.AsyncOpenAI(
        base_url="http://mesh.invalid/v1",
        api_key="unused",
        http_client=httpx2.AsyncClient(transport=AsyncMeshTransport(mesh)),
    )
    an = anthropic.AsyncAnthropic(
        base_url="http://mesh.invalid",
        api_key="unused",
        http_client=httpx2.AsyncClient(transport=AsyncMeshTransport(mesh)),
    )
    async with oa, an:
        jobs = [ask_openai(oa, i) for i in range(4)] + [ask_anthropic(an, i) for i in range(4)]
        workers = await asyncio.gather(*jobs)
    for i, worker in enumerate(workers):
        print(f"request {i} -> {worker}")
    return Counter(workers)


def main() -> int:
    # A little latency keeps requests in flight together, so load-based placement spreads them.
    mocks = [MockWorkerThread(MockConfig(name=f"w{i}", first_token_ms=50.0)) for i in range(3)]
    for m in mocks:
        m.start()
    try:
        with Mesh(workers=[m.url for m in mocks], policy="least_load") as mesh:
            counts = asyncio.run(run(mesh))
        print("per worker:", dict(sorted(counts.items())))
    finally:
        for m in mocks:
            m.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
