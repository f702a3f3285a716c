"""MeshTransport reads a whole (non-stream) body before answering, within a bound.

Within ``bounds.max_sse_line_bytes`` the worker's body is read and accounted before
the client gets the response: the books are closed while the client still holds
an unread response. Over the bound, or for a stream, the body is relayed as it is
read, and the books close when it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from meshkit import Mesh
from meshkit.frontends.transport import AsyncMeshTransport, MeshTransport
from meshkit.mock.thread import MockWorkerThread

PATH = "/v1/completions"


def _requests(mesh: Mesh) -> float:
    got = mesh.metrics.registry.get_sample_value(
        "mesh_router_requests_total", {"api": "completions", "status": "200"}
    )
    return got or 0.0


@pytest.fixture
def worker(mock_factory: Callable[..., MockWorkerThread]) -> MockWorkerThread:
    # 400 generated tokens: a ~3 KiB non-stream body
    return mock_factory(name="w", output_tokens=400)


def _mesh(mesh_factory: Callable[..., Mesh], url: str, bound: int) -> Mesh:
    return mesh_factory(
        workers=[url], lifecycle={"probe": False}, bounds={"max_sse_line_bytes": bound}
    )


def test_a_whole_body_is_accounted_before_the_client_reads_it(
    worker: MockWorkerThread, mesh_factory: Callable[..., Mesh]
) -> None:
    mesh = _mesh(mesh_factory, worker.url, 1 << 20)
    body = {"model": "m", "prompt": "a b c"}
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        with client.stream("POST", PATH, json=body) as r:
            # not read yet, and already settled: lease back, request counted
            assert mesh.total_load() == 0
            assert _requests(mesh) == 1
            data = r.read()
        assert r.status_code == 200
        answer = r.json()
        assert answer["usage"]["completion_tokens"] == 400
        assert int(r.headers["content-length"]) == len(data)
        # the usage of the body read whole is counted
        assert (
            mesh.metrics.registry.get_sample_value("mesh_router_tokens_total", {"kind": "output"})
            == 400
        )


def test_a_body_over_the_bound_is_relayed_as_read(
    worker: MockWorkerThread, mesh_factory: Callable[..., Mesh]
) -> None:
    mesh = _mesh(mesh_factory, worker.url, 1024)
    body = {"model": "m", "prompt": "a b c"}
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        with client.stream("POST", PATH, json=body) as r:
            assert mesh.total_load() == 1  # the relay holds the lease
            assert _requests(mesh) == 0
            data = r.read()
        assert mesh.total_load() == 0
        assert _requests(mesh) == 1
    assert len(data) > 1024
    assert r.json()["usage"]["completion_tokens"] == 400


@pytest.mark.parametrize("bound", [1 << 20, 1024])
def test_the_async_transport_reads_and_relays_alike(
    worker: MockWorkerThread, mesh_factory: Callable[..., Mesh], bound: int
) -> None:
    mesh = _mesh(mesh_factory, worker.url, bound)
    body: dict[str, Any] = {"model": "m", "prompt": "a b c"}

    async def go() -> tuple[int, Any]:
        transport = AsyncMeshTransport(mesh)
        async with httpx2.AsyncClient(transport=transport, base_url="http://mesh") as client:
            async with client.stream("POST", PATH, json=body) as r:
                load = mesh.total_load()
                await r.aread()
            return load, r.json()

    load, answer = asyncio.run(go())
    assert load == (0 if bound > 4096 else 1)
    assert answer["usage"]["completion_tokens"] == 400
    assert mesh.total_load() == 0
    assert _requests(mesh) == 1


def test_a_read_cancelled_mid_body_gives_the_lease_back(mesh_factory: Callable[..., Mesh]) -> None:
    """The client gives up while the whole body is being read: the books close as
    the client leaving, and the worker's load goes back."""
    import threading

    from reliability.rawworker import RawWorker

    hold = threading.Event()
    stalled = RawWorker(lambda: [b'{"choices": ['], hold=hold)
    try:
        mesh = _mesh(mesh_factory, stalled.url, 1 << 20)

        async def go() -> None:
            async with httpx2.AsyncClient(
                transport=AsyncMeshTransport(mesh), base_url="http://mesh"
            ) as client:
                task = asyncio.ensure_future(client.post(PATH, json={"model": "m", "prompt": "x"}))
                while not stalled.flushed.is_set():
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)  # let the head arrive: the read is what is cancelled
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(go())
        assert mesh.total_load() == 0
        assert mesh.metrics.registry.get_sample_value("mesh_router_client_disconnects_total") == 1.0
    finally:
        hold.set()
        stalled.close()
