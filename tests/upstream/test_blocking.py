"""SyncFastUpstream: the blocking-socket relay, against mock workers and a scripted server.

Mirrors ``test_fastrelay.py`` (the asynchronous ``FastUpstream``) with real sockets on
127.0.0.1: a threaded raw HTTP server answers each request with scripted bytes, and
the mock worker gives the normal answers, compared with what a plain ``httpx2.Client``
gets. The ``upstream`` fixture closes each upstream and checks its accounting
(:func:`settled`) after the test; the tests check it at rest as they go. No pytest
timeout is installed: the server's threads are daemons and every blocking wait (the
server's sockets, joins, events) is bounded by ``HANG_S``, so a hang fails instead of
blocking the suite. No wall-clock duration is asserted.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import struct
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
from meshkit.errors import InvalidRequest
from meshkit.frontends.transport import MeshTransport, _SyncBody
from meshkit.mock import MockWorkerThread
from meshkit.upstream.blocking import JOIN_LIMIT, SyncFastUpstream
from meshkit.upstream.drive import UpstreamFailure
from upstreams import CHUNKED_SSE, INJECTED_HEADERS, JSON
from upstreams import attempt as make_attempt

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
#: the bound of every blocking wait in these tests (a hang fails after it)
HANG_S = 10.0


# -- attempts, upstreams and the pool's accounting ---------------------------------------------


def attempt(url: str, body: bytes = b"{}", **kw: Any) -> Attempt:
    """:func:`upstreams.attempt` with a JSON body by default."""
    return make_attempt(url, body, **kw)


def config(**kw: Any) -> UpstreamConfig:
    return UpstreamConfig(**kw)


@pytest.fixture
def upstream() -> Iterator[Callable[..., SyncFastUpstream]]:
    """``upstream(**config)``: a SyncFastUpstream, closed (and checked settled) at teardown."""
    made: list[SyncFastUpstream] = []

    def make(**kw: Any) -> SyncFastUpstream:
        kw.setdefault("read_timeout_s", HANG_S)  # a client waiting on a broken script fails
        up = SyncFastUpstream(config(**kw))
        made.append(up)
        return up

    yield make
    for up in made:
        up.close()
        assert settled(up)
        assert up._total == 0  # close() left no idle socket behind


def collect(up: SyncFastUpstream, a: Attempt) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers (names lowercased) and whole body of one exchange, closed."""
    ex = up.send_sync(a)
    try:
        body = b"".join(ex.chunks())
    finally:
        ex.close()
    return ex.status, [(k.lower(), v) for k, v in ex.headers], body


def drain(chunks: Iterator[bytes], into: list[bytes]) -> None:
    """Read ``chunks`` into ``into`` until it ends or fails (what came first is kept)."""
    for c in chunks:
        into.append(c)


def idle(up: SyncFastUpstream) -> list[socket.socket]:
    """The idle sockets of every pool."""
    return [c.sock for p in up._pools.values() for c in p.idle]


def settled(up: SyncFastUpstream) -> bool:
    """At rest (no exchange open), the counts match the sockets really held: every
    counted socket is idle in its pool, and every idle one is open."""
    pools = up._pools.values()
    return (
        up._total == sum(p.count for p in pools)
        and all(p.count == len(p.idle) for p in pools)
        and all(s.fileno() >= 0 for s in idle(up))
    )


