"""The built-in HTTP/1.1 server (``meshkit.server.h1.conn``) on real sockets.

Framing is checked with raw ``socket`` clients and a strict little response
reader (:class:`Raw`): keep-alive, pipelining, ``Connection: close``, HTTP/1.0,
chunked uploads, ``Expect: 100-continue``, malformed requests, the bounds while
bytes stream in, ``server.max_connections``, ``server.keep_alive_s``, clients that
leave, slow readers (write back-pressure), HEAD, the ASGI bridge, graceful
shutdown and the access log. Nothing here asserts a wall-clock time: what takes
time is polled for (``wait_until``), and durations only come from the mocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import select
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httpx2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import wait_until
from meshkit import Mesh, MeshMiddleware
from meshkit.config import UpstreamConfig
from meshkit.http1 import Framing, Unsendable, build_head, response_head
from meshkit.server import build_gateway
from meshkit.server.h1.conn import H1Conn
from meshkit.server.h1.server import H1Server
from meshkit.server.runner import GatewayThread
from reliability.faultkit import assert_settled, is_anthropic_error, is_openai_error, metric_value
from reliability.rawworker import TruncatingWorker

PATH = "/v1/chat/completions"
MAX_BODY = 65_536
MAX_HEAD = 8_192
MAX_HEADERS = 64
BOUNDS = {"max_body_bytes": MAX_BODY, "max_header_bytes": MAX_HEAD, "max_headers": MAX_HEADERS}


# -- a server on a thread, and a raw client ---------------------------------------------------


class Served(GatewayThread):
    """The built-in server around ``gateway`` on its own thread and loop (uvloop,
    as ``meshkit serve``); ``call`` runs a function on that loop."""

    def __init__(self, gateway: MeshMiddleware, **kw: Any) -> None:
        super().__init__(gateway=gateway, **kw)
        self.start()

    def conns(self) -> int:
        return int(self.call(lambda: len(self.server.conns)))

    def conn_of(self, raw: Raw) -> H1Conn | None:
        """The server side of ``raw``'s connection (None once it is gone)."""
        me = f"127.0.0.1:{raw.sock.getsockname()[1]}"
        found = self.call(lambda: [c for c in self.server.conns if c.client == me])
        return found[0] if found else None

    @property
    def server(self) -> H1Server:
        assert self.h1 is not None
        return self.h1

    def close(self) -> None:
        self.stop()


@dataclass
class Resp:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    framing: str  # "length", "chunked", "close" or "none"

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        assert len(values) <= 1, (name, self.headers)
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def closes(self) -> bool:
        return (self.header("connection") or "").lower() == "close"


_STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*")
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+): ?([^\r\n]*)")


