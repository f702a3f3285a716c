"""BlockingUpstream's own machinery: its pools (LIFO idle sockets, expiry, limits,
waits, eviction), stale sockets, the head-and-body join, and closing.

What every client does alike (the request on the wire, framings, failures, the
resend-once rule) is ``test_contract.py``'s. Real sockets on 127.0.0.1 (the raw
server of ``upstreams``); the ``upstream`` fixture closes each upstream and checks
its accounting (:func:`settled`) after the test. No wall-clock duration is asserted.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest

from harness import wait_until
from meshkit import Mesh
from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt, Failure
from meshkit.core.relay import Relay
from meshkit.frontends.relay import NO_BOOKS
from meshkit.frontends.transport import MeshTransport, _SyncStream
from meshkit.mock import MockWorkerThread
from meshkit.upstream.base import UpstreamFailure
from meshkit.upstream.blocking import JOIN_LIMIT, BlockingUpstream
from upstreams import (
    CHAT,
    CHUNKED_SSE,
    HANG_S,
    HOLD,
    OK,
    Background,
    RawServer,
    ok_script,
    scripted,
    stall,
)
from upstreams import attempt as make_attempt


def attempt(url: str, body: bytes = b"{}", **kw: Any) -> Attempt:
    """:func:`upstreams.attempt` with a JSON body by default."""
    return make_attempt(url, body, **kw)


def config(**kw: Any) -> UpstreamConfig:
    return UpstreamConfig(**kw)


@pytest.fixture
def upstream() -> Iterator[Callable[..., BlockingUpstream]]:
    """``upstream(**config)``: a BlockingUpstream, closed (and checked settled) at teardown."""
    made: list[BlockingUpstream] = []

    def make(**kw: Any) -> BlockingUpstream:
        kw.setdefault("read_timeout_s", HANG_S)  # a client waiting on a broken script fails
        up = BlockingUpstream(config(**kw))
        made.append(up)
        return up

    yield make
    for up in made:
        up.close()
        assert settled(up)
        assert up._total == 0  # close() left no idle socket behind


def collect(up: BlockingUpstream, a: Attempt) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and whole body of one exchange, closed."""
    ex = up.send(a)
    try:
        body = b"".join(ex.chunks())
    finally:
        ex.close()
    return ex.status, ex.headers, body


def idle(up: BlockingUpstream) -> list[socket.socket]:
    """The idle sockets of every pool."""
    return [c.sock for p in up._pools.values() for c in p.idle]


def settled(up: BlockingUpstream) -> bool:
    """At rest (no exchange open), the counts match the sockets really held: every
    counted socket is idle in its pool, and every idle one is open."""
    pools = up._pools.values()
    return (
        up._total == sum(p.count for p in pools)
        and all(p.count == len(p.idle) for p in pools)
        and all(s.fileno() >= 0 for s in idle(up))
    )


def waiters(up: BlockingUpstream) -> int:
    """Threads waiting for room in a pool (CPython's Condition keeps them in ``_waiters``)."""
    return len(up._freed._waiters)  # type: ignore[attr-defined]


# -- the request ------------------------------------------------------------------------------


def test_a_body_over_the_join_limit_is_sent_after_its_head(
    upstream: Callable[..., BlockingUpstream],
) -> None:
    payload = bytes(range(256)) * (4 * JOIN_LIMIT // 256)

    def sized(srv: RawServer, s: socket.socket, n: int, head: bytes, body: bytes) -> bool:
        reply = b"%d" % len(body)
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(reply), reply))
        return True

    with RawServer(sized) as srv:
        up = upstream()
        for _ in range(2):  # and the socket is still in step for the next request
            assert collect(up, attempt(srv.url + "/x", payload))[2] == b"%d" % len(payload)
        assert [body for _, body in srv.requests] == [payload, payload]
        assert srv.accepts == 1
        assert settled(up)


