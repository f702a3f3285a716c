"""FastUpstream's own machinery: its pools (limits, waits, eviction, idle expiry),
the read timer kept per connection, flow control and cancellation.

What every client does alike (the request on the wire, framings, failures, the
resend-once rule) is ``test_contract.py``'s. Every check here runs on both event
loops (asyncio's and uvloop's), against the raw server of ``upstreams``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt, Failure
from meshkit.upstream.base import UpstreamFailure
from meshkit.upstream.fast import FastUpstream
from upstreams import HOLD, OK, RawServer, attempt, ok_script, scripted, stall

T = TypeVar("T")


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


async def collect(up: FastUpstream, a: Attempt) -> tuple[int, bytes]:
    ex = await up.asend(a)
    try:
        body = b"".join([c async for c in ex.chunks()])
    finally:
        await ex.aclose()
    return ex.status, body


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``pred`` without blocking the loop (a condition, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def settled(up: FastUpstream) -> bool:
    """The pool accounting matches the connections really open."""
    hub = up._hub
    if hub is None:
        return True
    counts = sum(p.count for p in hub.pools.values())
    open_ = sum(len(p.conns) for p in hub.pools.values())
    return hub.total == counts == open_


def slow_ok(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
    time.sleep(0.2)
    s.sendall(OK)
    return True


@pytest.mark.parametrize("bound", [64 * 1024, UpstreamConfig().read_buffer_bytes])
def test_large_body_flow_control(
    run: Callable[[Coroutine[Any, Any, None]], None], bound: int
) -> None:
    """Reading pauses past ``upstream.read_buffer_bytes`` unread bytes: what one
    response holds is the bound plus at most one read of the socket."""
    size = 6 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)

    def big(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + payload)
        return True

    async def go() -> None:
        with RawServer(big) as srv:
            up = FastUpstream(UpstreamConfig(read_buffer_bytes=bound))
            try:
                ex = await up.asend(attempt(srv.url + "/big", b"{}"))
                # nobody reads: reading pauses
                assert await until(lambda: ex._conn is not None and ex._conn.paused)  # type: ignore[attr-defined]
                held = ex._buffered  # type: ignore[attr-defined]
                assert bound < held <= bound + 256 * 1024, held  # asyncio reads 256 KiB at most
                got = b"".join([c async for c in ex.chunks()])
                assert got == payload
                await ex.aclose()
                # the connection went back to the pool and serves the next request
                status, body = await collect(up, attempt(srv.url + "/big", b"{}"))
                assert (status, len(body), srv.accepts) == (200, size, 1)
            finally:
                await up.aclose()

    run(go())


def test_idle_connections_expire(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def go() -> None:
        with RawServer() as srv:
            up = FastUpstream(config(idle_timeout_s=0.15))
            try:
                await collect(up, attempt(srv.url + "/a", b"{}"))
                await collect(up, attempt(srv.url + "/a", b"{}"))
                assert srv.accepts == 1
                assert await until(lambda: srv.eofs == 1)  # the sweep closes it
                assert up._hub is not None and up._hub.total == 0
                await collect(up, attempt(srv.url + "/a", b"{}"))
                assert srv.accepts == 2
                # taken after its time (before a sweep saw it): closed, a new one opens
                (pool,) = up._hub.pools.values()
                pool.idle[-1].idle_since -= 1.0
                await collect(up, attempt(srv.url + "/a", b"{}"))
                assert srv.accepts == 3
                assert await until(lambda: srv.eofs == 2)
                assert settled(up)
            finally:
                await up.aclose()
            assert await until(lambda: srv.eofs == 3)  # aclose closed the last one

    run(go())


def test_pool_limit_per_worker_waits_for_a_connection(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        with RawServer(slow_ok) as srv:
            up = FastUpstream(config(pool_limit_per_worker=1, connect_timeout_s=5.0))
            try:
                results = await asyncio.gather(
                    *(collect(up, attempt(srv.url + "/a", b"{}")) for _ in range(3))
                )
                assert [r[1] for r in results] == [b"ok"] * 3
                assert srv.accepts == 1
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_pool_limit_per_worker_wait_is_bounded(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        with RawServer(HOLD) as srv:
            up = FastUpstream(config(pool_limit_per_worker=1, connect_timeout_s=0.05))
            try:
                busy = await up.asend(attempt(srv.url + "/hold", b"{}"))
                with pytest.raises(UpstreamFailure) as info:
                    await up.asend(attempt(srv.url + "/a", b"{}"))
                # nothing was sent: the worker is busy, not failing
                assert info.value.failure is Failure.POOL
                assert len(srv.requests) == 1
                srv.gate.set()
                assert b"".join([c async for c in busy.chunks()]) == b"abcd"
                await busy.aclose()
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
        with RawServer() as a, RawServer(slow_ok) as b:
            up = FastUpstream(config(pool_limit=1, connect_timeout_s=5.0))
            try:
                await collect(up, attempt(a.url + "/x", b"{}"))  # a's connection idles
                await collect(up, attempt(b.url + "/x", b"{}"))  # evicts it
                assert await until(lambda: (a.accepts, a.eofs) == (1, 1))
                # two at once on a and b with one slot: the second waits, then runs
                got = await asyncio.gather(
                    collect(up, attempt(b.url + "/x", b"{}")),
                    collect(up, attempt(a.url + "/x", b"{}")),
                )
                assert [g[1] for g in got] == [b"ok", b"ok"]
                assert await until(lambda: (a.accepts, b.accepts, b.eofs) == (2, 1, 1))
                assert up._hub is not None and up._hub.total == 1
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

    def script(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        return ok_script(srv, s, n, h, b) if n < 2 else stall(srv, s, n, h, b)

    async def go() -> None:
        with RawServer(script) as srv:
            up = FastUpstream(config(read_timeout_s=0.1))
            try:
                assert (await collect(up, attempt(srv.url + "/x", b"{}")))[1] == b"ok"
                await asyncio.sleep(0.3)  # idle past the timeout: the timer finds it idle
                assert (await collect(up, attempt(srv.url + "/x", b"{}")))[1] == b"ok"
                assert srv.accepts == 1 and srv.eofs == 0
                with pytest.raises(UpstreamFailure) as info:
                    await up.asend(attempt(srv.url + "/x", b"{}"))
                assert info.value.failure is Failure.TIMEOUT
                assert srv.accepts == 1
                assert await until(lambda: srv.eofs == 1)
                assert settled(up)
            finally:
                await up.aclose()

    run(go())


def test_cancel_while_waiting_for_the_head_closes_the_connection(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        with RawServer(stall) as srv:
            up = FastUpstream()
            try:
                task = asyncio.ensure_future(up.asend(attempt(srv.url + "/x", b"{}")))
                assert await until(lambda: len(srv.requests) == 1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert await until(lambda: srv.eofs == 1)
                assert up._hub is not None and up._hub.total == 0
            finally:
                await up.aclose()

    run(go())


def test_the_pool_sees_the_worker_close_idle_connections(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    """An idle keep-alive the worker closes leaves the pool at once."""

    async def go() -> None:
        with RawServer(scripted(OK, keep=False)) as srv:
            up = FastUpstream()
            try:
                for _ in range(3):
                    assert (await collect(up, attempt(srv.url + "/x", b"{}")))[1] == b"ok"
                    assert await until(lambda: up._hub is not None and up._hub.total == 0)
                assert srv.accepts == 3
            finally:
                await up.aclose()

    run(go())


def test_an_early_aclose_frees_the_slot_and_an_ended_one_pools_it(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def go() -> None:
        with RawServer(HOLD) as srv:
            up = FastUpstream()
            try:
                ex = await up.asend(attempt(srv.url + "/hold", b"{}"))
                it = ex.chunks().__aiter__()
                assert await it.__anext__() == b"ab"
                await ex.aclose()
                assert up._hub is not None and up._hub.total == 0
                with pytest.raises(UpstreamFailure):
                    await it.__anext__()
                assert (await collect(up, attempt(srv.url + "/x", b"{}")))[1] == b"ok"
                assert up._hub.total == 1 and settled(up)  # pooled, for the next one
            finally:
                await up.aclose()

    run(go())


def test_a_unix_socket_carries_every_request_whatever_the_host(
    run: Callable[[Coroutine[Any, Any, Any]], Any], tmp_path: Any
) -> None:
    """``uds``: the socket decides where a request goes, the URL names its host;
    the connection is kept alive for the next request (serve --processes asks its
    siblings so). A socket nobody listens on is a connect failure."""
    path = str(tmp_path / "w.sock")
    seen: list[bytes] = []
    conns = 0

    async def main() -> None:
        nonlocal conns

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal conns
            conns += 1
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:  # the client closed it
                    return
                seen.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

        server = await asyncio.start_unix_server(serve, path)
        up = FastUpstream(config(), uds=path)
        try:
            for _ in range(2):
                got = await collect(up, attempt("http://meshkit-peer/metrics", method="GET"))
                assert got == (200, b"ok")
            missing = FastUpstream(config(), uds=str(tmp_path / "none.sock"))
            with pytest.raises(UpstreamFailure) as info:
                await missing.asend(attempt("http://meshkit-peer/health", method="GET"))
            assert info.value.failure is Failure.CONNECT
            await missing.aclose()
        finally:
            await up.aclose()
            server.close()

    run(main())
    assert conns == 1
    assert [h.split(b"\r\n", 2)[:2] for h in seen] == [
        [b"GET /metrics HTTP/1.1", b"host: meshkit-peer"]
    ] * 2


def test_a_pinned_upstream_does_not_ask_for_the_running_loop(
    run: Callable[[Coroutine[Any, Any, Any]], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pin(loop)`` (the built-in server's): requests are sent on that loop without
    ``asyncio.get_running_loop()`` (a getpid system call per call on 3.11); unpinned,
    every request asks it. ``aclose`` drops the pin with the pools."""
    asked: list[int] = []
    real = asyncio.get_running_loop

    def counting() -> asyncio.AbstractEventLoop:
        asked.append(1)
        return real()

    async def main() -> None:
        with RawServer() as srv:
            url = srv.url + "/v1/completions"
            monkeypatch.setattr(asyncio, "get_running_loop", counting)
            up = FastUpstream(config())
            try:
                assert await collect(up, attempt(url, b"{}")) == (200, b"ok")
                assert len(asked) == 1
                up.pin(real())
                for _ in range(3):
                    assert await collect(up, attempt(url, b"{}")) == (200, b"ok")
                assert len(asked) == 1
            finally:
                await up.aclose()
            assert up._pinned is None
            up2 = FastUpstream(config())
            try:
                assert await collect(up2, attempt(url, b"{}")) == (200, b"ok")
                assert len(asked) == 2
            finally:
                await up2.aclose()

    run(main())
