"""Every upstream client gives the same wire behaviour: one suite, run on each.

The clients: the fast ones (:class:`BlockingUpstream`, :class:`FastUpstream` on
asyncio's and on uvloop's loop), httpcore's and httpcore2's pools (sync and
async), and httpx and httpx2 transports given as ``inner`` (sync and async). Each
sends to the raw server of ``upstreams`` on 127.0.0.1, which records the exact
request bytes and answers scripted bytes. An async client runs on an event loop
of its own thread, driven from the test through a sync façade (:class:`Client`),
so one test body serves every client.

Where a client cannot behave the same, the test says so with the reason (see
``Kind``): httpcore and httpx cannot tell a reused connection from a new one, nor
garbage instead of a response from a close before any byte; the fast clients
cannot tell httptools that a response answers a HEAD, so they do not reuse its
connection. No wall-clock duration is asserted.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import httpx2
import pytest
import uvloop

from harness import wait_until
from meshkit.config import UpstreamConfig
from meshkit.core.forward import Failure
from meshkit.errors import InvalidRequest
from meshkit.mock import MockWorkerThread
from meshkit.testing.ports import free_port
from meshkit.upstream.base import UpstreamFailure
from meshkit.upstream.blocking import BlockingUpstream
from meshkit.upstream.fast import FastUpstream
from meshkit.upstream.httpcore_pools import HttpcoreUpstream
from meshkit.upstream.select import async_upstream, sync_upstream
from meshkit.upstream.timeouts import ClientTimeout, client_timeouts
from upstreams import (
    CHAT,
    CHUNKED_SSE,
    CHUNKED_SSE_BODY,
    HANG_S,
    HOLD,
    INJECTED_HEADERS,
    JSON,
    OK,
    RawServer,
    attempt,
    ch,
    held,
    normal,
    ok_script,
    reset,
    scripted,
    stall,
)

T = TypeVar("T")
Headers = list[tuple[bytes, bytes]]


# -- the clients ------------------------------------------------------------------------


def _limits(lib: Any, c: UpstreamConfig) -> Any:
    return lib.Limits(
        max_connections=c.pool_limit or None,
        max_keepalive_connections=c.pool_limit_per_worker or None,
        keepalive_expiry=c.idle_timeout_s,
    )


@dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[UpstreamConfig], Any]
    #: the event loop an async client runs on (None: a sync client)
    loop: str | None = None
    #: meshkit's own HTTP/1.1 (http1.py): tells a reused connection from a new one
    #: and bytes that came back from none; httpcore and httpx cannot
    fast: bool = False


KINDS = [
    Kind("blocking", BlockingUpstream, fast=True),
    Kind("asyncio", FastUpstream, loop="asyncio", fast=True),
    Kind("uvloop", FastUpstream, loop="uvloop", fast=True),
    Kind("httpcore", HttpcoreUpstream),
    Kind("httpcore-async", HttpcoreUpstream, loop="asyncio"),
    Kind("httpcore2", lambda c: HttpcoreUpstream(c, lib=httpx2)),
    Kind("httpcore2-async", lambda c: HttpcoreUpstream(c, lib=httpx2), loop="asyncio"),
    Kind("httpx", lambda c: sync_upstream(c, inner=httpx.HTTPTransport(limits=_limits(httpx, c)))),
    Kind(
        "httpx-async",
        lambda c: async_upstream(c, inner=httpx.AsyncHTTPTransport(limits=_limits(httpx, c))),
        loop="asyncio",
    ),
    Kind(
        "httpx2", lambda c: sync_upstream(c, inner=httpx2.HTTPTransport(limits=_limits(httpx2, c)))
    ),
    Kind(
        "httpx2-async",
        lambda c: async_upstream(c, inner=httpx2.AsyncHTTPTransport(limits=_limits(httpx2, c))),
        loop="asyncio",
    ),
]


class _Loop:
    """An event loop running on a daemon thread of its own."""

    def __init__(self, kind: str) -> None:
        self.loop = uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(HANG_S)

    def call(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self.run(call())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(HANG_S)
        self.loop.close()


class _AsyncExchange:
    """An async client's exchange, driven on its loop."""

    def __init__(self, loop: _Loop, ex: Any) -> None:
        self._loop = loop
        self._ex = ex
        self.status: int = ex.status
        self.headers: Headers = ex.headers

    def chunks(self) -> Iterator[bytes]:
        it = self._ex.chunks().__aiter__()

        async def step() -> bytes | None:
            try:
                chunk: bytes = await it.__anext__()
            except StopAsyncIteration:
                return None
            return chunk

        while (chunk := self._loop.run(step())) is not None:
            yield chunk

    def read(self, limit: int) -> bytes:
        data: bytes = self._loop.run(self._ex.read(limit))
        return data

    def whole(self) -> bytes | None:
        whole: bytes | None = self._loop.call(self._ex.whole)
        return whole

    def close(self) -> None:
        self._loop.run(self._ex.aclose())


