"""The client transports honour the client's own timeouts, as a direct connection.

A request carries its library's ``timeout`` extension (the SDK's ``timeout=``, or
the client's default); each attempt is bound by the tighter of it and
``[upstream]``'s. Whichever runs out, before the response or in its body, the
client gets its library's own ``ReadTimeout`` (the openai SDK: ``APITimeoutError``)
and the mesh is settled. Real sockets, real SDKs; the workers stay silent far
longer than any test waits, and no duration is asserted but a generous bound.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
import trustme

from harness import wait_until
from meshkit import Mesh, Worker
from meshkit.config import UpstreamConfig
from meshkit.frontends.transport import AsyncMeshTransport, MeshTransport
from meshkit.mock import MockConfig, MockWorkerThread
from meshkit.upstream.timeouts import client_timeouts
from reliability.faultkit import metric_value, settled
from reliability.rawworker import TruncatingWorker

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES: Any = [{"role": "user", "content": "hi"}]
#: how long the silent worker keeps quiet: less than the upstream read bound the
#: tests set (30 s), so a client timeout that did not apply would end in an
#: answer, not the timeout each test expects (no wall-clock time is asserted)
SILENT_MS = 20_000


def _mesh(mesh_factory: Callable[..., Mesh], url: str, read_s: float = 30.0) -> Mesh:
    return mesh_factory(
        workers=[Worker(url)], upstream={"read_timeout_s": read_s}, lifecycle={"probe": False}
    )


@pytest.fixture
def silent(mock_factory: Callable[..., MockWorkerThread]) -> MockWorkerThread:
    """Answers nothing (plain) or nothing past the stream's head for SILENT_MS."""
    return mock_factory(name="silent", first_token_ms=SILENT_MS)


def _sync_openai(mesh: Mesh, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://mesh.invalid/v1",
        api_key="unused",
        http_client=httpx2.Client(transport=MeshTransport(mesh)),
        max_retries=0,
        **kw,
    )


def _async_openai(mesh: Mesh, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://mesh.invalid/v1",
        api_key="unused",
        http_client=httpx2.AsyncClient(transport=AsyncMeshTransport(mesh)),
        max_retries=0,
        **kw,
    )


def _times_out(mesh: Mesh, kind: str, timeout: float) -> None:
    """A chat through the ``kind`` ("sync", "async") openai SDK with ``timeout``
    raises its APITimeoutError."""
    if kind == "sync":
        with _sync_openai(mesh, timeout=timeout) as client, pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model="m", messages=MESSAGES)
        return

    async def go() -> None:
        async with _async_openai(mesh, timeout=timeout) as client:
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(model="m", messages=MESSAGES)

    asyncio.run(go())


# -- the openai SDK -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["client", "call"])
def test_the_sdks_timeout_is_an_api_timeout_error(
    silent: MockWorkerThread, mesh_factory: Callable[..., Mesh], where: str
) -> None:
    mesh = _mesh(mesh_factory, silent.url, read_s=30.0)
    client = _sync_openai(mesh, **({"timeout": 0.5} if where == "client" else {}))
    call: dict[str, Any] = {"timeout": 0.5} if where == "call" else {}
    with client, pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="m", messages=MESSAGES, **call)
    assert wait_until(lambda: settled(mesh))
    # The client gave up, not the operator's bound: no upstream_timeout counted.
    assert metric_value(mesh, "mesh_router_rejections_total", code="upstream_timeout") == 0


def test_the_async_sdks_timeout_is_an_api_timeout_error(
    silent: MockWorkerThread, mesh_factory: Callable[..., Mesh]
) -> None:
    mesh = _mesh(mesh_factory, silent.url, read_s=30.0)

    async def go() -> None:
        async with _async_openai(mesh, timeout=0.5) as client:
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(model="m", messages=MESSAGES)

    asyncio.run(go())
    assert wait_until(lambda: settled(mesh))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_upstream_bound_wins_when_it_is_tighter(
    silent: MockWorkerThread, mesh_factory: Callable[..., Mesh], kind: str
) -> None:
    """``[upstream].read_timeout_s`` is the operator's bound: the same exception as
    the client's own (not a 504 response), and it counts against the worker."""
    mesh = _mesh(mesh_factory, silent.url, read_s=0.5)
    _times_out(mesh, kind, 30.0)
    assert wait_until(lambda: settled(mesh))
    assert metric_value(mesh, "mesh_router_rejections_total", code="upstream_timeout") == 1


