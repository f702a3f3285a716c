"""A relayed body nobody closes still gives its lease and its connection back.

httpx closes a response's stream when the response is closed, a WSGI server
closes the iterable it was given; but a client may drop a streamed response
unread, and a middleware around meshkit's may raise after calling it, so the
iterable never reaches the server. Then the stream is settled when it is
collected: the worker's load comes down and its connection closes (the worker
stops generating), as when a client leaves.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from harness import AsyncTransportMode, TransportMode, WerkzeugThread, wait_until
from meshkit import Mesh, MeshWSGIMiddleware
from meshkit.mock import MockWorkerThread

PATH = "/v1/chat/completions"


def chat(stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def collected(mesh: Mesh, worker: MockWorkerThread) -> bool:
    gc.collect()
    return mesh.total_load() == 0 and worker.worker.stats.active_streams == 0


@pytest.fixture
def slow(mock_factory: Callable[..., MockWorkerThread]) -> MockWorkerThread:
    # long enough that the stream is still running when it is dropped
    return mock_factory(name="w", output_tokens=2000, per_token_ms=5)


def test_a_streamed_response_dropped_unread_by_the_sync_transport(
    slow: MockWorkerThread, mesh_factory: Callable[..., Mesh]
) -> None:
    mesh = mesh_factory(workers=[slow.url], lifecycle={"probe": False})
    mode = TransportMode(mesh)
    try:
        req = mode.client.build_request("POST", PATH, json=chat(True))
        resp = mode.client.send(req, stream=True)
        assert resp.status_code == 200
        assert mesh.total_load() == 1
        del resp, req
        assert wait_until(lambda: collected(mesh, slow))
    finally:
        mode.close()


def test_a_streamed_response_dropped_unread_by_the_async_transport(
    slow: MockWorkerThread, mesh_factory: Callable[..., Mesh]
) -> None:
    mesh = mesh_factory(workers=[slow.url], lifecycle={"probe": False})
    mode = AsyncTransportMode(mesh)
    try:

        async def go() -> int:
            req = mode.client.build_request("POST", PATH, json=chat(True))
            resp = await mode.client.send(req, stream=True)
            return resp.status_code  # the response goes out of scope unclosed

        assert mode.run(go) == 200
        assert wait_until(lambda: collected(mesh, slow))
    finally:
        mode.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_middleware_that_raises_past_the_wsgi_iterable(
    slow: MockWorkerThread,
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
    stream: bool,
) -> None:
    # a whole answer is waited for before the iterable exists: a short one
    worker = slow if stream else mock_factory(name="w", output_tokens=40, per_token_ms=5)
    mesh = mesh_factory(workers=[worker.url], lifecycle={"probe": False})
    inner = MeshWSGIMiddleware(lambda e, s: [], mesh=mesh)

    def outer(environ: dict[str, Any], start_response: Any) -> Any:
        inner(environ, start_response)  # the iterable is dropped: never closed
        raise RuntimeError("the host's middleware fails after calling meshkit")

    with WerkzeugThread(outer) as url:
        r = httpx2.post(url + PATH, json=chat(stream), timeout=30, trust_env=False)
        assert r.status_code == 500  # werkzeug's answer to the host's exception
        assert worker.worker.stats.requests_total.get(PATH) == 1
        assert wait_until(lambda: collected(mesh, worker))