class Client:
    """One upstream client, sync or async, behind the sync interface."""

    def __init__(self, kind: Kind, config: UpstreamConfig) -> None:
        self.kind = kind
        self.up = kind.make(config)
        self._loop = _Loop(kind.loop) if kind.loop else None

    def send(self, request: Any) -> Any:
        if self._loop is None:
            return self.up.send(request)
        return _AsyncExchange(self._loop, self._loop.run(self.up.asend(request)))

    def close(self) -> None:
        if self._loop is None:
            self.up.close()
            return
        self._loop.run(self.up.aclose())
        self._loop.close()


@pytest.fixture(params=KINDS, ids=[k.name for k in KINDS])
def client(request: pytest.FixtureRequest) -> Iterator[Callable[..., Client]]:
    """``client(**config)``: the client of this run, closed at teardown."""
    made: list[Client] = []

    def make(**kw: Any) -> Client:
        kw.setdefault("read_timeout_s", HANG_S)  # a client waiting on a broken script fails
        c = Client(request.param, UpstreamConfig(**kw))
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def collect(up: Client, a: Any) -> tuple[int, Headers, bytes]:
    """Status, headers and whole body of one exchange, closed."""
    ex = up.send(a)
    try:
        body = b"".join(ex.chunks())
    finally:
        ex.close()
    return ex.status, ex.headers, body


def fields(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A request head's line and its header fields (names lower-cased, sorted)."""
    line, *rest = head.split(b"\r\n")[:-2]
    pairs = [tuple(f.split(b": ", 1)) for f in rest]
    return line, sorted((k.lower(), v) for k, v in pairs)


# -- the request on the wire ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "sent"),
    [
        pytest.param("/v1/x?a=1&b=%C3%A9", b"/v1/x?a=1&b=%C3%A9", id="query"),
        pytest.param("/caf\u00e9/x y?q=x y", b"/caf%C3%A9/x%20y?q=x%20y", id="encoded"),
        pytest.param("", b"/", id="empty-path"),
    ],
)
def test_the_request_on_the_wire(client: Callable[..., Client], target: str, sent: bytes) -> None:
    with RawServer() as srv:
        up = client()
        a = attempt(srv.url + target, b'{"k": 1}', headers=[*JSON, (b"x-b", b"x y")])
        assert collect(up, a) == (
            200,
            [(b"content-type", b"text/plain"), (b"content-length", b"2")],
            b"ok",
        )
        ((head, body),) = srv.requests
        assert fields(head) == (
            b"POST %s HTTP/1.1" % sent,
            [
                (b"content-length", b"8"),
                (b"content-type", b"application/json"),
                (b"host", b"127.0.0.1:%d" % srv.port),
                (b"x-b", b"x y"),
            ],
        )
        assert body == b'{"k": 1}'


@pytest.mark.parametrize(
    ("method", "body", "length"),
    [
        # RFC 9110 §8.6: no content-length where the method anticipates no content...
        ("GET", b"", None),
        ("HEAD", b"", None),
        ("DELETE", b"", None),
        ("OPTIONS", b"", None),
        ("TRACE", b"", None),
        # ...content-length: 0 where it does
        ("POST", b"", b"0"),
        ("PUT", b"", b"0"),
        ("PATCH", b"", b"0"),
        ("PROPFIND", b"", b"0"),
        # a body is always framed
        ("DELETE", b"{}", b"2"),
        ("GET", b"{}", b"2"),
        ("POST", b"{}", b"2"),
    ],
)
def test_the_content_length_rule(
    client: Callable[..., Client], method: str, body: bytes, length: bytes | None
) -> None:
    with RawServer(scripted(b"HTTP/1.1 204 No Content\r\n\r\n")) as srv:
        up = client()
        assert collect(up, attempt(srv.url + "/x", body, method=method, headers=[])) == (
            204,
            [],
            b"",
        )
        ((head, sent),) = srv.requests
        expected = [(b"host", b"127.0.0.1:%d" % srv.port)]
        if length is not None:
            expected.insert(0, (b"content-length", length))
        assert fields(head) == (b"%s /x HTTP/1.1" % method.encode(), expected)
        assert sent == body