class Raw:
    """A raw HTTP/1.1 client connection with a strict response reader."""

    def __init__(self, url: str, *, rcvbuf: int | None = None, timeout: float = 15.0) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((parts.hostname, parts.port))
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return False
        if not data:
            return False
        self.buf += data
        return True

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._fill():
                raise EOFError(self.buf)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise EOFError(self.buf)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self, method: str = "GET") -> Resp:
        """Read one response; its body framed as the head says (strictly)."""
        return self.body(self.head(), method)

    def head(self) -> Resp:
        """Read a response head (the body is left to :meth:`body`)."""
        status_line = self._line()
        m = _STATUS_LINE.fullmatch(status_line)
        assert m is not None, status_line
        status = int(m.group(1))
        headers: list[tuple[str, str]] = []
        while True:
            line = self._line()
            if not line:
                break
            h = _HEADER_LINE.fullmatch(line)
            assert h is not None, line
            headers.append((h.group(1).decode().lower(), h.group(2).decode("latin-1")))
        names = [k for k, _ in headers]
        assert names.count("content-length") <= 1, headers
        assert not ("content-length" in names and "transfer-encoding" in names), headers
        return Resp(status, headers, b"", "none")

    def body(self, resp: Resp, method: str = "GET") -> Resp:
        """Read the body of the response whose head is ``resp``."""
        status = resp.status
        if method == "HEAD" or status < 200 or status in (204, 304):
            return resp
        te = resp.header("transfer-encoding")
        length = resp.header("content-length")
        if te is not None:
            assert te == "chunked", te
            resp.framing = "chunked"
            parts = []
            while True:
                size_line = self._line()
                assert re.fullmatch(rb"[0-9a-f]+", size_line), size_line
                size = int(size_line, 16)
                if size == 0:
                    assert self._line() == b""  # no trailers
                    break
                parts.append(self._exact(size))
                assert self._exact(2) == b"\r\n"
            resp.body = b"".join(parts)
        elif length is not None:
            resp.framing = "length"
            resp.body = self._exact(int(length))
        else:
            resp.framing = "close"
            while self._fill():
                pass
            resp.body, self.buf = self.buf, b""
        return resp

    def closed(self) -> bool:
        """Whether the server closes the connection (EOF or reset) with nothing
        more sent; False when it stays open (the socket timeout passed)."""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                self.buf += data
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        assert self.buf == b"", self.buf
        return True

    def readable(self) -> bool:
        return bool(self.buf) or bool(select.select([self.sock], [], [], 0)[0])

    def leave(self) -> None:
        """Close abruptly (RST), the way a killed client goes."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


def request(
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    headers: tuple[tuple[str, str], ...] = (),
    version: str = "1.1",
) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: gw"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def chat(content: str = "hi", *, stream: bool = False, max_tokens: int | None = None) -> bytes:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream"] = True
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


def events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e.strip()]


def tokens_in(resp: Resp) -> int:
    """How many tokens a (streamed or plain) chat answer carries."""
    if resp.header("content-type") == "text/event-stream":
        evs = events(resp.body)
        assert evs[-1] == b"data: [DONE]", evs[-1:]
        return sum(b'"content":"tok' in e for e in evs)
    return int(resp.json()["usage"]["completion_tokens"])


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """``serve(gateway, keep_alive_s=..., ...)``: a built-in server, stopped at teardown."""
    started: list[Served] = []

    def start(gateway: MeshMiddleware, **kw: Any) -> Served:
        s = Served(gateway, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


@pytest.fixture
def mesh_of(mesh_factory: Any) -> Callable[..., Mesh]:
    def make(*urls: str, **kw: Any) -> Mesh:
        kw.setdefault("bounds", BOUNDS)
        mesh: Mesh = mesh_factory(workers=list(urls), lifecycle={"probe": False}, **kw)
        return mesh

    return make


@pytest.fixture
def gateway(mock_factory: Any, mesh_of: Any, serve: Any) -> Callable[..., tuple[Served, Any, Mesh]]:
    """``gateway(**mock_config)``: a mock worker, its mesh and the gateway serving it."""

    def make(*, server: dict[str, Any] | None = None, **mock: Any) -> tuple[Served, Any, Mesh]:
        mock.setdefault("name", "w")
        worker = mock_factory(**mock)
        mesh = mesh_of(worker.url)
        return serve(build_gateway(mesh), **(server or {})), worker, mesh

    return make


def api_requests(worker: Any) -> int:
    return sum(n for p, n in worker.worker.stats.requests_total.items() if p.startswith("/v1/"))


# -- response heads ---------------------------------------------------------------------------

HEADS = {
    "length from the headers": (200, [(b"content-length", b"5")], {}, (Framing.LENGTH, True, 5)),
    "our own length wins": (200, [(b"content-length", b"9")], {"length": 2}, (0, True, 2)),
    "a repeated length is dropped": (
        200,
        [(b"content-length", b"5"), (b"content-length", b"7")],
        {},
        (Framing.LENGTH, True, 5),
    ),
    "a length that is not one": (200, [(b"content-length", b"+5")], {}, (1, True, -1)),
    # an app's (the bridge hands them over unparsed): not a ValueError from int()
    "a length of 5,000 digits": (200, [(b"content-length", b"9" * 5000)], {}, (1, True, -1)),
    "no length: chunked": (200, [], {}, (Framing.CHUNKED, True, -1)),
    "no length, HTTP/1.0: close": (200, [], {"http11": False}, (Framing.CLOSE, False, -1)),
    "HTTP/1.0 kept alive": (200, [(b"content-length", b"1")], {"http11": False}, (0, True, 1)),
    "204": (204, [], {}, (Framing.LENGTH, True, 0)),
    "304 with a length": (304, [(b"content-length", b"50")], {}, (Framing.LENGTH, True, 0)),
    "HEAD": (200, [], {"bodyless": True}, (Framing.LENGTH, True, 0)),
    "closing": (200, [(b"content-length", b"1")], {"keep_alive": False}, (0, False, 1)),
}


@pytest.mark.parametrize(("status", "headers", "kw", "want"), HEADS.values(), ids=HEADS.keys())
def test_response_heads(status: int, headers: Any, kw: Any, want: Any) -> None:
    args = {"keep_alive": True, "http11": True, **kw}
    head, framing, keep_alive, declared = response_head(status, headers, **args)
    assert (framing, keep_alive, declared) == want
    lines = head.split(b"\r\n")
    assert lines[-2:] == [b"", b""]
    names = [line.split(b":")[0] for line in lines[1:-2]]
    assert names.count(b"content-length") <= 1
    assert (b"transfer-encoding" in names) == (framing == Framing.CHUNKED)
    connection = [line for line in lines if line.startswith(b"connection:")]
    if not keep_alive:
        assert connection == [b"connection: close"]
    elif not args["http11"]:
        assert connection == [b"connection: keep-alive"]
    else:
        assert connection == []


def test_a_response_head_is_its_lines_in_order() -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2"), (b"x-a", b"b")]
    head, *_ = response_head(200, headers, keep_alive=False, http11=True)
    assert head == (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
        b"x-a: b\r\nconnection: close\r\n\r\n"
    )
    no_content = response_head(204, [], keep_alive=True, http11=True)[0]
    assert no_content == b"HTTP/1.1 204 No Content\r\n\r\n"


def test_response_heads_never_split() -> None:
    headers = [(b"x-a", b"1\r\nset-cookie: evil"), (b"x-b\n", b"2"), (b"x-c", b"ok")]
    head, *_ = response_head(200, headers, keep_alive=True, http11=True, length=0)
    assert b"evil" not in head and b"x-b" not in head and b"x-c: ok\r\n" in head


_fields = st.text(alphabet="ab\r\n", min_size=1, max_size=5).map(str.encode)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_fields, _fields), max_size=6))
def test_heads_keep_exactly_the_header_lines_without_a_line_break(
    headers: list[tuple[bytes, bytes]],
) -> None:
    clean = [(n, v) for n, v in headers if not any(c in n + v for c in b"\r\n")]
    head, *_ = response_head(200, headers, keep_alive=True, http11=True, length=0)
    lines = head.split(b"\r\n")
    assert lines[-2:] == [b"", b""] and not any(13 in x or 10 in x for x in lines)
    assert lines[1:-3] == [n + b": " + v for n, v in clean]
    line = b" / HTTP/1.1\r\nhost: w\r\n"
    if clean != headers:
        with pytest.raises(Unsendable):
            build_head("POST", line, headers, 0)
    else:
        sent = build_head("POST", line, headers, 0).split(b"\r\n")
        assert sent[2:-3] == [n + b": " + v for n, v in headers]


@pytest.mark.parametrize(
    "bad",
    [(b"x-a", b"1\r\nx-b: 2"), (b"x-a", b"1\n"), (b"x-a\r", b"1"), (b"x-a", b"\r")],
)
def test_request_heads_with_a_line_break_in_a_header_are_not_sent(
    bad: tuple[bytes, bytes],
) -> None:
    line = b" /v1/completions HTTP/1.1\r\nhost: w:8000\r\n"
    fine = [(b"content-type", b"application/json"), (b"x-c", b"ok")]
    head = build_head("POST", line, fine, 2)
    assert head.endswith(b"x-c: ok\r\ncontent-length: 2\r\n\r\n")
    for headers in ([bad], [bad, *fine], [*fine, bad]):
        with pytest.raises(Unsendable):
            build_head("POST", line, headers, 2)


# -- keep-alive and pipelining ----------------------------------------------------------------


def test_keep_alive_serves_many_requests_on_one_connection(gateway: Any) -> None:
    served, worker, mesh = gateway(output_tokens=3)
    raw = Raw(served.url)
    for i in range(20):
        raw.send(request("POST", PATH, chat(f"q{i}")))
        r = raw.response()
        assert r.status == 200, r.body
        assert r.framing == "length" and not r.closes
        assert r.header("x-mock-worker") == "w"
        assert tokens_in(r) == 3
    for i in range(5):
        raw.send(request("POST", PATH, chat(f"s{i}", stream=True)))
        r = raw.response()
        assert r.status == 200 and r.framing == "chunked" and not r.closes
        assert tokens_in(r) == 3
        raw.send(request("GET", "/health"))  # the bridge, on the same connection
        assert raw.response().json()["status"] == "ok"
    assert served.conns() == 1
    assert api_requests(worker) == 25
    raw.close()
    assert_settled(mesh)


def test_the_server_relays_without_asking_for_the_running_loop(
    gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server pins its upstream to its loop (``FastUpstream.pin``): a relayed
    request does not call ``asyncio.get_running_loop()``, a getpid system call per
    call on Python 3.11, on the server's thread."""
    served, _, mesh = gateway(output_tokens=3)
    server_thread = served.call(threading.get_ident)
    asked: list[int] = []
    real = asyncio.get_running_loop

    def counting() -> asyncio.AbstractEventLoop:
        asked.append(threading.get_ident())
        return real()

    monkeypatch.setattr(asyncio, "get_running_loop", counting)
    raw = Raw(served.url)
    for i in range(5):
        raw.send(request("POST", PATH, chat(f"q{i}", stream=i % 2 == 1)))
        r = raw.response()
        assert r.status == 200 and tokens_in(r) == 3
    raw.close()
    assert server_thread not in asked
    assert_settled(mesh)