def test_a_passed_through_body_is_a_byte_stream(upstream: Callable[..., BlockingUpstream]) -> None:
    """Pass-through requests hand the exchange to the client library as its byte stream."""
    with RawServer(scripted(*CHUNKED_SSE)) as srv:
        up = upstream()
        stream = _SyncStream(up.send(attempt(srv.url + "/x")), Relay(NO_BOOKS, None))
        assert isinstance(stream, httpx2.SyncByteStream)
        assert b"".join(stream) == b'data: a\n\ndata: {"k": "\xc3\xa9\xe2\x82\xac"}\n\n' + (
            b"data: [DONE]\n\n"
        )
        stream.close()
        assert settled(up) and len(idle(up)) == 1


# -- connection reuse, idle expiry and pool limits -------------------------------------------


def test_a_response_read_with_its_head_frees_its_socket_at_once(
    upstream: Callable[..., BlockingUpstream],
) -> None:
    """A small answer that came whole with its head is over: its socket is back in the
    pool before the caller reads (or closes) the exchange."""
    with RawServer() as srv:
        up = upstream()
        ex = up.send(attempt(srv.url + "/x"))
        assert len(idle(up)) == 1
        assert collect(up, attempt(srv.url + "/x"))[2] == b"ok"  # the same socket
        assert list(ex.chunks()) == [b"ok"]
        ex.close()
        assert srv.accepts == 1
        assert settled(up)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nxx", id="unasked-response"),
        pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", id="unasked-bodiless-response"),
        pytest.param(b"\x00garbage", id="garbage"),
    ],
)
def test_bytes_after_a_whole_response_spoil_its_socket(
    upstream: Callable[..., BlockingUpstream], extra: bytes
) -> None:
    """What follows a complete response (sent with it) is no answer to anything: the
    response is good, its socket is not reused."""
    with RawServer(scripted(OK + extra)) as srv:
        up = upstream()
        for _ in range(2):
            assert collect(up, attempt(srv.url + "/x"))[::2] == (200, b"ok")
        assert srv.accepts == 2
        assert settled(up) and up._total == 0


def test_bytes_on_an_idle_socket_spoil_it(upstream: Callable[..., BlockingUpstream]) -> None:
    """A response sent later, while the socket idles, answers no request: the next
    request does not read it as its own, it goes on a new socket."""
    sent = threading.Event()

    def late(srv: RawServer, s: socket.socket, n: int, head: bytes, body: bytes) -> bool:
        s.sendall(OK)
        if n == 0:
            time.sleep(0.05)  # after the client has its answer and pooled the socket
            s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nxx")
            sent.set()
        return True

    with RawServer(late) as srv:
        up = upstream()
        assert collect(up, attempt(srv.url + "/x"))[2] == b"ok"
        assert sent.wait(HANG_S)
        (stale,) = idle(up)
        assert wait_until(lambda: bool(select.select([stale], [], [], 0)[0]))
        assert collect(up, attempt(srv.url + "/x"))[2] == b"ok"
        assert srv.accepts == 2
        assert stale.fileno() == -1
        assert settled(up) and up._total == 1


def test_idle_sockets_expire(upstream: Callable[..., BlockingUpstream]) -> None:
    with RawServer() as srv:
        up = upstream(idle_timeout_s=0.05)
        collect(up, attempt(srv.url + "/a"))
        (old,) = idle(up)
        time.sleep(0.2)  # idle past its time
        collect(up, attempt(srv.url + "/a"))
        assert srv.accepts == 2  # a new connection
        assert old.fileno() == -1  # the expired one was closed when met
        assert wait_until(lambda: srv.eofs == 1)
        assert settled(up) and up._total == 1


def test_idle_sockets_within_their_time_are_reused_most_recent_first(
    upstream: Callable[..., BlockingUpstream],
) -> None:
    with RawServer(HOLD) as srv:
        up = upstream()
        # two sockets at once, then both idle: b's first (its answer came whole), a's last
        a = up.send(attempt(srv.url + "/hold"))
        b = up.send(attempt(srv.url + "/x"))
        srv.gate.set()
        assert b"".join(a.chunks()) == b"abcd"
        a.close()
        b.close()
        first, last = idle(up)
        collect(up, attempt(srv.url + "/x"))
        assert idle(up) == [first, last]  # the last one was taken, and came back
        # one idle past its time is closed when met; the one under it serves
        up._pools[srv.url].idle[-1].idle_since -= 60.0
        collect(up, attempt(srv.url + "/x"))
        assert last.fileno() == -1
        assert idle(up) == [first]
        assert srv.accepts == 2
        assert settled(up)