@pytest.mark.parametrize(
    ("target", "headers", "method"),
    [
        *(
            pytest.param("/v1/x", [*JSON, h], "POST", id=f"header-{i}")
            for i, h in enumerate(INJECTED_HEADERS)
        ),
        pytest.param("/v1/x?a=1\r\nx-injected: 1", JSON, "POST", id="crlf-in-query"),
        pytest.param("/v1/x?a=1\n", JSON, "POST", id="lf-in-query"),
        pytest.param("/v1/x\r", JSON, "POST", id="cr-in-path"),
        pytest.param("/v1/x?a=\x00", JSON, "POST", id="nul-in-query"),
        pytest.param("/v1/x", JSON, "GE T", id="method-with-space"),
        pytest.param("/v1/x", JSON, "GET\r\nx-injected: 1", id="method-with-crlf"),
        pytest.param("/v1/x", JSON, "", id="empty-method"),
    ],
)
def test_what_cannot_be_sent_as_http_is_the_clients_400(
    client: Callable[..., Client], target: str, headers: Headers, method: str
) -> None:
    with RawServer() as srv:
        up = client()
        with pytest.raises(InvalidRequest):
            up.send(attempt(srv.url + target, b"{}", method=method, headers=headers))
        assert srv.accepts == 0  # nothing was sent, not even a connection opened
        # the client is unharmed: the next request goes out
        assert collect(up, attempt(srv.url + "/v1/x", b"{}"))[2] == b"ok"
        assert (srv.accepts, len(srv.requests)) == (1, 1)