def waiters(up: SyncFastUpstream) -> int:
    """Threads waiting for room in a pool (CPython's Condition keeps them in ``_waiters``)."""
    return len(up._freed._waiters)  # type: ignore[attr-defined]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Background(threading.Thread):
    """Runs ``fn`` on a daemon thread; :meth:`result` joins it (bounded) and returns
    what it returned, or raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self._result: Any = None
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # handed to the test thread by result()
            self._error = exc

    def result(self) -> Any:
        self.join(HANG_S)
        assert not self.is_alive(), "the background request hung"
        if self._error is not None:
            raise self._error
        return self._result


# -- a scripted raw server ------------------------------------------------------------------

Script = Callable[["RawServer", socket.socket, int, bytes, bytes], bool]


def ok_script(srv: RawServer, s: socket.socket, n: int, head: bytes, body: bytes) -> bool:
    s.sendall(OK)
    return True


class RawServer:
    """Accepts connections on 127.0.0.1, each served on a daemon thread: reads requests
    (content-length bodies) and answers them with ``script``, which returns False to
    close the connection. ``n`` counts the requests on that connection.

    ``eofs`` counts the connections the client closed or reset. A script's own
    failure (an assert, a hang past ``HANG_S``) is raised again when the server exits.
    """

    def __init__(self, script: Script = ok_script) -> None:
        self.script = script
        self.accepts = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.eofs = 0
        self.errors: list[BaseException] = []
        self.gate = threading.Event()  # scripts that hold an answer wait for it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # the accept loop looks at _stop this often
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> RawServer:
        self._spawn(self._accept_loop)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.gate.set()
        accept_loop, *_ = self._threads
        accept_loop.join(HANG_S)  # then no connection is added any more
        self._listener.close()
        for s in self._conns:
            # shutdown wakes a thread blocked in recv (close alone does not)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(HANG_S)
        if self.errors and exc[0] is None:
            raise self.errors[0]

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                s, _ = self._listener.accept()
            except TimeoutError:
                continue
            s.settimeout(HANG_S)
            with self._lock:
                self.accepts += 1
                self._conns.append(s)
            self._spawn(self._serve, s)

    def _serve(self, s: socket.socket) -> None:
        buf = bytearray()
        n = 0
        try:
            while True:
                got = _read_request(s, buf)
                if got is None:  # the client closed between requests
                    self.client_left()
                    return
                with self._lock:
                    self.requests.append(got)
                if not self.script(self, s, n, *got):
                    return
                n += 1
        except (ConnectionError, EOFError):
            self.client_left()
        except BaseException as exc:
            if not self._stop.is_set():
                self.errors.append(exc)
        finally:
            s.close()

    def client_left(self) -> None:
        if not self._stop.is_set():
            with self._lock:
                self.eofs += 1

    def wait_client_left(self, s: socket.socket) -> bool:
        """Read until the client closes or resets (counted); False: close on our side."""
        try:
            while s.recv(65536):
                pass
        except ConnectionError:
            pass
        self.client_left()
        return False

    def wait_gate(self) -> None:
        assert self.gate.wait(HANG_S), "the test never opened the gate"


def _read_request(s: socket.socket, buf: bytearray) -> tuple[bytes, bytes] | None:
    """One request's head and body from ``s`` (``buf`` keeps what follows); None at a
    clean EOF between requests, EOFError when the connection ends inside one."""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        if not data:
            if buf:
                raise EOFError
            return None
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    m = re.search(rb"(?im)^content-length: *(\d+)", head)
    size = int(m.group(1)) if m else 0
    while len(buf) < end + size:
        data = s.recv(65536)
        if not data:
            raise EOFError
        buf += data
    body = bytes(buf[end : end + size])
    del buf[: end + size]
    return head, body


def scripted(*replies: bytes, keep: bool = True) -> Script:
    """Answer every request with ``replies`` written one by one (a tiny pause between,
    so the client meets them in separate reads)."""

    def script(srv: RawServer, s: socket.socket, n: int, head: bytes, body: bytes) -> bool:
        for part in replies:
            s.sendall(part)
            time.sleep(0.002)
        return keep

    return script


def held(*first: bytes, rest: bytes) -> Script:
    """Requests to ``/hold``: ``first`` at once, ``rest`` once the test opens the gate
    (the exchange stays busy meanwhile); any other request: ``OK``."""

    def script(srv: RawServer, s: socket.socket, n: int, head: bytes, body: bytes) -> bool:
        if not head.startswith(b"POST /hold "):
            return ok_script(srv, s, n, head, body)
        for part in first:
            s.sendall(part)
        srv.wait_gate()
        s.sendall(rest)
        return True

    return script


HOLD = held(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab", rest=b"cd")


def reset(s: socket.socket) -> None:
    """Close with an RST instead of a FIN (linger on, zero seconds)."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def stall(srv: RawServer, s: socket.socket, n: int, head: bytes, body: bytes) -> bool:
    """Never answer; see the client leave."""
    return srv.wait_client_left(s)