@pytest.mark.parametrize("how", ["read", "close"])
def test_pool_limit_per_worker_waits_for_the_exchange_to_end(
    upstream: Callable[..., BlockingUpstream], how: str
) -> None:
    with RawServer(HOLD) as srv:
        up = upstream(pool_limit_per_worker=1, connect_timeout_s=HANG_S)
        ex = up.send(attempt(srv.url + "/hold"))
        second = Background(lambda: collect(up, attempt(srv.url + "/next")))
        assert wait_until(lambda: waiters(up) == 1)
        assert len(srv.requests) == 1  # the second one waits, unsent
        if how == "read":
            srv.gate.set()
            assert b"".join(ex.chunks()) == b"abcd"
        ex.close()
        assert second.result()[2] == b"ok"
        # a body read to its end hands its socket on; one closed early is gone
        assert srv.accepts == (1 if how == "read" else 2)
        assert waiters(up) == 0
        assert settled(up) and up._total == 1


def test_pool_limit_wait_is_bounded(upstream: Callable[..., BlockingUpstream]) -> None:
    with RawServer(HOLD) as srv:
        up = upstream(pool_limit_per_worker=1, connect_timeout_s=0.1)
        ex = up.send(attempt(srv.url + "/hold"))
        # on a thread: a wait that ignored its bound would hang the test, not fail it
        waiting = Background(lambda: up.send(attempt(srv.url + "/x")))
        with pytest.raises(UpstreamFailure) as info:
            waiting.result()
        # nothing was sent: the worker is busy, not failing
        assert info.value.failure is Failure.POOL
        assert (srv.accepts, len(srv.requests)) == (1, 1)
        srv.gate.set()
        assert b"".join(ex.chunks()) == b"abcd"
        ex.close()
        assert waiters(up) == 0
        assert collect(up, attempt(srv.url + "/x"))[2] == b"ok"
        assert srv.accepts == 1
        assert settled(up)


def test_total_limit_evicts_an_idle_socket_of_another_worker(
    upstream: Callable[..., BlockingUpstream],
) -> None:
    with RawServer() as a, RawServer(HOLD) as b:
        up = upstream(pool_limit=1, connect_timeout_s=HANG_S)
        collect(up, attempt(a.url + "/x"))  # a's socket idles
        collect(up, attempt(b.url + "/x"))  # evicts it
        assert wait_until(lambda: a.eofs == 1)
        assert (up._pools[a.url].count, up._pools[b.url].count, up._total) == (0, 1, 1)
        assert settled(up)
        # b's socket busy: a request to a waits for it, then evicts it once idle
        ex = up.send(attempt(b.url + "/hold"))
        other = Background(lambda: collect(up, attempt(a.url + "/x")))
        assert wait_until(lambda: waiters(up) == 1)
        b.gate.set()
        assert b"".join(ex.chunks()) == b"abcd"
        ex.close()
        assert other.result()[2] == b"ok"
        assert wait_until(lambda: b.eofs == 1)
        assert (a.accepts, b.accepts, up._total) == (2, 1, 1)
        assert settled(up)


def test_a_freed_socket_wakes_every_kind_of_waiter(
    upstream: Callable[..., BlockingUpstream],
) -> None:
    """A waiter for its worker's limit and one for the total limit: a socket of a third
    worker going idle is room for the second only, and must reach it."""
    with RawServer(HOLD) as x, RawServer(HOLD) as y, RawServer() as z:
        up = upstream(pool_limit=2, pool_limit_per_worker=1, connect_timeout_s=5.0)
        ex_x = up.send(attempt(x.url + "/hold"))
        ex_y = up.send(attempt(y.url + "/hold"))
        for_x = Background(lambda: collect(up, attempt(x.url + "/x")))  # x's limit
        assert wait_until(lambda: waiters(up) == 1)
        for_z = Background(lambda: collect(up, attempt(z.url + "/x")))  # the total
        assert wait_until(lambda: waiters(up) == 2)
        y.gate.set()
        assert b"".join(ex_y.chunks()) == b"abcd"
        ex_y.close()  # y's socket idles: z's waiter evicts it
        assert for_z.result()[2] == b"ok"
        assert wait_until(lambda: y.eofs == 1)
        x.gate.set()
        assert b"".join(ex_x.chunks()) == b"abcd"
        ex_x.close()
        assert for_x.result()[2] == b"ok"
        assert (x.accepts, y.accepts, z.accepts) == (1, 1, 1)
        assert settled(up) and up._total == 2