# -- responses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replies", "expected", "keep"),
    [
        pytest.param(
            (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello", b" world"),
            (200, [(b"content-length", b"11")], b"hello world"),
            True,
            id="length",
        ),
        pytest.param(
            CHUNKED_SSE,
            (
                200,
                [
                    (b"content-type", b"text/event-stream"),
                    (b"transfer-encoding", b"chunked"),
                    (b"x-mixed-case", b"Kept"),
                ],
                CHUNKED_SSE_BODY,
            ),
            True,
            id="chunked-sse",
        ),
        pytest.param(
            (b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil", b" close"),
            (200, [(b"content-type", b"text/plain")], b"until close"),
            False,
            id="http10-until-close",
        ),
        pytest.param(
            (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil", b" close 1.1"),
            (200, [(b"connection", b"close")], b"until close 1.1"),
            False,
            id="http11-until-close",
        ),
        pytest.param(
            (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\nend",),
            (200, [(b"connection", b"close"), (b"content-length", b"3")], b"end"),
            False,
            id="length-connection-close",
        ),
        pytest.param(
            (b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nend",),
            (200, [(b"content-length", b"3")], b"end"),
            False,
            id="http10-length",
        ),
        pytest.param(
            (
                b"HTTP/1.1 100 Continue\r\n\r\n",
                b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nyes",
            ),
            (200, [(b"content-length", b"3")], b"yes"),
            True,
            id="interim-1xx-skipped",
        ),
        pytest.param(
            (b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n",),
            (204, [(b"x-a", b"1")], b""),
            True,
            id="204",
        ),
        pytest.param(
            (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy",),
            (503, [(b"content-length", b"4")], b"busy"),
            True,
            id="503",
        ),
    ],
)
def test_framings(
    client: Callable[..., Client],
    replies: tuple[bytes, ...],
    expected: tuple[int, Headers, bytes],
    keep: bool,
) -> None:
    """Status, headers (names lower-cased, in order) and body as sent; the next request
    goes on the same connection when the response allowed it, else on a new one."""
    with RawServer(scripted(*replies, keep=keep)) as srv:
        up = client()
        assert collect(up, attempt(srv.url + "/x", b"{}")) == expected
        assert collect(up, attempt(srv.url + "/x", b"{}")) == expected
        assert srv.accepts == (1 if keep else 2)
        assert len(srv.requests) == 2  # each answered once: nothing was resent


def test_a_large_body_is_intact(client: Callable[..., Client]) -> None:
    size = 6 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)

    def big(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + payload)
        return True

    with RawServer(big) as srv:
        up = client()
        for _ in range(2):
            status, _, body = collect(up, attempt(srv.url + "/big", payload[:100_000]))
            assert (status, body == payload) == (200, True)
        assert srv.accepts == 1
        assert [b for _, b in srv.requests] == [payload[:100_000]] * 2


def test_a_response_to_head_has_no_body(client: Callable[..., Client]) -> None:
    # A HEAD answer states the length of the body a GET would get, and sends none.
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 11\r\n\r\n"
    with RawServer(scripted(reply)) as srv:
        up = client()
        for _ in range(2):
            status, headers, body = collect(up, attempt(srv.url + "/x", method="HEAD"))
            assert (status, body) == (200, b"")
            assert (b"content-length", b"11") in headers
        # The fast clients cannot tell httptools that a response answers a HEAD (it
        # would wait for the 11 bytes): the response ends with its head, and its
        # connection is not reused. httpcore's h11 knows, and reuses it.
        assert srv.accepts == (2 if up.kind.fast else 1)


def test_sequential_requests_share_one_connection(client: Callable[..., Client]) -> None:
    with RawServer() as srv:
        up = client()
        for i in range(10):
            assert collect(up, attempt(srv.url + f"/x/{i}", b"{}"))[::2] == (200, b"ok")
        assert srv.accepts == 1
        assert [fields(h)[0] for h, _ in srv.requests] == [
            b"POST /x/%d HTTP/1.1" % i for i in range(10)
        ]


def test_read_is_bounded(client: Callable[..., Client]) -> None:
    with RawServer(scripted(*CHUNKED_SSE)) as srv:
        up = client()
        ex = up.send(attempt(srv.url + "/x", b"{}"))
        assert ex.read(9) == b"data: a\n\n"
        ex.close()
        ex = up.send(attempt(srv.url + "/x", b"{}"))
        assert ex.read(1 << 20) == CHUNKED_SSE_BODY
        ex.close()


def test_whole_is_the_body_only_when_it_came_with_its_head(client: Callable[..., Client]) -> None:
    """``whole()``: the entire body when it already ended, else None (an exchange that
    cannot know says None, and ``chunks()`` has it all)."""
    with RawServer(HOLD) as srv:
        up = client()
        ex = up.send(attempt(srv.url + "/x", b"{}"))
        whole = ex.whole()
        # the fast clients parse the response themselves: it came whole with its head
        assert whole == b"ok" if up.kind.fast else whole in (None, b"ok")
        rest = b"".join(ex.chunks())
        assert (whole or b"") + rest == b"ok"
        ex.close()
        ex = up.send(attempt(srv.url + "/hold", b"{}"))
        assert ex.whole() is None  # half of it is held back
        srv.gate.set()
        assert b"".join(ex.chunks()) == b"abcd"
        ex.close()


def test_an_early_close_closes_the_connection(client: Callable[..., Client]) -> None:
    """Closing an exchange whose body did not end closes its connection: the worker
    sees the client leave (generation stops)."""

    def part(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst")
        return srv.wait_client_left(s)

    with RawServer(part) as srv:
        up = client()
        ex = up.send(attempt(srv.url + "/x", b"{}"))
        it = ex.chunks()
        assert next(it) == b"first"
        ex.close()
        assert wait_until(lambda: srv.eofs == 1)
        ex.close()  # twice is harmless


def test_mock_worker_answers_are_the_same_through_every_client(
    client: Callable[..., Client], mock_factory: Callable[..., MockWorkerThread]
) -> None:
    """The mock worker's answers (JSON, SSE streams, errors, listings) reach the client
    as a plain httpx2 client gets them straight from the worker."""
    worker = mock_factory(name="w", output_tokens=40)
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
    up = client()
    with httpx2.Client() as direct:
        for a in cases:
            r = direct.request(a.method, a.url, content=a.body, headers=a.headers)
            status, headers, body = collect(up, a)
            assert status == r.status_code
            assert [k for k, _ in headers] == [k.lower() for k, _ in r.headers.raw]
            assert normal(body) == normal(r.content)
            assert body  # not trivially equal
    assert normal(collect(up, cases[1])[2]).endswith(b"data: [DONE]\n\n")


# -- failures -----------------------------------------------------------------------------------


def failing(fn: Callable[[], Any]) -> Failure:
    with pytest.raises(UpstreamFailure) as info:
        fn()
    return info.value.failure


def test_connect_refused_is_connect(client: Callable[..., Client]) -> None:
    up = client(connect_timeout_s=1.0)
    url = f"http://127.0.0.1:{free_port()}/v1/x"
    assert failing(lambda: up.send(attempt(url, b"{}"))) is Failure.CONNECT


def test_a_stalled_head_is_timeout(client: Callable[..., Client]) -> None:
    with RawServer(stall) as srv:
        up = client(read_timeout_s=0.2)
        assert failing(lambda: up.send(attempt(srv.url + "/x", b"{}"))) is Failure.TIMEOUT
        assert wait_until(lambda: srv.eofs == 1)  # the connection was closed
        assert srv.accepts == 1  # a timeout is not resent: the worker may be working


def test_a_stalled_body_is_timeout(client: Callable[..., Client]) -> None:
    """Silence after the head is the read timeout too (a client transport raises its
    library's ReadTimeout for it, as a direct connection), not a broken body."""
    first = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + ch(b"first")
    with RawServer(held(first, rest=b"")) as srv:
        up = client(read_timeout_s=0.2)
        ex = up.send(attempt(srv.url + "/hold", b"{}"))
        got: list[bytes] = []
        assert failing(lambda: got.extend(ex.chunks())) is Failure.TIMEOUT
        assert got == [b"first"]
        ex.close()
        srv.gate.set()  # the script reads on, and meets the client's close
        assert wait_until(lambda: srv.eofs == 1)


@pytest.mark.parametrize("how", ["reset", "fin-chunked", "fin-length", "garbage-chunk"])
def test_a_body_cut_short_is_protocol(client: Callable[..., Client], how: str) -> None:
    if how == "fin-length":
        head = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst"
    else:
        head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + ch(b"first")

    def cut(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        s.sendall(head)
        srv.wait_gate()  # the client has the head and its first bytes
        if how == "reset":
            reset(s)
        elif how == "garbage-chunk":
            s.sendall(b"zz\r\nnot a chunk\r\n")
        return False

    with RawServer(cut) as srv:
        up = client()
        ex = up.send(attempt(srv.url + "/x", b"{}"))
        it = ex.chunks()
        assert next(it) == b"first"
        srv.gate.set()
        assert failing(lambda: next(it)) is Failure.PROTOCOL
        ex.close()


def test_garbage_with_the_head_is_protocol_from_chunks(client: Callable[..., Client]) -> None:
    """A head, then bytes that are no body, in one write: the head is answered, the
    body fails from ``chunks()`` after what came first."""
    reply = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + ch(b"first") + b"zz\r\n"
    with RawServer(scripted(reply, keep=False)) as srv:
        up = client()
        ex = up.send(attempt(srv.url + "/x", b"{}"))
        assert ex.status == 200
        got: list[bytes] = []
        assert failing(lambda: got.extend(ex.chunks())) is Failure.PROTOCOL
        assert got == [b"first"]
        ex.close()


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(b"SSH-2.0-OpenSSH\r\n\r\n", id="garbage"),
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-le", id="head-cut-short"),
    ],
)
def test_garbage_instead_of_a_response(client: Callable[..., Client], reply: bytes) -> None:
    with RawServer(scripted(reply, keep=False)) as srv:
        up = client()
        failure = failing(lambda: up.send(attempt(srv.url + "/x", b"{}")))
        if up.kind.fast:
            # Bytes came back: the worker answered, badly. Not resent.
            assert (failure, srv.accepts) == (Failure.PROTOCOL, 1)
        else:
            # httpcore (h11) raises RemoteProtocolError for garbage as for a close
            # before any byte: it cannot be told apart, so it is resent once and is
            # then CONNECT. The flow moves it to another worker either way.
            assert (failure, srv.accepts) == (Failure.CONNECT, 2)


def test_a_new_connection_closed_before_any_byte_is_connect(
    client: Callable[..., Client],
) -> None:
    def drop(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        return False

    with RawServer(drop) as srv:
        up = client()
        assert failing(lambda: up.send(attempt(srv.url + "/x", b"{}"))) is Failure.CONNECT
        # The fast clients know the connection was new: not resent, the flow moves
        # the request. httpcore cannot tell a new connection from a pooled one, so it
        # resends once (the resend-once rule's "may have been pooled").
        assert srv.accepts == (1 if up.kind.fast else 2)


def test_a_reused_connection_closed_before_any_byte_is_sent_once_more(
    client: Callable[..., Client],
) -> None:
    """The worker drops its idle keep-alive just as the next request arrives: no byte
    comes back; the request goes again on a new connection, invisibly."""

    def drop_second(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        return n == 0 and ok_script(srv, s, n, h, b)

    with RawServer(drop_second) as srv:
        up = client()
        for _ in range(3):
            assert collect(up, attempt(srv.url + "/x", b"{}"))[::2] == (200, b"ok")
        assert srv.accepts == 3  # requests 2 and 3 each: the reused one, then a new one
        assert len(srv.requests) == 5


def test_a_resent_request_closed_again_is_connect(client: Callable[..., Client]) -> None:
    """Sent once more only: when the new connection also ends without a byte, CONNECT."""

    def first_only(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        return len(srv.requests) == 1 and ok_script(srv, s, n, h, b)

    with RawServer(first_only) as srv:
        up = client()
        collect(up, attempt(srv.url + "/x", b"{}"))
        assert failing(lambda: up.send(attempt(srv.url + "/x", b"{}"))) is Failure.CONNECT
        assert (srv.accepts, len(srv.requests)) == (2, 3)


def test_a_connection_the_worker_closed_while_idle_is_not_used(
    client: Callable[..., Client],
) -> None:
    """The worker closes after each answer without saying ``connection: close``: the
    idle connection is seen to be closed, and each request is answered once."""
    with RawServer(scripted(OK, keep=False)) as srv:
        up = client()
        for _ in range(3):
            assert collect(up, attempt(srv.url + "/x", b"{}"))[::2] == (200, b"ok")
        assert srv.accepts == 3
        assert len(srv.requests) == 3


def test_a_pool_wait_is_bounded_and_is_pool(client: Callable[..., Client]) -> None:
    with RawServer(HOLD) as srv:
        up = client(pool_limit=1, connect_timeout_s=0.1)
        busy = up.send(attempt(srv.url + "/hold", b"{}"))
        assert failing(lambda: up.send(attempt(srv.url + "/x", b"{}"))) is Failure.POOL
        # nothing was sent: the worker is busy, not failing
        assert (srv.accepts, len(srv.requests)) == (1, 1)
        srv.gate.set()
        assert b"".join(busy.chunks()) == b"abcd"
        busy.close()
        assert collect(up, attempt(srv.url + "/x", b"{}"))[2] == b"ok"
        assert srv.accepts == 1


# -- the client's own timeouts (a client transport's request) --------------------------


def _bound(url: str, read: float) -> Any:
    """An attempt carrying a client's read bound, tighter than the fixture's HANG_S."""
    a = attempt(url, b"{}")
    a.timeout = client_timeouts(UpstreamConfig(read_timeout_s=HANG_S), {"read": read})
    assert a.timeout is not None
    return a


def timing_out(fn: Callable[[], Any]) -> str:
    with pytest.raises(ClientTimeout) as info:
        fn()
    return info.value.phase


def test_the_clients_read_bound_times_a_stalled_head(client: Callable[..., Client]) -> None:
    with RawServer(stall) as srv:
        up = client()
        assert timing_out(lambda: up.send(_bound(srv.url + "/x", 0.2))) == "read"
        assert wait_until(lambda: srv.eofs == 1)  # the worker sees the client leave
        assert srv.accepts == 1  # never resent


def test_the_clients_read_bound_times_a_stalled_body(client: Callable[..., Client]) -> None:
    first = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + ch(b"first")
    with RawServer(held(first, rest=b"")) as srv:
        up = client()
        ex = up.send(_bound(srv.url + "/hold", 0.2))
        got: list[bytes] = []
        assert timing_out(lambda: got.extend(ex.chunks())) == "read"
        assert got == [b"first"]
        ex.close()
        srv.gate.set()
        assert wait_until(lambda: srv.eofs == 1)


def test_the_clients_bound_ends_with_its_request(client: Callable[..., Client]) -> None:
    """A connection that served a bound request serves the next one, without a
    bound, on ``[upstream]``'s timeouts again (it is not the client's any more)."""

    def script(srv: RawServer, s: socket.socket, n: int, h: bytes, b: bytes) -> bool:
        if n == 1:
            time.sleep(0.5)  # past the first request's bound, well within HANG_S
        return ok_script(srv, s, n, h, b)

    with RawServer(script) as srv:
        up = client()
        assert collect(up, _bound(srv.url + "/x", 0.2))[2] == b"ok"
        assert collect(up, attempt(srv.url + "/x", b"{}"))[2] == b"ok"
        assert srv.accepts == 1