def test_one_runner_answers_a_connection_in_turn_and_ends_with_it(gateway: Any) -> None:
    """A connection's requests, one after another or pipelined, run on one runner,
    stepped where their bytes arrive (no asyncio Task per request, none while it
    idles), which ends with the connection: nothing is left behind. The first
    request opens the worker's connection, an await that hands it to a Task: the
    requests after it start a new runner, stepped inline again."""
    served, _, mesh = gateway(output_tokens=3)

    def tasks() -> int:
        return int(served.call(lambda: len(asyncio.all_tasks())))

    before = tasks()
    raw = Raw(served.url)
    raw.send(request("POST", PATH, chat("q")))
    assert raw.response().status == 200
    conn = served.conn_of(raw)
    assert conn is not None
    assert wait_until(lambda: tasks() == before)  # the connect's Task has ended

    def runner() -> int:
        return int(served.call(lambda: id(conn._runner)))

    runners = set()
    for i in range(2):
        raw.send(request("POST", PATH, chat(f"q{i}")))
        assert raw.response().status == 200
        runners.add(runner())
        assert tasks() == before
    raw.send(b"".join(request("POST", PATH, chat(f"p{i}")) for i in range(3)))
    for _ in range(3):
        assert raw.response().status == 200
    runners.add(runner())
    assert len(runners) == 1
    assert tasks() == before
    assert served.call(lambda: conn._runner is not None and not conn._runner.done())
    raw.close()
    assert wait_until(lambda: served.conns() == 0)
    assert wait_until(lambda: served.call(lambda: conn._runner is None))
    assert tasks() == before
    assert_settled(mesh)


def test_pipelined_requests_are_answered_in_order(gateway: Any) -> None:
    served, _, mesh = gateway(output_tokens=8)
    mixed = [
        (request("POST", PATH, chat(max_tokens=1)), "chat", 1),
        (request("GET", "/health"), "health", None),
        (request("POST", PATH, chat(stream=True, max_tokens=2)), "chat", 2),
        (request("POST", PATH, b"{not json"), "refused", None),  # a 400 keeps the connection
        (request("POST", PATH, chat(max_tokens=3)), "chat", 3),
        (request("GET", "/v1/models"), "models", None),
        (request("POST", PATH, chat(stream=True, max_tokens=4)), "chat", 4),
    ]
    raw = Raw(served.url)
    raw.send(b"".join(data for data, _, _ in mixed))
    for _, kind, n in mixed:
        r = raw.response()
        assert not r.closes
        if kind == "chat":
            assert r.status == 200 and tokens_in(r) == n
        elif kind == "health":
            assert r.json()["status"] == "ok"
        elif kind == "refused":
            assert r.status == 400 and is_openai_error(r.json())
        else:
            assert r.json()["object"] == "list"
    # As many as the server takes from one read (one runs, 16 queue).
    many = [request("POST", PATH, chat(max_tokens=1 + i % 8)) for i in range(17)]
    raw.send(b"".join(many))
    assert [tokens_in(raw.response()) for _ in many] == [1 + i % 8 for i in range(17)]
    raw.send(request("GET", "/health"))
    assert raw.response().status == 200
    assert served.conns() == 1
    raw.close()
    assert_settled(mesh)


def test_pipelined_requests_pause_reading_at_the_bound(gateway: Any) -> None:
    """server.max_pipelined queued: reading pauses; what arrives meanwhile is read
    once the queue has room, and every request is answered in order."""
    served, _, mesh = gateway(output_tokens=3, per_token_ms=100.0, server={"max_pipelined": 3})
    sizes = [3, 1, 2, 1]  # the first runs for 0.3 s while the others queue behind it
    raw = Raw(served.url)
    raw.send(b"".join(request("POST", PATH, chat(f"p{n}", max_tokens=n)) for n in sizes))
    assert wait_until(lambda: served.conn_of(raw) is not None)
    conn = served.conn_of(raw)
    assert conn is not None
    assert served.call(lambda: (len(conn.queue), conn.read_paused)) == (3, True)
    raw.send(request("POST", PATH, chat("late", max_tokens=2)))  # read after the pause
    assert [tokens_in(raw.response()) for _ in range(5)] == [*sizes, 2]
    assert served.conns() == 1
    raw.close()
    assert_settled(mesh)


def test_pipelined_past_the_bound_in_one_read_is_refused(gateway: Any) -> None:
    """What one read holds is parsed whole: a request completed after the queue
    filled is answered 503 in turn, and the connection closes after it, so no
    more than server.max_pipelined + 2 requests are held, however many arrive."""
    served, worker, mesh = gateway(output_tokens=4, per_token_ms=100.0, server={"max_pipelined": 3})
    raw = Raw(served.url)
    raw.send(request("POST", PATH, chat("slow")))  # runs while the others arrive
    assert wait_until(lambda: api_requests(worker) == 1)
    conn = served.conn_of(raw)
    assert conn is not None
    raw.send(b"".join(request("POST", PATH, chat(f"p{i}", max_tokens=1)) for i in range(8)))
    # Three queue, the fourth is refused (queued to be answered in turn), the rest
    # are never parsed.
    assert wait_until(lambda: served.call(lambda: len(conn.queue)) == 4)
    assert served.call(lambda: conn.read_paused)
    assert [raw.response().status for _ in range(4)] == [200] * 4
    refused = raw.response()
    assert refused.status == 503 and refused.closes
    error = refused.json()
    assert is_openai_error(error) and error["error"]["code"] == "unavailable"
    assert "more than server.max_pipelined (3) requests" in error["error"]["message"]
    assert raw.closed()
    assert api_requests(worker) == 4
    assert metric_value(mesh, "mesh_router_rejections_total", code="unavailable") == 1
    assert_settled(mesh)


