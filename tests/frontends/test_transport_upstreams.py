"""Which upstream each client transport sends attempts with, and how a passed-through
body reaches the client.

Each client library gets the upstream :mod:`meshkit.upstream.select` chooses, made on
its first request: the async transport's sends ``http://`` attempts on
:class:`~meshkit.upstream.fast.FastUpstream` (asyncio protocols), with httpcore as
the fallback for ``https://`` and for other async libraries (trio); an ``inner``
transport given, the requests of its library go through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import httpx2
import pytest

from meshkit import Mesh
from meshkit.frontends.transport import AsyncMeshTransport, MeshTransport
from meshkit.mock.thread import MockWorkerThread
from meshkit.upstream.blocking import BlockingUpstream
from meshkit.upstream.fast import FastUpstream
from meshkit.upstream.inner import InnerUpstream

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
            fast = transport._upstreams["httpx2"]
            assert isinstance(fast, FastUpstream)
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


def test_each_library_gets_its_own_upstream_and_inner_serves_its_library(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    worker = mock_factory(name="w")
    mesh = _mesh(mesh_factory, worker.url)
    inner = httpx.HTTPTransport()
    transport = MeshTransport(mesh, inner=inner)
    for lib in (httpx, httpx2):
        with lib.Client(transport=transport, base_url="http://mesh") as client:
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    by_httpx, by_httpx2 = transport._upstreams["httpx"], transport._upstreams["httpx2"]
    assert isinstance(by_httpx, InnerUpstream) and by_httpx.transport is inner
    assert isinstance(by_httpx2, BlockingUpstream)  # meshkit's own sockets
    assert worker.worker.stats.requests_total["/v1/chat/completions"] == 2


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