# -- timeouts and closing ------------------------------------------------------------------


def test_silence_is_bounded_on_every_request_of_a_keep_alive_socket(
    upstream: Callable[..., BlockingUpstream],
) -> None:
    """The read timeout bounds a later request on a reused socket too, and does not
    close a socket while it idles in the pool."""

    def script(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        return ok_script(srv, s, n, h, b) if n < 2 else stall(srv, s, n, h, b)

    with RawServer(script) as srv:
        up = upstream(read_timeout_s=0.1)
        assert collect(up, attempt(srv.url + "/x"))[2] == b"ok"
        time.sleep(0.3)  # idle past the read timeout
        assert collect(up, attempt(srv.url + "/x"))[2] == b"ok"
        assert (srv.accepts, srv.eofs) == (1, 0)
        with pytest.raises(UpstreamFailure) as info:
            up.send(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.TIMEOUT
        assert srv.accepts == 1  # a timeout is not retried
        assert wait_until(lambda: srv.eofs == 1)
        assert settled(up)


def test_early_close_mid_body_closes_the_socket(
    upstream: Callable[..., BlockingUpstream],
) -> None:
    def part(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst")
        return srv.wait_client_left(s)

    with RawServer(part) as srv:
        up = upstream()
        ex = up.send(attempt(srv.url + "/x"))
        it = ex.chunks()
        assert next(it) == b"first"
        assert up._total == 1
        ex.close()
        assert up._total == 0
        assert wait_until(lambda: srv.eofs == 1)  # the worker saw the client leave
        with pytest.raises(UpstreamFailure):
            next(it)
        ex.close()  # twice is harmless
        assert settled(up) and up._total == 0


def test_close_closes_idle_sockets_and_busy_ones_when_they_end() -> None:
    with RawServer(HOLD) as srv:
        up = BlockingUpstream()
        busy = up.send(attempt(srv.url + "/hold"))
        collect(up, attempt(srv.url + "/x"))  # on a second socket, now idle
        (pooled,) = idle(up)
        up.close()
        assert pooled.fileno() == -1
        assert wait_until(lambda: srv.eofs == 1)
        assert up._total == 1  # the busy one, still counted
        srv.gate.set()
        assert b"".join(busy.chunks()) == b"abcd"
        busy.close()  # ended with keep-alive, yet closed: the upstream is closed
        assert wait_until(lambda: srv.eofs == 2)
        assert settled(up) and up._total == 0
        with pytest.raises(UpstreamFailure) as info:
            up.send(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.CONNECT
        assert srv.accepts == 2


# -- end to end: MeshTransport sends http:// attempts through BlockingUpstream ---------------


def test_mesh_transport_uses_the_fast_upstream(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    worker = mock_factory(name="w", output_tokens=20)
    mesh = mesh_factory(workers=[worker.url], lifecycle={"probe": False})
    transport = MeshTransport(mesh)
    ports: set[int] = set()
    with httpx2.Client(transport=transport, base_url="http://mesh") as client:
        for _ in range(5):
            r = client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 20
            fast = transport._upstreams["httpx2"]
            (sock,) = idle(fast)
            ports.add(sock.getsockname()[1])
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            events = r.read()
        assert events.endswith(b"data: [DONE]\n\n")
        assert idle(fast) == [sock]
        assert ports == {sock.getsockname()[1]}  # one connection for every request
        assert worker.worker.stats.requests_total["/v1/chat/completions"] == 6
        assert list(fast._pools) == [worker.url]
        assert settled(fast) and fast._total == 1
    # closing the client closes the transport, and its idle socket
    assert sock.fileno() == -1
    assert fast._total == 0