def test_a_silence_mid_stream_raises_from_the_iterator(
    silent: MockWorkerThread, mesh_factory: Callable[..., Mesh]
) -> None:
    """The stream's head came at once, then nothing: the iterator raises the
    library's ReadTimeout (no error event first), which the SDK raises as its
    APITimeoutError, and the books close."""
    mesh = _mesh(mesh_factory, silent.url, read_s=30.0)
    with _sync_openai(mesh, timeout=0.5) as client:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises(openai.APITimeoutError) as info:
            for _ in stream:
                pass
        stream.close()
    assert isinstance(info.value.__cause__, httpx2.ReadTimeout)
    assert wait_until(lambda: settled(mesh))


@pytest.mark.parametrize("read_s", [30.0, 0.5], ids=["client-bound", "upstream-bound"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stream_the_worker_leaves_silent_raises_in_both_transports(
    silent: MockWorkerThread, mesh_factory: Callable[..., Mesh], kind: str, read_s: float
) -> None:
    mesh = _mesh(mesh_factory, silent.url, read_s=read_s)
    timeout = httpx2.Timeout(30.0 if read_s < 1 else 0.5)
    body = {**CHAT, "stream": True}
    got: list[bytes] = []
    if kind == "sync":
        client = httpx2.Client(
            transport=MeshTransport(mesh), base_url="http://mesh", timeout=timeout
        )
        with client, client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            with pytest.raises(httpx2.ReadTimeout):
                got.extend(r.iter_raw())
    else:

        async def read(r: httpx2.Response) -> None:
            async for chunk in r.aiter_raw():
                got.append(chunk)

        async def go() -> None:
            transport = AsyncMeshTransport(mesh)
            aclient = httpx2.AsyncClient(
                transport=transport, base_url="http://mesh", timeout=timeout
            )
            async with aclient, aclient.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                with pytest.raises(httpx2.ReadTimeout):
                    await read(r)

        asyncio.run(go())
    assert b"upstream_error" not in b"".join(got)  # no error event: a direct connection's end
    assert wait_until(lambda: settled(mesh))


def test_the_clients_own_timeouts_do_not_open_the_workers_breaker(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    """A client that gives up early is no failure of the worker: past the breaker's
    threshold of such timeouts the worker still serves a patient client."""
    slow = mock_factory(name="slow", first_token_ms=1500)
    mesh = mesh_factory(
        workers=[Worker(slow.url)],
        upstream={"read_timeout_s": 30.0},
        lifecycle={"probe": False, "breaker_failures": 2},
    )
    with _sync_openai(mesh) as client:
        for _ in range(3):
            with pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(model="m", messages=MESSAGES, timeout=0.2)
        reply = client.chat.completions.create(model="m", messages=MESSAGES, timeout=20)
    assert reply.choices[0].message.content
    assert wait_until(lambda: settled(mesh))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_prefill_leg_beside_the_decode_gets_the_clients_bound(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh], kind: str
) -> None:
    """SGLang's prefill leg runs beside the decode leg (on a thread of the sync
    transport's): it is bound by the client's timeout too."""
    prefill = mock_factory(name="p", pd_role="prefill", first_token_ms=SILENT_MS)
    decode = mock_factory(name="d", pd_role="decode")
    mesh = mesh_factory(
        workers=[
            Worker(prefill.url, labels={"mesh.role": "prefill"}),
            Worker(decode.url, labels={"mesh.role": "decode"}),
        ],
        pd={"protocol": "sglang"},
        upstream={"read_timeout_s": 30.0},
        lifecycle={"probe": False},
    )
    _times_out(mesh, kind, 0.5)
    assert wait_until(lambda: settled(mesh))


@pytest.mark.parametrize("read_s", [30.0, 0.5], ids=["client-bound", "upstream-bound"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_whole_body_the_worker_leaves_silent_raises(
    mesh_factory: Callable[..., Mesh], kind: str, read_s: float
) -> None:
    half = TruncatingWorker(silent_s=SILENT_MS / 1000)
    try:
        mesh = _mesh(mesh_factory, half.url, read_s=read_s)
        timeout = 30.0 if read_s < 1 else 0.5
        if kind == "sync":
            client = httpx2.Client(
                transport=MeshTransport(mesh), base_url="http://mesh", timeout=timeout
            )
            with client, pytest.raises(httpx2.ReadTimeout):
                client.post("/v1/chat/completions", json=CHAT)
        else:

            async def go() -> None:
                transport = AsyncMeshTransport(mesh)
                aclient = httpx2.AsyncClient(
                    transport=transport, base_url="http://mesh", timeout=timeout
                )
                async with aclient:
                    with pytest.raises(httpx2.ReadTimeout):
                        await aclient.post("/v1/chat/completions", json=CHAT)

            asyncio.run(go())
        assert wait_until(lambda: settled(mesh))
    finally:
        half.close()


# -- plain httpx and httpx2 clients ---------------------------------------------------


@pytest.mark.parametrize("lib", [httpx, httpx2], ids=["httpx", "httpx2"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_plain_client_gets_its_librarys_read_timeout(
    silent: MockWorkerThread, mesh_factory: Callable[..., Mesh], lib: Any, kind: str
) -> None:
    mesh = _mesh(mesh_factory, silent.url, read_s=30.0)
    if kind == "sync":
        with (
            lib.Client(
                transport=MeshTransport(mesh), base_url="http://mesh", timeout=lib.Timeout(0.5)
            ) as c,
            pytest.raises(lib.ReadTimeout),
        ):
            c.post("/v1/chat/completions", json=CHAT)
    else:

        async def go() -> None:
            async with lib.AsyncClient(
                transport=AsyncMeshTransport(mesh), base_url="http://mesh", timeout=lib.Timeout(0.5)
            ) as c:
                with pytest.raises(lib.ReadTimeout):
                    await c.post("/v1/chat/completions", json=CHAT)

        asyncio.run(go())
    assert wait_until(lambda: settled(mesh))


def test_a_passed_through_request_gets_the_read_timeout(
    silent: MockWorkerThread, mesh_factory: Callable[..., Mesh]
) -> None:
    """Not an inference path (relayed as is): the same bound and the same error."""
    worker = silent.worker
    original = worker.app.handle

    def handle(req: Any) -> Any:
        if req.path == b"/slow":  # a chat completion, as silent as the others
            req.path = b"/v1/chat/completions"
        return original(req)

    worker.app.handle = handle  # type: ignore[method-assign]
    mesh = _mesh(mesh_factory, silent.url, read_s=30.0)
    client = httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh", timeout=0.5)
    with client, pytest.raises(httpx2.ReadTimeout):
        client.post("/slow", json=CHAT)
    assert wait_until(lambda: settled(mesh))


# -- the inner transport and https workers (httpcore) ---------------------------------


def test_an_inner_transport_gets_the_tighter_bounds(
    silent: MockWorkerThread, mesh_factory: Callable[..., Mesh]
) -> None:
    mesh = _mesh(mesh_factory, silent.url, read_s=30.0)
    seen: list[dict[str, Any]] = []

    class Spy(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(dict(request.extensions["timeout"]))
            return super().handle_request(request)

    transport = MeshTransport(mesh, inner=Spy())
    client = httpx.Client(transport=transport, base_url="http://mesh", timeout=0.5)
    with client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=CHAT)
    assert seen == [{"connect": 0.5, "pool": 0.5, "read": 0.5, "write": 0.5}]
    assert wait_until(lambda: settled(mesh))


@pytest.fixture
def tls_silent(tmp_path: Path) -> Iterator[tuple[MockWorkerThread, str]]:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    worker = MockWorkerThread(MockConfig(name="tls", first_token_ms=SILENT_MS), ssl=ctx)
    worker.start()
    yield worker, str(ca_file)
    worker.stop()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_https_worker_gets_the_clients_bound(
    tls_silent: tuple[MockWorkerThread, str], mesh_factory: Callable[..., Mesh], kind: str
) -> None:
    worker, ca_file = tls_silent
    mesh = mesh_factory(
        workers=[Worker(worker.url, tls_ca_file=ca_file)],
        upstream={"read_timeout_s": 30.0},
        lifecycle={"probe": False},
    )
    _times_out(mesh, kind, 1.0)
    assert wait_until(lambda: settled(mesh))


# -- the bounds a request carries --------------------------------------------------------


def _ext(connect: Any = None, read: Any = None, write: Any = None, pool: Any = None) -> Any:
    return {"connect": connect, "read": read, "write": write, "pool": pool}


def test_no_bounds_when_the_clients_are_no_tighter() -> None:
    config = UpstreamConfig(connect_timeout_s=5.0, read_timeout_s=600.0)
    assert client_timeouts(config, _ext()) is None  # unbounded: [upstream]'s
    assert client_timeouts(config, _ext(5.0, 600.0, 600.0, 600.0)) is None  # the openai default
    assert client_timeouts(config, _ext(10.0, 900.0, 0, -1)) is None  # <= 0: unbounded


def test_the_bounds_are_the_tighter_per_side() -> None:
    config = UpstreamConfig(connect_timeout_s=5.0, read_timeout_s=600.0)
    t = client_timeouts(config, _ext(2.0, 30.0, None, 9.0))
    assert t is not None
    assert (t.connect, t.read, t.write) == (2.0, 30.0, None)
    assert t.extensions == {"timeout": {"connect": 2.0, "pool": 2.0, "read": 30.0, "write": 600.0}}
    # the pool wait is bound with the connect: the smaller of the two
    t = client_timeouts(config, _ext(None, None, 1.0, 0.5))
    assert t is not None
    assert (t.connect, t.read, t.write) == (0.5, None, 1.0)
    assert t.extensions["timeout"] == {"connect": 0.5, "pool": 0.5, "read": 600.0, "write": 1.0}


def test_an_unbounded_upstream_takes_the_clients_bounds() -> None:
    config = UpstreamConfig(connect_timeout_s=0, read_timeout_s=0)
    t = client_timeouts(config, _ext(3.0, 4.0, None, None))
    assert t is not None
    assert t.extensions["timeout"] == {"connect": 3.0, "pool": 3.0, "read": 4.0, "write": None}


# -- a worker waking up -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_request_for_a_waking_worker_is_held_no_longer_than_the_clients_timeout(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh], kind: str
) -> None:
    # The wake takes 20 s and the hold may last 30 s (wake_wait_s): a hold past the
    # client's 1 s would end in a 200, not the 503 the client gets at its bound.
    from lifecycle.conftest import asleep_worker

    mock, mesh, _ = asleep_worker(
        mock_factory, mesh_factory, wake_ms=SILENT_MS, lifecycle={"wake_wait_s": 30.0}
    )
    if kind == "sync":
        with (
            _sync_openai(mesh, timeout=1.0) as client,
            pytest.raises(openai.InternalServerError) as ei,
        ):
            client.chat.completions.create(model="m", messages=MESSAGES)
    else:

        async def go() -> Any:
            async with _async_openai(mesh, timeout=1.0) as client:
                with pytest.raises(openai.InternalServerError) as raised:
                    await client.chat.completions.create(model="m", messages=MESSAGES)
                return raised

        ei = asyncio.run(go())
    assert ei.value.status_code == 503
    assert ei.value.code == "worker_waking"
    assert ei.value.response.headers["retry-after"]
    assert mock.worker.stats.wake_calls == 1  # the wake goes on for the next request
    assert wait_until(lambda: settled(mesh))


# -- the prepare pool ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_request_held_in_the_prepare_queue_gets_the_clients_pool_timeout(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh], kind: str
) -> None:
    """The pool's one thread is busy and every body goes through the pool: the
    request waits in its queue, which ``[prepare]`` bounds at 30 s. The client's
    0.5 s bounds it first, and it is the client's timeout, not a 504 answer."""
    worker = mock_factory(name="w")
    mesh = mesh_factory(
        workers=[Worker(worker.url)],
        lifecycle={"probe": False},
        prepare={"workers": 1, "inline_threshold_bytes": 1, "queue_timeout_ms": 30_000},
    )
    release = threading.Event()
    busy = mesh.pool.submit(lambda: release.wait(30))
    try:
        _times_out(mesh, kind, 0.5)
        assert worker.worker.stats.requests_total == {}  # never placed
        # Gone from the queue (never run): a timeout of the pool's, not a refusal.
        assert wait_until(lambda: mesh.pool.queued == 0)
        assert mesh.pool.outcomes["timeout"] == 1
        assert metric_value(mesh, "mesh_router_rejections_total", code="prepare_timeout") == 0
    finally:
        release.set()
        busy.result()
    # With the pool free again the same client is answered.
    with _sync_openai(mesh, timeout=5.0) as client:
        assert client.chat.completions.create(model="m", messages=MESSAGES).choices


@pytest.mark.parametrize("bound", [2, None])
def test_the_timeouts_a_transport_remembers_are_bounded_by_max_cached_timeouts(
    bound: int | None,
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
) -> None:
    worker = mock_factory(name="w")
    cached = {} if bound is None else {"max_cached_timeouts": bound}
    mesh = mesh_factory(workers=[Worker(worker.url)], upstream=cached, lifecycle={"probe": False})
    transport = MeshTransport(mesh)
    with httpx2.Client(transport=transport, base_url="http://mesh.invalid") as client:
        for seconds in (5.0, 6.0, 7.0, 8.0, 9.0):
            r = client.post("/v1/chat/completions", json=CHAT, timeout=seconds)
            assert r.status_code == 200
    assert 0 < len(transport._bounds) <= (bound or 5)
    assert bound or len(transport._bounds) == 5  # under the default: each one kept
