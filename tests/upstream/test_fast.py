"""FastUpstream: the raw-protocol relay, against mock workers and scripted servers.

Every check runs on both event loops (asyncio's and uvloop's). The last part runs
conformance checks of ``tests/conformance/test_routing.py`` through the ASGI mode
with ``FastUpstream`` in place of the default aiohttp relay.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import uvloop

from conformance.test_routing import (
    test_a_killed_worker_is_routed_around,
    test_disconnect_mid_stream_releases_the_load,
    test_forwarded_bytes_credentials_and_dp_rank,
    test_last_worker_error_is_relayed_as_is,
    test_models_is_the_union_of_the_workers,
    test_retryable_status_moves_to_another_worker,
    test_round_robin_sequence_is_the_same_in_every_mode,
    test_stream_is_relayed_intact,
)
from harness import UvicornThread, _host_app, _ServerMode, wait_until
from meshkit import Mesh, MeshMiddleware
from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt, Failure
from meshkit.mock import MockConfig, MockWorkerThread
from meshkit.upstream.aio import AiohttpUpstream
from meshkit.upstream.drive import UpstreamFailure
from meshkit.upstream.fast import FastUpstream, build_head
from meshkit.upstream.fast_conn import HIGH_WATER
from upstreams import CHUNKED_SSE, INJECTED_HEADERS, JSON, attempt

T = TypeVar("T")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def config(**kw: Any) -> UpstreamConfig:
    return UpstreamConfig(**kw)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, T]], T]:
    def go(coro: Coroutine[Any, Any, T]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(30):  # a hang fails, not blocks the suite
                return await coro

        if request.param == "uvloop":
            return uvloop.run(bounded())
        return asyncio.run(bounded())

    return go


@pytest.fixture
def mock() -> Iterator[Callable[..., MockWorkerThread]]:
    started: list[MockWorkerThread] = []

    def make(**kw: Any) -> MockWorkerThread:
        t = MockWorkerThread(MockConfig(**kw))
        t.start()
        started.append(t)
        return t

    yield make
    for t in started:
        t.stop()


async def collect(up: Any, a: Attempt) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    ex = await up.send(a)
    try:
        body = b"".join([c async for c in ex.chunks()])
    finally:
        await ex.aclose()
    return ex.status, [(k.lower(), v) for k, v in ex.headers], body


async def drain(ex: Any, into: list[bytes]) -> None:
    async for c in ex.chunks():
        into.append(c)


def settled(up: FastUpstream) -> bool:
    """The pool accounting matches the connections really open."""
    hub = up._hub
    if hub is None:
        return True
    counts = sum(p.count for p in hub.pools.values())
    open_ = sum(len(p.conns) for p in hub.pools.values())
    return hub.total == counts == open_


# -- a scripted raw server ------------------------------------------------------------

Script = Callable[["RawServer", asyncio.StreamWriter, int, bytes, bytes], Awaitable[bool]]


async def ok_script(
    srv: RawServer, w: asyncio.StreamWriter, n: int, head: bytes, body: bytes
) -> bool:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok")
    return True


class RawServer:
    """Reads requests (content-length bodies) and answers them with ``script``;
    ``script`` returns False to close the connection. ``n`` counts the requests
    on this connection."""

    def __init__(self, script: Script = ok_script) -> None:
        self.script = script
        self.accepts = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.eofs = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.readers: dict[asyncio.StreamWriter, asyncio.StreamReader] = {}
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepts += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.readers[writer] = reader
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"(?im)^content-length: *(\d+)", head)
                body = await reader.readexactly(int(m.group(1))) if m else b""
                self.requests.append((head, body))
                keep = await self.script(self, writer, n, head, body)
                await writer.drain()
                n += 1
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eofs += 1
        except asyncio.CancelledError:
            pass  # the test is over (ending normally keeps asyncio's callback quiet)
        finally:
            writer.close()
            self.tasks.discard(task)


def scripted(*replies: bytes, keep: bool = True) -> Script:
    """Answer every request with ``replies`` written one by one (a tiny pause between)."""

    async def script(
        srv: RawServer, w: asyncio.StreamWriter, n: int, head: bytes, body: bytes
    ) -> bool:
        for part in replies:
            w.write(part)
            await w.drain()
            await asyncio.sleep(0.002)
        return keep

    return script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the request head -------------------------------------------------------------------


def test_build_head_bytes() -> None:
    line = b" /v1/x?a=1 HTTP/1.1\r\nhost: h:8000\r\n"
    head = build_head("POST", line, [(b"a", b"1"), (b"b", b"x y")], 5)
    assert head == (
        b"POST /v1/x?a=1 HTTP/1.1\r\nhost: h:8000\r\na: 1\r\nb: x y\r\ncontent-length: 5\r\n\r\n"
    )
    assert build_head("GET", line, [], 0) == b"GET /v1/x?a=1 HTTP/1.1\r\nhost: h:8000\r\n\r\n"
    assert build_head("DELETE", line, [], 0).endswith(b"content-length: 0\r\n\r\n")


@pytest.mark.parametrize(
    "header",
    INJECTED_HEADERS,
)
def test_header_with_cr_or_lf_is_refused(
    run: Callable[[Coroutine[Any, Any, None]], None], header: tuple[bytes, bytes]
) -> None:
    async def go() -> None:
        async with RawServer() as srv:
            up = FastUpstream()
            try:
                with pytest.raises(UpstreamFailure) as info:
                    await up.send(attempt(srv.url + "/v1/x", b"{}", headers=[*JSON, header]))
                assert info.value.failure is Failure.PROTOCOL
                assert srv.accepts == 0  # nothing was sent
            finally:
                await up.aclose()

    run(go())
    with pytest.raises(UpstreamFailure):
        build_head("GET /x HTTP/1.1\r\n", b" / HTTP/1.1\r\nhost: h\r\n", [], 0)


# -- bodies: the same bytes as aiohttp relays --------------------------------------------


def _normal(body: bytes) -> bytes:
    body = re.sub(rb"(chatcmpl|cmpl|resp|msg)[-_][\w-]+", rb"ID", body)
    return re.sub(rb'"created(_at)?":\s*\d+', b'"created":0', body)


def test_mock_worker_bodies_match_aiohttp(
    run: Callable[[Coroutine[Any, Any, None]], None], mock: Callable[..., MockWorkerThread]
) -> None:
    worker = mock(name="w", output_tokens=40)
    url = worker.url
    cases = [
        attempt(url + "/v1/chat/completions", json.dumps(CHAT).encode()),
        attempt(url + "/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode()),
        attempt(
            url + "/v1/completions",
            json.dumps({"model": "m", "prompt": "x", "stream": True}).encode(),
        ),
        attempt(url + "/v1/chat/completions", b"{not json"),
        attempt(url + "/v1/models", method="GET", headers=[]),
        attempt(url + "/nothing/here", method="GET", headers=[]),
    ]

    async def go() -> None:
        slow, fast = AiohttpUpstream(), FastUpstream()
        try:
            for a in cases:
                ref = await collect(slow, a)
                got = await collect(fast, a)
                assert got[0] == ref[0]
                assert [k for k, _ in got[1]] == [k for k, _ in ref[1]]
                assert _normal(got[2]) == _normal(ref[2])
                assert got[2]  # not trivially equal
        finally:
            await slow.aclose()
            await fast.aclose()

    run(go())


@pytest.mark.parametrize(
    "replies",
    [
        pytest.param(
            (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello", b" world"), id="length"
        ),
        pytest.param(CHUNKED_SSE, id="chunked-sse"),
        pytest.param(
            (b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil", b" close"),
            id="http10-until-close",
        ),
        pytest.param(
            (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil", b" close 1.1"),
            id="http11-until-close",
        ),
        pytest.param(
            (
                b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nyes",
            ),
            id="interim-1xx",
        ),
        pytest.param((b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n",), id="204"),
        pytest.param(
            (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy",), id="503"
        ),
    ],
)
def test_framings_match_aiohttp(
    run: Callable[[Coroutine[Any, Any, None]], None], replies: tuple[bytes, ...]
) -> None:
    until_close = b"content-length" not in replies[-1] and b"chunked" not in replies[0]
    keep = not until_close or replies[0].startswith(b"HTTP/1.1 204")

    async def go() -> None:
        async with RawServer(scripted(*replies, keep=keep)) as srv:
            slow, fast = AiohttpUpstream(), FastUpstream()
            try:
                # One exchange each: framing is what is compared here (reuse has its
                # own tests); a second round raced the script's close under CI load.
                for _ in range(1):
                    ref = await collect(slow, attempt(srv.url + "/x", b"{}"))
                    got = await collect(fast, attempt(srv.url + "/x", b"{}"))
                    assert got[0] == ref[0]
                    assert got[2] == ref[2]
                    assert got[1] == ref[1]
                    assert settled(fast)
            finally:
                await slow.aclose()
                await fast.aclose()

    run(go())


def test_large_body_flow_control(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    size = 6 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)

    async def big(srv: RawServer, w: asyncio.StreamWriter, n: int, h: bytes, b: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        w.write(payload)
        return True

    async def go() -> None:
        async with RawServer(big) as srv:
            up = FastUpstream()
            try:
                ex = await up.send(attempt(srv.url + "/big", b"{}"))
                await asyncio.sleep(0.3)  # nobody reads: reading pauses
                assert ex._buffered <= HIGH_WATER + 512 * 1024  # type: ignore[attr-defined]
                assert ex._conn is not None and ex._conn.paused  # type: ignore[attr-defined]
                got = b"".join([c async for c in ex.chunks()])
                assert got == payload
                await ex.aclose()
                # the connection went back to the pool and serves the next request
                status, _, body = await collect(up, attempt(srv.url + "/big", b"{}"))
                assert (status, len(body), srv.accepts) == (200, size, 1)
            finally:
                await up.aclose()

    run(go())


# -- connection reuse and pool limits -------------------------------------------------------


def test_one_connection_for_sequential_requests(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        async with RawServer() as srv:
            up = FastUpstream()
            try:
                for i in range(20):
                    status, _, body = await collect(up, attempt(srv.url + f"/x/{i}", b"{}"))
                    assert (status, body) == (200, b"ok")
                assert srv.accepts == 1
                assert len(srv.requests) == 20
                head, body = srv.requests[3]
                assert head.startswith(b"POST /x/3 HTTP/1.1\r\nhost: 127.0.0.1:")
                assert b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n" in head
                assert body == b"{}"
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_idle_connections_expire(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def go() -> None:
        async with RawServer() as srv:
            up = FastUpstream(config(idle_timeout_s=0.15))
            try:
                await collect(up, attempt(srv.url + "/a", b"{}"))
                await collect(up, attempt(srv.url + "/a", b"{}"))
                assert srv.accepts == 1
                await asyncio.sleep(0.45)  # the sweep closes it
                assert srv.eofs == 1
                assert up._hub is not None and up._hub.total == 0
                await collect(up, attempt(srv.url + "/a", b"{}"))
                assert srv.accepts == 2
                # taken after its time (before a sweep saw it): closed, a new one opens
                (pool,) = up._hub.pools.values()
                pool.idle[-1].idle_since -= 1.0
                await collect(up, attempt(srv.url + "/a", b"{}"))
                assert srv.accepts == 3
                await asyncio.sleep(0.05)
                assert srv.eofs == 2
                assert settled(up)
            finally:
                await up.aclose()
            await asyncio.sleep(0.05)
            assert srv.eofs == 3  # aclose closed the last one

    run(go())


async def _slow_ok(srv: RawServer, w: asyncio.StreamWriter, n: int, h: bytes, b: bytes) -> bool:
    await asyncio.sleep(0.2)
    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    return True


def test_pool_limit_waits_for_a_connection(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        async with RawServer(_slow_ok) as srv:
            up = FastUpstream(config(pool_limit_per_worker=1, connect_timeout_s=2.0))
            try:
                results = await asyncio.gather(
                    *(collect(up, attempt(srv.url + "/a", b"{}")) for _ in range(3))
                )
                assert [r[2] for r in results] == [b"ok"] * 3
                assert srv.accepts == 1
            finally:
                await up.aclose()

    run(go())


def test_pool_limit_wait_is_bounded(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def go() -> None:
        async with RawServer(_slow_ok) as srv:
            up = FastUpstream(config(pool_limit_per_worker=1, connect_timeout_s=0.05))
            try:
                first = asyncio.ensure_future(collect(up, attempt(srv.url + "/a", b"{}")))
                await asyncio.sleep(0.02)
                with pytest.raises(UpstreamFailure) as info:
                    await up.send(attempt(srv.url + "/a", b"{}"))
                # nothing was sent: the worker is busy, not failing
                assert info.value.failure is Failure.POOL
                assert (await first)[2] == b"ok"
                hub = up._hub
                assert hub is not None
                assert all(not p.waiters for p in hub.pools.values())
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_total_limit_evicts_idle_connections_of_other_workers(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        async with RawServer() as a, RawServer(_slow_ok) as b:
            up = FastUpstream(config(pool_limit=1, connect_timeout_s=2.0))
            try:
                await collect(up, attempt(a.url + "/x", b"{}"))  # a's connection idles
                await collect(up, attempt(b.url + "/x", b"{}"))  # evicts it
                await asyncio.sleep(0.05)
                assert (a.accepts, a.eofs) == (1, 1)
                # two at once on a and b with one slot: the second waits, then runs
                got = await asyncio.gather(
                    collect(up, attempt(b.url + "/x", b"{}")),
                    collect(up, attempt(a.url + "/x", b"{}")),
                )
                assert [g[2] for g in got] == [b"ok", b"ok"]
                await asyncio.sleep(0.05)
                assert (a.accepts, b.accepts, b.eofs) == (2, 1, 1)
                assert up._hub is not None and up._hub.total == 1
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


# -- failures -----------------------------------------------------------------------------


def test_connect_refused_is_connect(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def go() -> None:
        up = FastUpstream(config(connect_timeout_s=1.0))
        try:
            with pytest.raises(UpstreamFailure) as info:
                await up.send(attempt(f"http://127.0.0.1:{free_port()}/v1/x", b"{}"))
            assert info.value.failure is Failure.CONNECT
            assert settled(up)
        finally:
            await up.aclose()

    run(go())


async def _stall(srv: RawServer, w: asyncio.StreamWriter, n: int, h: bytes, b: bytes) -> bool:
    """Never answer; see the client leave."""
    await srv.readers[w].read()  # b"" at EOF, or a reset
    raise ConnectionResetError


def test_stalled_head_is_timeout(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def go() -> None:
        async with RawServer(_stall) as srv:
            up = FastUpstream(config(read_timeout_s=0.2))
            try:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(UpstreamFailure) as info:
                    await up.send(attempt(srv.url + "/x", b"{}"))
                assert info.value.failure is Failure.TIMEOUT
                assert loop.time() - t0 < 2.0
                await asyncio.sleep(0.05)
                assert srv.eofs == 1  # the connection was closed
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_stalled_body_is_protocol(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n"

    async def part(srv: RawServer, w: asyncio.StreamWriter, n: int, h: bytes, b: bytes) -> bool:
        w.write(head)
        await asyncio.sleep(5)
        return False

    async def go() -> None:
        async with RawServer(part) as srv:
            up = FastUpstream(config(read_timeout_s=0.2))
            try:
                ex = await up.send(attempt(srv.url + "/x", b"{}"))
                got: list[bytes] = []
                with pytest.raises(UpstreamFailure) as info:
                    await drain(ex, got)
                assert info.value.failure is Failure.PROTOCOL
                assert got == [b"first"]
                await ex.aclose()
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_silence_is_bounded_on_every_request_of_a_keep_alive_connection(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    """The read timer stays armed across the requests of a connection (it is not
    re-created per request): it still bounds the silence of a later request, and
    never closes the connection while it idles in the pool."""

    async def script(srv: RawServer, w: asyncio.StreamWriter, n: int, h: bytes, b: bytes) -> bool:
        if n < 2:
            return await ok_script(srv, w, n, h, b)
        return await _stall(srv, w, n, h, b)

    async def go() -> None:
        async with RawServer(script) as srv:
            up = FastUpstream(config(read_timeout_s=0.1))
            try:
                assert (await collect(up, attempt(srv.url + "/x", b"{}")))[2] == b"ok"
                await asyncio.sleep(0.3)  # idle past the timeout: the timer finds it idle
                assert (await collect(up, attempt(srv.url + "/x", b"{}")))[2] == b"ok"
                assert srv.accepts == 1 and srv.eofs == 0
                with pytest.raises(UpstreamFailure) as info:
                    await up.send(attempt(srv.url + "/x", b"{}"))
                assert info.value.failure is Failure.TIMEOUT
                assert srv.accepts == 1
                await asyncio.sleep(0.05)
                assert srv.eofs == 1
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_whole_is_the_body_only_once_it_ended(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        reply = scripted(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n01234", b"56789")
        async with RawServer(reply) as srv:
            up = FastUpstream()
            try:
                ex = await up.send(attempt(srv.url + "/x", b"{}"))
                assert ex.whole() is None  # half of it arrived
                await asyncio.sleep(0.1)
                assert ex.whole() == b"0123456789"
                assert [c async for c in ex.chunks()] == []  # taken
                await ex.aclose()
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


@pytest.mark.parametrize("how", ["reset", "fin-chunked", "fin-length"])
def test_reset_mid_body_is_protocol(
    run: Callable[[Coroutine[Any, Any, None]], None], how: str
) -> None:
    if how == "fin-length":
        head = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst"
    else:
        head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n"

    async def cut(srv: RawServer, w: asyncio.StreamWriter, n: int, h: bytes, b: bytes) -> bool:
        w.write(head)
        await w.drain()
        await asyncio.sleep(0.05)
        if how == "reset":
            w.transport.abort()
        return False

    async def go() -> None:
        async with RawServer(cut) as srv:
            up = FastUpstream()
            try:
                ex = await up.send(attempt(srv.url + "/x", b"{}"))
                got: list[bytes] = []
                with pytest.raises(UpstreamFailure) as info:
                    await drain(ex, got)
                assert info.value.failure is Failure.PROTOCOL
                assert got == [b"first"]
                await ex.aclose()
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_garbage_instead_of_a_response_is_protocol(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        async with RawServer(scripted(b"SSH-2.0-OpenSSH\r\n\r\n", keep=False)) as srv:
            up = FastUpstream()
            try:
                with pytest.raises(UpstreamFailure) as info:
                    await up.send(attempt(srv.url + "/x", b"{}"))
                assert info.value.failure is Failure.PROTOCOL
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_reused_connection_closed_by_the_worker_is_retried_once(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    """The worker drops its idle keep-alive just as the next request arrives: no byte
    comes back; the request goes again on a new connection, invisibly."""

    async def drop_second(
        srv: RawServer, w: asyncio.StreamWriter, n: int, h: bytes, b: bytes
    ) -> bool:
        if n >= 1:
            return False  # close without answering
        return await ok_script(srv, w, n, h, b)

    async def go() -> None:
        async with RawServer(drop_second) as srv:
            up = FastUpstream()
            try:
                for _ in range(4):
                    status, _, body = await collect(up, attempt(srv.url + "/x", b"{}"))
                    assert (status, body) == (200, b"ok")
                assert srv.accepts == 4  # requests 2-4 each: the reused one, then a new one
                assert len(srv.requests) == 7
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_new_connection_closed_before_a_byte_is_connect(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def drop(srv: RawServer, w: asyncio.StreamWriter, n: int, h: bytes, b: bytes) -> bool:
        return False

    async def go() -> None:
        async with RawServer(drop) as srv:
            up = FastUpstream()
            try:
                with pytest.raises(UpstreamFailure) as info:
                    await up.send(attempt(srv.url + "/x", b"{}"))
                assert info.value.failure is Failure.CONNECT
                assert srv.accepts == 1  # not retried: the forward flow moves it
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_worker_closing_idle_connections_is_seen(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    """An idle keep-alive the worker closes leaves the pool at once."""

    async def go() -> None:
        async with RawServer(
            scripted(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nx", keep=False)
        ) as srv:
            up = FastUpstream()
            try:
                for _ in range(3):
                    _, _, body = await collect(up, attempt(srv.url + "/x", b"{}"))
                    assert body == b"x"
                    await asyncio.sleep(0.05)
                    assert up._hub is not None and up._hub.total == 0
                assert srv.accepts == 3
            finally:
                await up.aclose()

    run(go())


def test_cancel_while_waiting_for_the_head_closes_the_connection(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        async with RawServer(_stall) as srv:
            up = FastUpstream()
            try:
                task = asyncio.ensure_future(up.send(attempt(srv.url + "/x", b"{}")))
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.sleep(0.05)
                assert srv.eofs == 1
                assert up._hub is not None and up._hub.total == 0
            finally:
                await up.aclose()

    run(go())


def test_early_aclose_closes_the_socket(
    run: Callable[[Coroutine[Any, Any, None]], None], mock: Callable[..., MockWorkerThread]
) -> None:
    worker = mock(name="slow", output_tokens=400, per_token_ms=10)
    body = json.dumps({**CHAT, "stream": True}).encode()

    async def go() -> None:
        up = FastUpstream()
        try:
            ex = await up.send(attempt(worker.url + "/v1/chat/completions", body))
            it = ex.chunks().__aiter__()
            assert (await it.__anext__()).startswith(b"data: ")
            await ex.aclose()
            assert up._hub is not None and up._hub.total == 0
            with pytest.raises(UpstreamFailure):
                await it.__anext__()
            # a complete response's aclose keeps the connection for the next one
            status, _, _ = await collect(up, attempt(worker.url + "/v1/models", method="GET"))
            assert status == 200
            assert up._hub.total == 1
        finally:
            await up.aclose()

    run(go())
    assert wait_until(lambda: worker.worker.stats.disconnects == 1)
    assert wait_until(lambda: worker.worker.stats.active_streams == 0)


def test_https_workers_go_through_aiohttp(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        up = FastUpstream(config(connect_timeout_s=1.0))
        try:
            with pytest.raises(UpstreamFailure) as info:
                await up.send(attempt(f"https://127.0.0.1:{free_port()}/v1/x", b"{}"))
            assert info.value.failure is Failure.CONNECT
            assert up._fallback is not None
        finally:
            await up.aclose()
        assert up._fallback is None

    run(go())


def test_read_is_bounded(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def go() -> None:
        async with RawServer(scripted(*CHUNKED_SSE)) as srv:
            up = FastUpstream()
            try:
                ex = await up.send(attempt(srv.url + "/x", b"{}"))
                assert await ex.read(9) == b"data: a\n\n"
                await ex.aclose()
                ex = await up.send(attempt(srv.url + "/x", b"{}"))
                full = await ex.read(1 << 20)
                await ex.aclose()
                assert full.endswith(b"data: [DONE]\n\n")
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


# -- the ASGI mode with FastUpstream: conformance checks -------------------------------------


class FastAsgiMode(_ServerMode):
    name = "asgi-fast"

    def __init__(self, mesh: Mesh) -> None:
        self.middleware = MeshMiddleware(
            _host_app, mesh=mesh, upstream=FastUpstream(mesh.config.upstream)
        )
        self.server = UvicornThread(self.middleware)
        self.base_url = self.server.__enter__()
        super().__init__(mesh)

    def close(self) -> None:
        self.client.close()
        self.server.__exit__()


@pytest.fixture
def mode_name() -> str:
    return "asgi"


@pytest.fixture
def run_mode() -> Iterator[Callable[[Mesh], FastAsgiMode]]:
    opened: list[FastAsgiMode] = []

    def start(mesh: Mesh) -> FastAsgiMode:
        m = FastAsgiMode(mesh)
        assert isinstance(m.middleware.upstream, FastUpstream)
        opened.append(m)
        return m

    yield start
    for m in opened:
        m.close()


__all__ = [
    "test_a_killed_worker_is_routed_around",
    "test_disconnect_mid_stream_releases_the_load",
    "test_forwarded_bytes_credentials_and_dp_rank",
    "test_last_worker_error_is_relayed_as_is",
    "test_models_is_the_union_of_the_workers",
    "test_retryable_status_moves_to_another_worker",
    "test_round_robin_sequence_is_the_same_in_every_mode",
    "test_stream_is_relayed_intact",
]