# -- the request head -----------------------------------------------------------------------


def test_request_head_and_body_on_the_wire(upstream: Callable[..., SyncFastUpstream]) -> None:
    with RawServer() as srv:
        up = upstream()
        a = attempt(srv.url + "/v1/x?a=1", b'{"k": 1}', headers=[*JSON, (b"x-b", b"x y")])
        assert collect(up, a) == (
            200,
            [(b"content-type", b"text/plain"), (b"content-length", b"2")],
            b"ok",
        )
        collect(up, attempt(srv.url + "/v1/models", b"", method="GET", headers=[]))
        port = srv.url.rsplit(":", 1)[1].encode()
        assert srv.requests == [
            (
                b"POST /v1/x?a=1 HTTP/1.1\r\nhost: 127.0.0.1:%s\r\ncontent-type: application/json"
                b"\r\nx-b: x y\r\ncontent-length: 8\r\n\r\n" % port,
                b'{"k": 1}',
            ),
            (b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1:%s\r\n\r\n" % port, b""),
        ]
        assert settled(up)


def test_a_body_over_the_join_limit_is_sent_after_its_head(
    upstream: Callable[..., SyncFastUpstream],
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


@pytest.mark.parametrize(
    "header",
    INJECTED_HEADERS,
)
def test_header_with_cr_or_lf_is_an_invalid_request(
    upstream: Callable[..., SyncFastUpstream], header: tuple[bytes, bytes]
) -> None:
    with RawServer() as srv:
        up = upstream()
        with pytest.raises(InvalidRequest):
            up.send_sync(attempt(srv.url + "/v1/x", headers=[*JSON, header]))
        assert srv.accepts == 0  # nothing was sent, not even a connection opened
        assert up._total == 0
        # the upstream is unharmed: the next request goes out
        assert collect(up, attempt(srv.url + "/v1/x"))[2] == b"ok"
        assert (srv.accepts, len(srv.requests)) == (1, 1)
        assert settled(up)


# -- bodies: the same bytes as a plain httpx2 client gets -----------------------------------


def _normal(body: bytes) -> bytes:
    """Without what the mock makes anew per request (ids, creation times)."""
    body = re.sub(rb"(chatcmpl|cmpl|resp|msg)[-_][\w-]+", rb"ID", body)
    return re.sub(rb'"created(_at)?":\s*\d+', b'"created":0', body)


def direct(client: httpx2.Client, a: Attempt) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The same request through httpx2, straight to the worker."""
    r = client.request(a.method, a.url, content=a.body, headers=a.headers)
    return r.status_code, [(k.lower(), v) for k, v in r.headers.raw], r.content


def test_mock_worker_bodies_match_httpx2(
    upstream: Callable[..., SyncFastUpstream], mock_factory: Callable[..., MockWorkerThread]
) -> None:
    worker = mock_factory(name="w", output_tokens=40)
    url = worker.url
    stream = json.dumps({**CHAT, "stream": True}).encode()
    cases = [
        attempt(url + "/v1/chat/completions", json.dumps(CHAT).encode()),
        attempt(url + "/v1/chat/completions", stream),
        attempt(
            url + "/v1/completions",
            json.dumps({"model": "m", "prompt": "x", "stream": True}).encode(),
        ),
        attempt(url + "/v1/chat/completions", b"{not json"),
        attempt(url + "/v1/models", b"", method="GET", headers=[]),
        attempt(url + "/nothing/here", b"", method="GET", headers=[]),
    ]
    up = upstream()
    with httpx2.Client() as client:
        for a in cases:
            ref = direct(client, a)
            got = collect(up, a)
            assert got[0] == ref[0]
            assert [k for k, _ in got[1]] == [k for k, _ in ref[1]]
            assert _normal(got[2]) == _normal(ref[2])
            assert got[2]  # not trivially equal
    # the stream is really SSE, relayed whole
    events = collect(up, cases[1])[2]
    assert events.startswith(b"data: {") and events.endswith(b"data: [DONE]\n\n")
    assert settled(up)
    assert len(idle(up)) == 1  # every answer came on one keep-alive socket


@pytest.mark.parametrize(
    ("replies", "reused"),
    [
        pytest.param(
            (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello", b" world"), True, id="length"
        ),
        pytest.param(CHUNKED_SSE, True, id="chunked-sse"),
        pytest.param(
            (b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil", b" close"),
            False,
            id="http10-until-close",
        ),
        pytest.param(
            (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil", b" close 1.1"),
            False,
            id="http11-until-close",
        ),
        pytest.param(
            (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\nend",),
            False,
            id="length-connection-close",
        ),
        pytest.param(
            (b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nend",), False, id="http10-length"
        ),
        pytest.param(
            (
                b"HTTP/1.1 100 Continue\r\n\r\n",
                b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nyes",
            ),
            True,
            id="interim-1xx",
        ),
        pytest.param((b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n",), True, id="204"),
        pytest.param(
            (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy",),
            True,
            id="503",
        ),
    ],
)
def test_framings_match_httpx2(
    upstream: Callable[..., SyncFastUpstream], replies: tuple[bytes, ...], reused: bool
) -> None:
    """Same status, headers and body as httpx2; the socket is pooled only when the
    response ended with keep-alive."""
    with RawServer(scripted(*replies, keep=reused)) as srv:
        up = upstream()
        with httpx2.Client() as client:
            ref = direct(client, attempt(srv.url + "/x"))
        got = collect(up, attempt(srv.url + "/x"))
        assert got == ref
        assert got[2] or got[0] == 204
        assert b"link" not in [k for k, _ in got[1]]  # an interim head is not the answer
        assert settled(up)
        assert len(idle(up)) == int(reused)
        # the next request: on the pooled socket, or on a new one
        assert collect(up, attempt(srv.url + "/x")) == ref
        assert srv.accepts == (2 if reused else 3)  # httpx2's own, then ours
        assert settled(up)


def test_large_body_then_reuse(upstream: Callable[..., SyncFastUpstream]) -> None:
    size = 6 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)

    def big(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + payload)
        return True

    with RawServer(big) as srv:
        up = upstream()
        for _ in range(2):
            status, _, body = collect(up, attempt(srv.url + "/big"))
            assert (status, body == payload) == (200, True)
        assert srv.accepts == 1
        assert settled(up)


def test_read_is_bounded(upstream: Callable[..., SyncFastUpstream]) -> None:
    with RawServer(scripted(*CHUNKED_SSE)) as srv:
        up = upstream()
        ex = up.send_sync(attempt(srv.url + "/x"))
        assert ex.read(9) == b"data: a\n\n"
        ex.close()  # its body had not ended: the socket is closed
        assert wait_until(lambda: srv.eofs == 1)
        ex = up.send_sync(attempt(srv.url + "/x"))
        full = ex.read(1 << 20)
        ex.close()
        assert full.endswith(b"data: [DONE]\n\n")
        assert srv.accepts == 2
        assert settled(up)


def test_a_passed_through_body_is_a_byte_stream(upstream: Callable[..., SyncFastUpstream]) -> None:
    """Pass-through requests hand the exchange to the client library as its byte stream."""
    with RawServer(scripted(*CHUNKED_SSE)) as srv:
        up = upstream()
        stream = _SyncBody(up.send_sync(attempt(srv.url + "/x")), httpx2)
        assert isinstance(stream, httpx2.SyncByteStream)
        assert b"".join(stream) == b'data: a\n\ndata: {"k": "\xc3\xa9\xe2\x82\xac"}\n\n' + (
            b"data: [DONE]\n\n"
        )
        stream.close()
        assert settled(up) and len(idle(up)) == 1


# -- HEAD -------------------------------------------------------------------------------------


def test_head_has_no_body_and_its_socket_is_not_reused(
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    # A HEAD answer states the length of the body a GET would get, and sends none.
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 11\r\n\r\n"
    with RawServer(scripted(reply)) as srv:
        up = upstream()
        status, headers, body = collect(up, attempt(srv.url + "/x", b"", method="HEAD"))
        assert (status, body) == (200, b"")
        assert (b"content-length", b"11") in headers
        assert srv.requests[0][0].startswith(b"HEAD /x HTTP/1.1\r\n")
        assert wait_until(lambda: srv.eofs == 1)  # the client closed it
        assert up._total == 0
        collect(up, attempt(srv.url + "/x", b"", method="HEAD"))
        assert srv.accepts == 2  # a new connection
        assert settled(up)


# -- connection reuse, idle expiry and pool limits -------------------------------------------


def test_one_socket_for_sequential_requests(upstream: Callable[..., SyncFastUpstream]) -> None:
    with RawServer() as srv:
        up = upstream()
        for i in range(20):
            assert collect(up, attempt(srv.url + f"/x/{i}"))[::2] == (200, b"ok")
        assert srv.accepts == 1
        assert len(srv.requests) == 20
        assert srv.requests[3][0].startswith(b"POST /x/3 HTTP/1.1\r\n")
        assert settled(up) and up._total == 1


def test_a_response_read_with_its_head_frees_its_socket_at_once(
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    """A small answer that came whole with its head is over: its socket is back in the
    pool before the caller reads (or closes) the exchange."""
    with RawServer() as srv:
        up = upstream()
        ex = up.send_sync(attempt(srv.url + "/x"))
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
    upstream: Callable[..., SyncFastUpstream], extra: bytes
) -> None:
    """What follows a complete response (sent with it) is no answer to anything: the
    response is good, its socket is not reused."""
    with RawServer(scripted(OK + extra)) as srv:
        up = upstream()
        for _ in range(2):
            assert collect(up, attempt(srv.url + "/x"))[::2] == (200, b"ok")
        assert srv.accepts == 2
        assert settled(up) and up._total == 0


def test_bytes_on_an_idle_socket_spoil_it(upstream: Callable[..., SyncFastUpstream]) -> None:
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


def test_idle_sockets_expire(upstream: Callable[..., SyncFastUpstream]) -> None:
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
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    with RawServer(HOLD) as srv:
        up = upstream()
        # two sockets at once, then both idle: b's first (its answer came whole), a's last
        a = up.send_sync(attempt(srv.url + "/hold"))
        b = up.send_sync(attempt(srv.url + "/x"))
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
    upstream: Callable[..., SyncFastUpstream], how: str
) -> None:
    with RawServer(HOLD) as srv:
        up = upstream(pool_limit_per_worker=1, connect_timeout_s=HANG_S)
        ex = up.send_sync(attempt(srv.url + "/hold"))
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


def test_pool_limit_wait_is_bounded(upstream: Callable[..., SyncFastUpstream]) -> None:
    with RawServer(HOLD) as srv:
        up = upstream(pool_limit_per_worker=1, connect_timeout_s=0.1)
        ex = up.send_sync(attempt(srv.url + "/hold"))
        # on a thread: a wait that ignored its bound would hang the test, not fail it
        waiting = Background(lambda: up.send_sync(attempt(srv.url + "/x")))
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
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    with RawServer() as a, RawServer(HOLD) as b:
        up = upstream(pool_limit=1, connect_timeout_s=HANG_S)
        collect(up, attempt(a.url + "/x"))  # a's socket idles
        collect(up, attempt(b.url + "/x"))  # evicts it
        assert wait_until(lambda: a.eofs == 1)
        assert (up._pools[a.url].count, up._pools[b.url].count, up._total) == (0, 1, 1)
        assert settled(up)
        # b's socket busy: a request to a waits for it, then evicts it once idle
        ex = up.send_sync(attempt(b.url + "/hold"))
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
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    """A waiter for its worker's limit and one for the total limit: a socket of a third
    worker going idle is room for the second only, and must reach it."""
    with RawServer(HOLD) as x, RawServer(HOLD) as y, RawServer() as z:
        up = upstream(pool_limit=2, pool_limit_per_worker=1, connect_timeout_s=5.0)
        ex_x = up.send_sync(attempt(x.url + "/hold"))
        ex_y = up.send_sync(attempt(y.url + "/hold"))
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


# -- failures --------------------------------------------------------------------------------


def test_connect_refused_is_connect(upstream: Callable[..., SyncFastUpstream]) -> None:
    up = upstream(connect_timeout_s=1.0)
    with pytest.raises(UpstreamFailure) as info:
        up.send_sync(attempt(f"http://127.0.0.1:{free_port()}/v1/x"))
    assert info.value.failure is Failure.CONNECT
    assert settled(up) and up._total == 0


def test_stalled_head_is_timeout(upstream: Callable[..., SyncFastUpstream]) -> None:
    with RawServer(stall) as srv:
        up = upstream(read_timeout_s=0.2)
        with pytest.raises(UpstreamFailure) as info:
            up.send_sync(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.TIMEOUT
        assert wait_until(lambda: srv.eofs == 1)  # the socket was closed
        assert settled(up) and up._total == 0


def test_silence_is_bounded_on_every_request_of_a_keep_alive_socket(
    upstream: Callable[..., SyncFastUpstream],
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
            up.send_sync(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.TIMEOUT
        assert srv.accepts == 1  # a timeout is not retried
        assert wait_until(lambda: srv.eofs == 1)
        assert settled(up)


def fails_after_first(up: SyncFastUpstream, ex: Any) -> None:
    """``ex``'s body gives ``b"first"``, then fails as a protocol error and its
    socket is closed by ``chunks()`` itself."""
    got: list[bytes] = []
    with pytest.raises(UpstreamFailure) as info:
        drain(ex.chunks(), got)
    assert info.value.failure is Failure.PROTOCOL
    assert got == [b"first"]
    assert up._total == 0
    ex.close()


def test_stalled_body_is_protocol(upstream: Callable[..., SyncFastUpstream]) -> None:
    part = held(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n", rest=b"")
    with RawServer(part) as srv:
        up = upstream(read_timeout_s=0.2)
        ex = up.send_sync(attempt(srv.url + "/hold"))
        fails_after_first(up, ex)
        srv.gate.set()
        assert wait_until(lambda: srv.eofs == 1)
        assert settled(up)


@pytest.mark.parametrize("how", ["reset", "fin-chunked", "fin-length"])
def test_reset_or_fin_mid_body_is_protocol(
    upstream: Callable[..., SyncFastUpstream], how: str
) -> None:
    if how == "fin-length":
        head = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst"
    else:
        head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n"

    def cut(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        s.sendall(head)
        time.sleep(0.05)  # the client has the head and its first bytes
        if how == "reset":
            reset(s)
        return False

    with RawServer(cut) as srv:
        up = upstream()
        ex = up.send_sync(attempt(srv.url + "/x"))
        fails_after_first(up, ex)
        assert settled(up)


def test_garbage_instead_of_a_response_is_protocol(
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    with RawServer(scripted(b"SSH-2.0-OpenSSH\r\n\r\n", keep=False)) as srv:
        up = upstream()
        with pytest.raises(UpstreamFailure) as info:
            up.send_sync(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.PROTOCOL
        assert srv.accepts == 1  # not retried: bytes came back
        assert settled(up) and up._total == 0


def test_a_head_cut_short_is_protocol(upstream: Callable[..., SyncFastUpstream]) -> None:
    with RawServer(scripted(b"HTTP/1.1 200 OK\r\ncontent-le", keep=False)) as srv:
        up = upstream()
        with pytest.raises(UpstreamFailure) as info:
            up.send_sync(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.PROTOCOL
        assert srv.accepts == 1
        assert settled(up)


def test_reused_socket_closed_without_answering_is_retried_once(
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    """The worker drops its idle keep-alive just as the next request arrives: no byte
    comes back; the request goes again on a new socket, invisibly."""

    def drop_second(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        return n == 0 and ok_script(srv, s, n, h, b)

    with RawServer(drop_second) as srv:
        up = upstream()
        for _ in range(4):
            assert collect(up, attempt(srv.url + "/x"))[::2] == (200, b"ok")
        assert srv.accepts == 4  # requests 2-4 each: the reused socket, then a new one
        assert len(srv.requests) == 7
        assert settled(up)


def test_reused_socket_the_worker_closed_after_answering_is_retried(
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    """The worker closes after each answer without saying ``connection: close``: the
    pooled socket is dead when reused, and the request goes again on a new one."""
    with RawServer(scripted(OK, keep=False)) as srv:
        up = upstream()
        for _ in range(3):
            assert collect(up, attempt(srv.url + "/x"))[::2] == (200, b"ok")
        assert srv.accepts == 3
        assert len(srv.requests) == 3  # each request answered once
        assert settled(up)


def test_new_socket_closed_before_a_byte_is_connect(
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    def drop(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        return False

    with RawServer(drop) as srv:
        up = upstream()
        with pytest.raises(UpstreamFailure) as info:
            up.send_sync(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.CONNECT
        assert srv.accepts == 1  # not retried: the forward flow moves it
        assert settled(up) and up._total == 0


def test_reused_then_new_socket_closed_before_a_byte_is_connect(
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    """Retried once only: when the new socket also ends without a byte, it is CONNECT."""

    def first_only(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        return len(srv.requests) == 1 and ok_script(srv, s, n, h, b)

    with RawServer(first_only) as srv:
        up = upstream()
        collect(up, attempt(srv.url + "/x"))
        with pytest.raises(UpstreamFailure) as info:
            up.send_sync(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.CONNECT
        assert (srv.accepts, len(srv.requests)) == (2, 3)
        assert settled(up) and up._total == 0


def test_early_close_mid_body_closes_the_socket(
    upstream: Callable[..., SyncFastUpstream],
) -> None:
    def part(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst")
        return srv.wait_client_left(s)

    with RawServer(part) as srv:
        up = upstream()
        ex = up.send_sync(attempt(srv.url + "/x"))
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


def test_early_close_of_a_mock_stream(
    upstream: Callable[..., SyncFastUpstream], mock_factory: Callable[..., MockWorkerThread]
) -> None:
    worker = mock_factory(name="slow", output_tokens=400, per_token_ms=10)
    body = json.dumps({**CHAT, "stream": True}).encode()
    up = upstream()
    ex = up.send_sync(attempt(worker.url + "/v1/chat/completions", body))
    it = ex.chunks()
    assert next(it).startswith(b"data: ")
    ex.close()
    assert up._total == 0
    # what arrived with the first read may still come; then no more socket to read
    with pytest.raises(UpstreamFailure):
        drain(it, [])
    # a complete response's close keeps the socket for the next one
    assert collect(up, attempt(worker.url + "/v1/models", b"", method="GET"))[0] == 200
    assert up._total == 1 and len(idle(up)) == 1
    assert wait_until(lambda: worker.worker.stats.disconnects == 1)
    assert wait_until(lambda: worker.worker.stats.active_streams == 0)
    assert settled(up)


# -- https, closing the upstream ---------------------------------------------------------------


def test_https_goes_to_the_fallback() -> None:
    sent: list[Attempt] = []
    answer = object()

    def fallback(a: Attempt) -> Any:
        sent.append(a)
        return answer

    up = SyncFastUpstream(config(), fallback=fallback)
    a = attempt(f"https://127.0.0.1:{free_port()}/v1/x")
    assert up.send_sync(a) is answer
    assert sent == [a]
    assert up._total == 0 and not up._pools
    up.close()
    # with no fallback, an https worker cannot be reached
    with pytest.raises(UpstreamFailure) as info:
        SyncFastUpstream().send_sync(a)
    assert info.value.failure is Failure.CONNECT


def test_close_closes_idle_sockets_and_busy_ones_when_they_end() -> None:
    with RawServer(HOLD) as srv:
        up = SyncFastUpstream()
        busy = up.send_sync(attempt(srv.url + "/hold"))
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
            up.send_sync(attempt(srv.url + "/x"))
        assert info.value.failure is Failure.CONNECT
        assert srv.accepts == 2


# -- end to end: MeshTransport sends http:// attempts through SyncFastUpstream ---------------


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
            fast = transport._fast["httpx2"]
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