def test_pipelined_bodies_are_bounded_in_bytes(gateway: Any) -> None:
    """Reading pauses once the queued bodies pass bounds.max_body_bytes, well before
    server.max_pipelined requests of max_body_bytes each are held for one connection."""
    served, _, mesh = gateway(output_tokens=6, per_token_ms=150.0)
    big = [request("POST", PATH, chat("x" * (MAX_BODY * 2 // 5))) for _ in range(5)]
    raw = Raw(served.url)
    raw.send(big[0])  # it runs for about a second; the others queue behind it
    assert wait_until(lambda: served.conn_of(raw) is not None)
    conn = served.conn_of(raw)
    assert conn is not None

    def state() -> tuple[int, bool]:
        return cast("tuple[int, bool]", served.call(lambda: (len(conn.queue), conn.read_paused)))

    # One at a time, each read before the next is sent: what one read of the socket
    # holds is parsed whole, so sending them together would test the read's size.
    for queued, one in enumerate(big[1:], 1):
        raw.send(one)
        assert wait_until(cast(Callable[[], bool], lambda q=queued: state()[0] == q or state()[1]))
        if state()[1]:
            break
    # Three queued bodies are 1.2 x max_body_bytes: reading paused there, at 3 of 16.
    assert state() == (3, True)
    raw.send(big[4])  # not read while paused
    assert [raw.response().status for _ in big] == [200] * 5
    raw.close()
    assert_settled(mesh)


def test_pipelined_bodies_past_the_byte_bound_in_one_write_are_refused(gateway: Any) -> None:
    """Bodies written at once past bounds.max_body_bytes: the one parsed after the
    pause (in the read that caused it) is refused and the connection closes."""
    served, worker, mesh = gateway(output_tokens=4, per_token_ms=100.0)
    raw = Raw(served.url)
    raw.send(request("POST", PATH, chat("slow")))
    assert wait_until(lambda: api_requests(worker) == 1)
    big = [request("POST", PATH, chat("x" * (MAX_BODY * 2 // 5), max_tokens=1)) for _ in range(4)]
    raw.send(b"".join(big))
    assert [raw.response().status for _ in range(4)] == [200] * 4  # 3 queued: 1.2 x the bound
    refused = raw.response()
    assert refused.status == 503 and refused.closes
    message = refused.json()["error"]["message"]
    assert f"request bodies over bounds.max_body_bytes ({MAX_BODY})" in message
    assert raw.closed()
    assert api_requests(worker) == 4
    assert_settled(mesh)


# -- Connection: close and HTTP/1.0 -----------------------------------------------------------


def test_connection_close_is_honoured(gateway: Any) -> None:
    served, _, _ = gateway()
    for data in (
        request("POST", PATH, chat(), headers=(("Connection", "close"),)),
        request("POST", PATH, chat(stream=True), headers=(("Connection", "close"),)),
        request("GET", "/health", headers=(("Connection", "close"),)),
    ):
        raw = Raw(served.url)
        raw.send(data + request("GET", "/health"))  # a request after close: never answered
        r = raw.response()
        assert r.status == 200 and r.closes
        assert raw.closed()


def test_http10_closes_unless_asked_to_keep_alive(gateway: Any) -> None:
    served, _, _ = gateway(output_tokens=2)
    raw = Raw(served.url)
    raw.send(request("POST", PATH, chat(), version="1.0"))
    r = raw.response()
    assert r.status == 200 and r.framing == "length" and r.closes
    assert raw.closed()

    # Keep-alive asked for: said so in the answer (HTTP/1.0 clients need it), and kept.
    raw = Raw(served.url)
    ka = (("Connection", "keep-alive"),)
    for _ in range(3):
        raw.send(request("POST", PATH, chat(), headers=ka, version="1.0"))
        r = raw.response()
        assert r.status == 200 and r.framing == "length"
        assert (r.header("connection") or "").lower() == "keep-alive"
    raw.send(request("GET", "/health", headers=ka, version="1.0"))
    assert (raw.response().header("connection") or "").lower() == "keep-alive"
    assert served.conns() == 1
    raw.close()


def test_a_stream_to_an_http10_client_is_close_delimited(gateway: Any) -> None:
    """Whichever field asked an HTTP/1.0 connection to stay open (the server reads
    the version only when a head has one), a stream is never chunked to it."""
    served, _, _ = gateway(output_tokens=5)
    asks = ((), (("Connection", "keep-alive"),), (("Proxy-Connection", "keep-alive"),))
    for headers in asks:
        raw = Raw(served.url)
        raw.send(request("POST", PATH, chat(stream=True), headers=headers, version="1.0"))
        r = raw.response()
        assert r.status == 200
        assert (
            r.framing == "close" and r.closes
        )  # no length, no chunks: it ends with the connection
        assert tokens_in(r) == 5


# -- request bodies ---------------------------------------------------------------------------


def test_a_chunked_request_body_is_read_whole(gateway: Any) -> None:
    served, worker, mesh = gateway(output_tokens=2)
    body = chat("x" * 5000)
    pieces = [body[i : i + 777] for i in range(0, len(body), 777)]
    chunked = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    head = b"POST %s HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n" % PATH.encode()
    raw = Raw(served.url)
    raw.send(head)
    for i in range(0, len(chunked), 1000):  # arriving in pieces unrelated to the chunks
        raw.send(chunked[i : i + 1000])
    raw.send(request("GET", "/health"))  # pipelined right behind the last chunk
    r = raw.response()
    assert r.status == 200 and tokens_in(r) == 2
    assert raw.response().status == 200
    assert json.loads(worker.worker.stats.last_body)["messages"] == json.loads(body)["messages"]
    assert_settled(mesh)


@pytest.mark.parametrize("endless", ["value", "name"])
def test_an_endless_trailer_field_is_refused_at_the_head_bound(gateway: Any, endless: str) -> None:
    """The trailer section is held by the parser until its line ends: counted
    against the head bound (with the chunk framing), it is a 431, not a buffer that
    grows with every byte the client sends."""
    served, worker, mesh = gateway()
    raw = Raw(served.url)
    start = b"X-A: " if endless == "value" else b"X"
    raw.send(
        b"POST %s HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n%s"
        % (PATH.encode(), start)
    )
    sent = 0
    with contextlib.suppress(OSError):  # the server closes once it refused
        while sent < 64 * 1024 * 1024:
            raw.send(b"a" * 65536)
            sent += 65536
    r = raw.response()
    assert r.status == 431, r.status
    assert sent < 8 * 1024 * 1024  # refused long before: the bound is a few hundred KiB
    assert worker.worker.stats.requests_total.get(PATH) is None
    assert_settled(mesh)


def test_trailer_fields_are_never_merged_into_the_head(gateway: Any) -> None:
    """A proxy in front checks the head; a trailer could carry what it removed."""
    served, worker, _ = gateway()
    body = chat()
    raw = Raw(served.url)
    raw.send(
        b"POST %s HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n"
        b"0\r\nAuthorization: Bearer from-a-trailer\r\nX-Trailer: t\r\n\r\n"
        % (PATH.encode(), len(body), body)
    )
    assert raw.response().status == 200
    names = [k for k, _ in worker.worker.stats.last_headers]
    assert "authorization" not in names and "x-trailer" not in names


@pytest.mark.parametrize("coding", ["gzip, chunked", "identity, chunked"])
def test_a_transfer_coding_other_than_chunked_is_refused(gateway: Any, coding: str) -> None:
    """httptools frames it as chunked but decodes nothing else: 400, never relayed."""
    served, worker, _ = gateway()
    raw = Raw(served.url)
    raw.send(
        b"POST %s HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: %s\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
        % (PATH.encode(), coding.encode())
    )
    r = raw.response()
    assert r.status == 400 and is_openai_error(r.json()) and r.closes
    assert raw.closed()
    assert api_requests(worker) == 0


def test_expect_100_continue(gateway: Any) -> None:
    served, worker, _ = gateway(output_tokens=1)
    body = chat()
    raw = Raw(served.url)
    raw.send(request("POST", PATH, body, headers=(("Expect", "100-continue"),))[: -len(body)])
    interim = raw.response()
    assert interim.status == 100 and interim.headers == []
    raw.send(body)
    assert raw.response().status == 200
    # Over the body bound: refused at once, no 100; the body is never sent.
    raw = Raw(served.url)
    raw.send(
        b"POST %s HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
        % (PATH.encode(), MAX_BODY + 1)
    )
    r = raw.response()
    assert r.status == 413 and r.closes
    assert raw.closed()
    assert api_requests(worker) == 1


def test_a_head_request_refused_at_its_head_gets_no_body(gateway: Any) -> None:
    """HEAD of an inference path is a 405 refused while the head is read: its answer
    is a head alone (RFC 9110 §9.3.2), and the next request on the connection is
    read as a request, not after a stray body."""
    served, _, _ = gateway()
    raw = Raw(served.url)
    raw.send(request("HEAD", "/v1/models") + request("HEAD", PATH))
    first = raw.response("HEAD")
    assert first.status == 405 and first.closes
    assert raw.closed()  # a refusal closes the connection: nothing after the head
    raw = Raw(served.url)
    raw.send(request("HEAD", PATH))
    r = raw.response("HEAD")
    assert r.status == 405
    assert raw.closed()


def test_a_pipelined_expect_100_continue_gets_its_100_when_its_turn_comes(gateway: Any) -> None:
    """A request asking for a 100 behind one still running: its 100 follows the
    answer before it (a 100 first would be read as that request's answer), and its
    client, which waits for it, then sends the body. It used to idle out."""
    served, worker, _ = gateway(output_tokens=3, per_token_ms=50.0)
    body = chat()
    raw = Raw(served.url)
    raw.send(request("POST", PATH, body))
    raw.send(request("POST", PATH, body, headers=(("Expect", "100-continue"),))[: -len(body)])
    assert raw.response().status == 200
    interim = raw.response()
    assert interim.status == 100 and interim.headers == []
    raw.send(body)
    assert raw.response().status == 200
    assert api_requests(worker) == 2
    # A client that sends its body without waiting gets no 100 after the fact.
    raw.send(request("POST", PATH, body))
    raw.send(request("POST", PATH, body, headers=(("Expect", "100-continue"),)))
    assert [raw.response().status for _ in range(2)] == [200, 200]
    raw.send(request("GET", "/health", b""))
    assert raw.response().status == 200


# -- refusals ---------------------------------------------------------------------------------

_H = b"Host: gw\r\n"
MALFORMED = {
    "request line": b"GARBAGE\r\n\r\n",
    "version": b"GET /health HTTP/1.7\r\n" + _H + b"\r\n",
    "target with a space": b"GET /he alth HTTP/1.1\r\n" + _H + b"\r\n",
    "control byte in target": b"GET /he\x7flth HTTP/1.1\r\n" + _H + b"\r\n",
    "bare LF": b"GET /health HTTP/1.1\n" + _H + b"\n",
    "header without colon": b"GET /health HTTP/1.1\r\nHost gw\r\n\r\n",
    "space before colon": b"GET /health HTTP/1.1\r\nHost : gw\r\n\r\n",
    "obs-fold": b"GET /health HTTP/1.1\r\n" + _H + b"X-A: a\r\n b\r\n\r\n",
    "NUL in a value": b"GET /health HTTP/1.1\r\n" + _H + b"X-A: a\x00b\r\n\r\n",
    "CR in a value": b"GET /health HTTP/1.1\r\n" + _H + b"X-A: a\rb\r\n\r\n",
    # request smuggling: two framings, or two lengths
    "CL then TE": b"POST /v1/chat/completions HTTP/1.1\r\n" + _H + b"Content-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /health HTTP/1.1\r\n" + _H + b"\r\n",
    "TE then CL": b"POST /v1/chat/completions HTTP/1.1\r\n" + _H + b"Transfer-Encoding: chunked"
    b"\r\nContent-Length: 5\r\n\r\n0\r\n\r\nGET /health HTTP/1.1\r\n" + _H + b"\r\n",
    "two lengths": b"POST /v1/chat/completions HTTP/1.1\r\n" + _H + b"Content-Length: 2\r\n"
    b"Content-Length: 40\r\n\r\n{}GET /health HTTP/1.1\r\n" + _H + b"\r\n",
    "TE not chunked last": b"POST /v1/chat/completions HTTP/1.1\r\n" + _H + b"Transfer-Encoding:"
    b" chunked, identity\r\n\r\n0\r\n\r\n",
    "bad chunk size": b"POST /v1/chat/completions HTTP/1.1\r\n" + _H + b"Transfer-Encoding: "
    b"chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "negative length": b"POST /v1/chat/completions HTTP/1.1\r\n" + _H + b"Content-Length: -1"
    b"\r\n\r\n",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_request_is_a_400_and_the_connection_closes(gateway: Any, data: bytes) -> None:
    served, worker, mesh = gateway()
    raw = Raw(served.url)
    raw.send(data)
    r = raw.response()
    assert r.status == 400, r.body
    assert is_openai_error(r.json()) and r.json()["error"]["code"] == "invalid_request"
    assert r.closes and r.framing == "length"
    assert raw.closed()  # and nothing after it (a smuggled request is never answered)
    assert api_requests(worker) == 0
    assert metric_value(mesh, "mesh_router_rejections_total", code="invalid_request") == 1
    # the server goes on serving
    ok = Raw(served.url)
    ok.send(request("POST", PATH, chat()))
    assert ok.response().status == 200


def test_a_malformed_request_on_an_anthropic_path_gets_the_anthropic_shape(gateway: Any) -> None:
    served, _, _ = gateway()
    raw = Raw(served.url)
    raw.send(b"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nX-A: a\x01b\r\n\r\n")
    r = raw.response()
    assert r.status == 400 and is_anthropic_error(r.json())
    assert raw.closed()


UPGRADE = (
    b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade, HTTP2-Settings\r\n"
    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
)


def test_an_upgrade_is_ignored_the_request_answered_once_then_the_connection_closes(
    gateway: Any,
) -> None:
    """``curl --http2`` on http:// asks for h2c: the answer is plain HTTP/1.1 (a
    server may ignore Upgrade), once, and what follows the request is not read."""
    served, worker, _ = gateway()
    raw = Raw(served.url)
    raw.send(request("GET", "/health") + UPGRADE + b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    first = raw.response()
    assert first.status == 200 and not first.closes
    r = raw.response()
    assert r.status == 200 and r.json()["status"] == "ok" and r.closes
    assert raw.closed()
    # a routed request asking for an upgrade: forwarded once, without the upgrade
    up = (("Connection", "Upgrade"), ("Upgrade", "websocket"))
    raw = Raw(served.url)
    raw.send(request("GET", "/v1/models", headers=up) + request("GET", "/health"))
    r = raw.response()
    assert r.status == 200 and r.json()["object"] == "list" and r.closes
    assert raw.closed()
    assert api_requests(worker) == 1
    assert "upgrade" not in dict(worker.worker.stats.last_headers)
    # with a body, which httptools takes for the new protocol's bytes: refused
    raw = Raw(served.url)
    raw.send(request("POST", PATH, chat(), headers=up))
    r = raw.response()
    assert r.status == 400 and is_openai_error(r.json()) and r.closes
    assert raw.closed()
    assert api_requests(worker) == 1


def _stream_until_answered(raw: Raw, piece: bytes, budget: int) -> int:
    """Send ``piece`` after ``piece`` until an answer is readable; the bytes sent."""
    sent = 0
    while sent < budget and not raw.readable():
        try:
            raw.send(piece)
        except OSError:  # the server closed first (a reset): the answer is in the buffer
            break
        sent += len(piece)
    return sent


def test_a_declared_length_over_the_bound_is_a_413_before_the_body(gateway: Any) -> None:
    served, worker, mesh = gateway()
    raw = Raw(served.url)
    raw.send(
        b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n"
        % (PATH.encode(), 100 * MAX_BODY)
    )
    r = raw.response()  # no body byte sent
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large" and r.closes
    assert raw.closed()
    assert api_requests(worker) == 0
    assert metric_value(mesh, "mesh_router_rejections_total", code="request_too_large") == 1


def test_a_chunked_body_over_the_bound_is_a_413_while_it_streams(gateway: Any) -> None:
    served, worker, _ = gateway()
    raw = Raw(served.url)
    raw.send(b"POST %s HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n" % PATH.encode())
    piece = b"1000\r\n" + b" " * 0x1000 + b"\r\n"
    budget = 1000 * MAX_BODY  # endless, for the purpose
    sent = _stream_until_answered(raw, piece, budget)
    assert sent < budget  # answered while the body was still coming
    r = raw.response()
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large" and r.closes
    assert raw.closed()  # without reading the rest
    assert api_requests(worker) == 0


ENDLESS_HEADS = {
    "one endless value": (b"X-Pad: ", b"a" * 65536),
    "endless header lines": (b"", b"X-Pad: " + b"a" * 100 + b"\r\n"),
    "endless request target": (None, b"a" * 65536),
}


@pytest.mark.parametrize(("start", "piece"), ENDLESS_HEADS.values(), ids=ENDLESS_HEADS.keys())
def test_a_head_that_never_ends_is_a_431(gateway: Any, start: bytes | None, piece: bytes) -> None:
    served, worker, _ = gateway()
    raw = Raw(served.url)
    if start is None:
        raw.send(b"POST /v1/chat/completions?q=")
    else:
        raw.send(b"POST %s HTTP/1.1\r\nHost: gw\r\n%s" % (PATH.encode(), start))
    budget = 1000 * (2 * MAX_HEAD + 65536)
    sent = _stream_until_answered(raw, piece, budget)
    assert sent < budget  # answered while the head was still coming
    r = raw.response()
    assert r.status == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
    assert raw.closed()
    assert api_requests(worker) == 0


# -- connection limits and idle connections ---------------------------------------------------


def test_max_connections_at_the_bound(gateway: Any) -> None:
    served, _, mesh = gateway(server={"max_connections": 3})
    open_ = []
    for _ in range(3):  # max-1, then max: served
        raw = Raw(served.url)
        raw.send(request("GET", "/health"))
        assert raw.response().status == 200
        open_.append(raw)
    extra = Raw(served.url)  # max+1: answered at once, before it sends anything
    r = extra.response()
    assert r.status == 503 and r.closes
    assert is_openai_error(r.json()) and r.json()["error"]["code"] == "unavailable"
    assert r.header("retry-after") is not None
    assert extra.closed()
    assert metric_value(mesh, "mesh_router_rejections_total", code="unavailable") == 1
    # the ones in the limit still work
    open_[2].send(request("POST", PATH, chat()))
    assert open_[2].response().status == 200
    # one leaves: a new connection is served
    open_[0].close()
    assert wait_until(lambda: served.conns() == 2)
    again = Raw(served.url)
    again.send(request("POST", PATH, chat()))
    assert again.response().status == 200
    assert served.conns() == 3


def test_idle_and_half_sent_connections_close_after_keep_alive_s(gateway: Any) -> None:
    served, _, _ = gateway(server={"keep_alive_s": 1.0})
    idle = Raw(served.url)
    idle.send(request("GET", "/health"))
    assert idle.response().status == 200
    half = Raw(served.url)
    half.send(b"GET /health HTTP/1.1\r\nHo")
    half_body = Raw(served.url)
    half_body.send(request("POST", PATH, chat())[:-5])
    # polled: each returns once the server closed (the socket timeout is far longer)
    assert idle.closed()
    assert half.closed()  # without an answer
    assert half_body.closed()
    assert wait_until(lambda: served.conns() == 0)


def test_keep_alive_s_never_cuts_a_running_stream(gateway: Any) -> None:
    # a stream that runs several sweeps longer than keep_alive_s, the client silent
    served, _, _ = gateway(server={"keep_alive_s": 1.0}, per_token_ms=25.0, output_tokens=100)
    raw = Raw(served.url)
    raw.send(request("POST", PATH, chat(stream=True)))
    r = raw.response()
    assert r.status == 200 and tokens_in(r) == 100
    raw.send(request("GET", "/health"))
    assert raw.response().status == 200


# -- clients that leave or read slowly --------------------------------------------------------


def test_a_client_leaving_mid_stream_cancels_upstream_and_settles(gateway: Any) -> None:
    served, worker, mesh = gateway(per_token_ms=10.0, output_tokens=2000)
    raw = Raw(served.url)
    raw.send(request("POST", PATH, chat(stream=True)))
    assert raw.head().status == 200
    assert wait_until(lambda: worker.worker.stats.active_streams == 1)
    raw.leave()
    stats = worker.worker.stats
    assert wait_until(lambda: stats.disconnects == 1 and stats.active_streams == 0)
    assert_settled(mesh)
    assert wait_until(lambda: served.conns() == 0)
    assert metric_value(mesh, "mesh_router_client_disconnects_total") == 1


def test_a_slow_reader_gets_back_pressure_not_a_growing_buffer(gateway: Any) -> None:
    """A fast worker, a client that reads nothing: the server stops writing once
    the transport's buffer passes its high-water mark (and so stops reading the
    worker, whose relay pauses past its own bound), so what it holds for the
    connection stays bounded; then the client reads it all."""
    tokens = 60_000  # ~14 MB of events: far more than every socket buffer on the way
    served, _, mesh = gateway(output_tokens=tokens)
    raw = Raw(served.url, rcvbuf=16_384, timeout=60)
    raw.send(request("POST", PATH, chat(stream=True)))
    conn = None

    def paused() -> bool:
        nonlocal conn
        conn = served.conn_of(raw)
        return conn is not None and bool(served.call(lambda: conn.write_paused))

    assert wait_until(paused, 30)
    assert conn is not None
    transport = conn.transport
    assert transport is not None
    high = served.call(lambda: transport.get_write_buffer_limits()[1])
    # The largest piece the relay hands over at once: what it buffers before it
    # pauses reading the worker, plus one read of the socket.
    piece = UpstreamConfig().read_buffer_bytes + 256 * 1024
    sizes = []
    for _ in range(50):  # sampled while the client still reads nothing
        sizes.append(served.call(transport.get_write_buffer_size))
        assert served.call(lambda: conn.task is not None)  # the stream is held, not done
        threading.Event().wait(0.01)
    assert max(sizes) <= high + piece, (max(sizes), high)
    r = raw.response()
    assert r.status == 200 and tokens_in(r) == tokens
    assert_settled(mesh)


# -- HEAD, the bridge, errors in the app ------------------------------------------------------


async def _app(scope: Any, receive: Any, send: Any) -> None:
    """A host app with routes that misbehave on purpose."""
    path = scope["path"]
    if path == "/boom":
        raise RuntimeError("boom: a secret in an exception text")
    if path == "/stream":  # no length: chunked (HTTP/1.1)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (b"one ", b"two ", b"three"):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/boom-after-start":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("after the start")
    if path == "/boom-mid-body":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise RuntimeError("mid body")
    if path == "/short":  # a body shorter than its own content-length
        head = [(b"content-length", b"10")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"12345"})
        return
    if path == "/no-response":
        return
    if path == "/longer":  # more than its own content-length: a response smuggled after
        head = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        extra = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nINJECTED"
        await send({"type": "http.response.body", "body": extra, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b"ok " + path.encode()
    head = [(b"content-length", str(len(body)).encode()), (b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def app_server(mock_factory: Any, mesh_of: Any, serve: Any) -> tuple[Served, Mesh]:
    worker = mock_factory(name="w")
    mesh = mesh_of(worker.url)
    return serve(MeshMiddleware(_app, mesh=mesh), keep_alive_s=60.0), mesh


def test_a_body_longer_than_its_length_is_cut_and_the_connection_closed(
    app_server: Any,
) -> None:
    """A host app that writes past its own content-length: the bytes after it would
    be read by a pipelining client as the next answer. They are cut, and the
    connection closes after the declared body."""
    app, _ = app_server
    raw = Raw(app.url)
    raw.send(request("GET", "/longer") + request("GET", "/second"))
    r = raw.response()
    assert (r.status, r.body) == (200, b"hello")
    assert raw.closed()  # the pipelined request is never answered by the injected bytes


def test_a_client_that_never_reads_stops_its_pipelined_requests(gateway: Any) -> None:
    """Requests pipelined one after another on a connection whose client reads
    nothing: each answer waits until the client drained the previous ones, so the
    write buffer stays at its bound plus one answer and the worker is not asked for
    more (before, every request was answered into an ever larger buffer)."""
    served, worker, mesh = gateway(output_tokens=20_000)  # answers of ~170 KB
    raw = Raw(served.url, rcvbuf=4096, timeout=60)
    one = request("POST", PATH, chat(max_tokens=20_000))
    raw.sock.settimeout(0.5)
    sent = 0
    with contextlib.suppress(OSError):  # the server stopped reading: sends block
        for _ in range(60):
            raw.send(one)
            sent += 1
            threading.Event().wait(0.01)
    conn = served.conn_of(raw)
    assert conn is not None
    transport = conn.transport
    assert transport is not None
    assert wait_until(lambda: bool(served.call(lambda: conn.write_paused)), 30)
    high = served.call(lambda: transport.get_write_buffer_limits()[1])
    asked = api_requests(worker)
    for _ in range(20):  # sampled while the client still reads nothing
        size = served.call(transport.get_write_buffer_size)
        assert size <= high + 256 * 1024, (size, high)  # the bound and one answer
        threading.Event().wait(0.02)
    assert api_requests(worker) == asked < sent  # nothing more was asked meanwhile
    raw.sock.settimeout(60)
    statuses: list[int] = []
    with contextlib.suppress(EOFError):  # reading now: every answer arrives, in order
        while len(statuses) < sent:
            statuses.append(raw.response().status)
    # ... up to the pipelining bound's refusal, when the queue filled meanwhile
    ok = statuses.count(200)
    assert statuses[:ok] == [200] * ok and statuses[ok:] in ([], [503])
    assert ok == api_requests(worker) > asked
    assert_settled(mesh)


def test_head_answers_carry_no_body(gateway: Any, app_server: Any) -> None:
    served, _, _ = gateway()
    raw = Raw(served.url)
    raw.send(request("HEAD", "/health") + request("GET", "/health"))
    head = raw.response("HEAD")
    assert head.status == 200 and int(head.header("content-length") or 0) > 0
    get = raw.response()  # parsed right after the head: no body bytes in between
    assert get.json()["status"] == "ok"
    # a streamed (chunked) answer of the host app, asked with HEAD: not even a last chunk
    app, _ = app_server
    raw = Raw(app.url)
    raw.send(request("HEAD", "/stream") + request("GET", "/stream"))
    assert raw.response("HEAD").status == 200
    get = raw.response()
    assert get.status == 200 and get.body == b"one two three"


def test_metrics_and_workers_go_through_the_bridge(gateway: Any) -> None:
    served, worker, _ = gateway()
    with httpx2.Client(base_url=served.url, trust_env=False, timeout=15) as client:
        assert client.post(PATH, json={"model": "m", "messages": []}).status_code in (200, 400)
        m = client.get("/metrics")
        assert m.status_code == 200
        assert m.headers["content-type"].startswith("text/plain")
        assert "mesh_router_" in m.text
        w = client.get("/workers")
        assert w.status_code == 200
        assert [x["url"] for x in w.json()["workers"]] == [worker.url]
        assert client.get("/readiness?probe=1").status_code == 200
        nf = client.get("/nope")
        assert nf.status_code == 404
        assert client.post("/health", content=b"x").status_code == 405


def test_an_exception_in_the_app_is_a_500_and_the_server_goes_on(app_server: Any) -> None:
    served, _ = app_server
    with records_of("meshkit.server") as logged:
        for path in ("/boom", "/boom-after-start", "/no-response"):
            raw = Raw(served.url)
            raw.send(request("GET", path))
            r = raw.response()
            assert r.status == 500, path
            assert r.json()["error"]["code"] == "internal_error"
            assert b"secret" not in r.body
            assert r.closes
            assert raw.closed()
        # after the first body bytes only closing can tell: a chunked body without its end
        raw = Raw(served.url)
        raw.send(request("GET", "/boom-mid-body"))
        with pytest.raises(EOFError):
            raw.response()
        ok = Raw(served.url)
        ok.send(request("GET", "/fine"))
        assert ok.response().body == b"ok /fine"
    # one ERROR with its traceback per exception, for the operator
    crashes = [r for r in logged if r.levelno == logging.ERROR]
    assert len(crashes) == 3 and all(r.exc_info for r in crashes)


def test_a_body_shorter_than_its_length_closes_the_connection(
    app_server: Any, mesh_of: Any, serve: Any
) -> None:
    served, _ = app_server
    raw = Raw(served.url)
    raw.send(request("GET", "/short") + request("GET", "/fine"))
    with pytest.raises(EOFError):  # closed at once, not after keep_alive_s (60 s)
        raw.response()
    # the same for a worker that dies half-way through a plain answer
    cut = TruncatingWorker()
    try:
        mesh = mesh_of(cut.url)
        gw = serve(build_gateway(mesh), keep_alive_s=60.0)
        raw = Raw(gw.url)
        raw.send(request("POST", PATH, chat()) + request("GET", "/health"))
        with pytest.raises(EOFError):
            raw.response()
        assert_settled(mesh)
    finally:
        cut.close()


# -- graceful shutdown ------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def records_of(name: str, level: int = logging.DEBUG) -> Iterator[list[logging.LogRecord]]:
    handler = _Records()
    logger = logging.getLogger(name)
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _stop_in_background(gw: GatewayThread) -> threading.Thread:
    t = threading.Thread(target=gw.stop, daemon=True)
    t.start()
    return t


def test_shutdown_lets_a_stream_in_flight_finish(mock_factory: Any, mesh_of: Any) -> None:
    worker = mock_factory(name="w", per_token_ms=20.0, output_tokens=50)
    mesh = mesh_of(worker.url)
    gw = GatewayThread(mesh, grace_s=30.0)
    raw = Raw(gw.start())
    idle = Raw(gw.url)  # an idle keep-alive connection: closed at once
    idle.send(request("GET", "/health"))
    assert idle.response().status == 200
    raw.send(request("POST", PATH, chat(stream=True)))
    head = raw.head()
    assert head.status == 200
    assert wait_until(lambda: worker.worker.stats.active_streams == 1)
    with records_of("meshkit.server") as logged:
        stopping = _stop_in_background(gw)
        assert idle.closed()
        r = raw.body(head)
        assert tokens_in(r) == 50  # finished within the grace period
        stopping.join(30)
        assert not stopping.is_alive()
    assert not [r for r in logged if r.levelno >= logging.WARNING]
    with pytest.raises(OSError):  # no longer accepting
        Raw(gw.url, timeout=2)
    assert_settled(mesh)


def test_shutdown_cuts_a_stream_at_the_grace_period(mock_factory: Any, mesh_of: Any) -> None:
    worker = mock_factory(name="w", per_token_ms=100.0, output_tokens=600)
    mesh = mesh_of(worker.url)
    gw = GatewayThread(mesh, grace_s=0.3)
    raw = Raw(gw.start())
    raw.send(request("POST", PATH, chat(stream=True)))
    head = raw.head()
    assert head.status == 200
    assert wait_until(lambda: worker.worker.stats.active_streams == 1)
    with records_of("meshkit.server") as logged:
        gw.stop()
    with pytest.raises(EOFError):  # cut: the chunked body never ends
        raw.body(head)
    messages = [r.getMessage() for r in logged]
    assert any("still running after 0.3 s" in m for m in messages), messages
    assert not [r for r in logged if r.exc_info or r.levelno >= logging.ERROR]
    assert wait_until(lambda: worker.worker.stats.disconnects == 1)
    assert_settled(mesh)


# -- the access log ---------------------------------------------------------------------------


def test_the_access_log_has_method_path_status_and_nothing_private(
    mock_factory: Any, mesh_of: Any, serve: Any
) -> None:
    worker = mock_factory(name="w")
    mesh = mesh_of(worker.url)
    served = serve(build_gateway(mesh), access_log=True)
    secret_headers = (("Authorization", "Bearer HEADER-SECRET"), ("X-Api-Key", "KEY-SECRET"))
    with records_of("meshkit.access", logging.INFO) as logged:
        raw = Raw(served.url)
        raw.send(
            request(
                "POST", PATH + "?token=QUERY-SECRET", chat("BODY-SECRET"), headers=secret_headers
            )
        )
        assert raw.response().status == 200
        raw.send(request("POST", PATH, chat("BODY-SECRET", stream=True), headers=secret_headers))
        assert raw.response().status == 200
        raw.send(request("GET", "/health", headers=secret_headers))
        assert raw.response().status == 200
        raw.send(request("GET", "/nope?x=QUERY-SECRET", headers=secret_headers, version="1.0"))
        assert raw.response().status == 404
        assert wait_until(lambda: len(logged) == 4)
    lines = [r.getMessage() for r in logged]
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in lines[0]
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in lines[1]
    assert '"GET /health HTTP/1.1" 200' in lines[2]
    assert '"GET /nope HTTP/1.0" 404' in lines[3]
    for line in lines:
        assert line.startswith("127.0.0.1:")
        for secret in ("SECRET", "Bearer", "tok0"):
            assert secret not in line, line
