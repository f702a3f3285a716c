"""Which upstream each client transport sends attempts with, and how a passed-through
body reaches the client.

The async transport, under asyncio, sends ``http://`` attempts on
:class:`~meshkit.upstream.fast.FastUpstream` (asyncio protocols), with its
httpcore pools as the ``https://`` fallback; under another async library (trio)
everything goes to httpcore.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx2
import pytest
import sniffio

from meshkit import Mesh
from meshkit.config import UpstreamConfig
from meshkit.frontends.transport import AsyncMeshTransport, MeshTransport
from meshkit.mock.thread import MockWorkerThread
from meshkit.upstream.fast import FastUpstream
from upstreams import attempt

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def _mesh(mesh_factory: Callable[..., Mesh], url: str) -> Mesh:
    return mesh_factory(workers=[url], lifecycle={"probe": False})


def test_the_async_transport_relays_on_fast_upstream_under_asyncio(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    worker = mock_factory(name="w", output_tokens=20)
    mesh = _mesh(mesh_factory, worker.url)
    transport = AsyncMeshTransport(mesh)

    async def go() -> tuple[FastUpstream, list[int], bytes, int, int]:
        async with httpx2.AsyncClient(transport=transport, base_url="http://mesh") as client:
            tokens = []
            for _ in range(4):
                r = await client.post("/v1/chat/completions", json=CHAT)
                tokens.append(r.json()["usage"]["completion_tokens"])
            async with client.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as s:
                events = await s.aread()
            # not an inference path: passed through to the worker, body streamed
            health = await client.get("/health")
            fast = transport._afast["httpx2"]
            hub = fast._hub
            assert hub is not None
            opened = sum(p.count for p in hub.pools.values())
            return fast, tokens, events, health.status_code, opened

    fast, tokens, events, health, opened = asyncio.run(go())
    assert tokens == [20] * 4
    assert events.endswith(b"data: [DONE]\n\n")
    assert health == 200 and worker.worker.stats.requests_total.get("/health") == 1
    assert opened == 1  # every request on one keep-alive connection
    assert worker.worker.stats.requests_total["/v1/chat/completions"] == 5
    assert fast._hub is None  # the client's close closed the transport's pools
    assert mesh.total_load() == 0


def test_under_another_async_library_the_transport_keeps_httpcore(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    worker = mock_factory(name="w")
    transport = AsyncMeshTransport(_mesh(mesh_factory, worker.url))

    async def senders() -> tuple[Any, Any]:
        token = sniffio.current_async_library_cvar.set("trio")
        try:
            other = transport._sender(httpx2)
        finally:
            sniffio.current_async_library_cvar.reset(token)
        return other, transport._sender(httpx2)

    other, native = asyncio.run(senders())
    core = transport._cores["httpx2"]
    assert core is not None
    assert other == core.send_async
    assert native == transport._afast["httpx2"].send


def test_fast_upstream_sends_https_to_its_fallback() -> None:
    sent: list[str] = []

    async def fallback(a: Any) -> Any:
        sent.append(a.url)
        return "answered by the fallback"

    async def go() -> Any:
        up = FastUpstream(UpstreamConfig(), fallback=fallback)
        try:
            return await up.send(attempt("https://worker.example:8443/v1/chat/completions"))
        finally:
            await up.aclose()

    assert asyncio.run(go()) == "answered by the fallback"
    assert sent == ["https://worker.example:8443/v1/chat/completions"]


def test_a_passed_through_body_cut_short_raises_the_librarys_error(
    mesh_factory: Callable[..., Mesh],
) -> None:
    """Not an inference path: relayed as is, and a worker dying half-way through the
    body is the client library's own protocol error in both transports, as with a
    direct connection (never meshkit's internal failure)."""
    from reliability.rawworker import TruncatingWorker

    cut = TruncatingWorker()
    try:
        mesh = _mesh(mesh_factory, cut.url)
        with (
            httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client,
            pytest.raises(httpx2.RemoteProtocolError),
        ):
            client.post("/not/inference", json={"x": 1})

        async def go() -> None:
            transport = AsyncMeshTransport(mesh)
            async with httpx2.AsyncClient(transport=transport, base_url="http://mesh") as c:
                with pytest.raises(httpx2.RemoteProtocolError):
                    await c.post("/not/inference", json={"x": 1})

        asyncio.run(go())
    finally:
        cut.close()
