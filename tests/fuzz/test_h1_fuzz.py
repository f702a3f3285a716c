"""Raw bytes at the built-in HTTP/1.1 server (``meshkit.server.h1.conn``).

One server with a mock worker behind it gets generated request bytes on a new
connection per example: valid-ish requests whose request line, headers (CR, LF,
NUL, obs-fold, odd names), framing (duplicated ``Content-Length``,
``Content-Length`` with ``Transfer-Encoding``, chunk sizes, chunk extensions,
truncated bodies) and pipelining are mutated, then a few bytes flipped. Once the
server is quiet (it closed the connection, or it received every byte and has
nothing running), the invariants:

* every answer is a well-formed HTTP/1.1 response (read by h11, strictly), one
  per request the server took in, in order, and nothing else;
* no 5xx of the server's own making (a worker's would carry ``x-mock-worker``;
  the mock makes none); no ERROR log record, no traceback;
* the server frames requests exactly as httptools does on the same bytes (a
  reference parse): same requests, same bodies; what it refused was the last
  thing it read, and the connection closed after the answer;
* the worker sees only requests the server routed, with the bodies it framed (a
  smuggled request never reaches it);
* a normal request on a new connection is served afterwards.

Examples: 300 per property (CI), 10,000 with ``MESHKIT_PROFILE=full``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h11
import httptools
import pytest
from fuzzkit import fuzz_settings, valid_bodies
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit import Mesh
from meshkit.mock import MockConfig, MockWorkerThread
from meshkit.server.h1 import server as h1_server
from meshkit.server.h1.conn import H1Conn, Request
from meshkit.server.h1.server import H1Server
from meshkit.server.runner import GatewayThread

BOUNDS = {"max_body_bytes": 65_536, "max_header_bytes": 8_192, "max_headers": 64}
FIGURES: dict[str, Counter[str]] = {}


# -- the server, instrumented -----------------------------------------------------------------


class CountingConn(H1Conn):
    """An H1Conn that keeps what the test checks: bytes in, requests taken in."""

    def __init__(self, server: H1Server) -> None:
        super().__init__(server)
        self.received = 0
        self.taken: list[Request] = []

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        Env.current.conns[self.client] = self

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        super().data_received(data)

    def _start(self, req: Request) -> None:
        self.taken.append(req)
        super()._start(req)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Forwarded:
    method: str
    path: str
    body: bytes
    headers: list[bytes]


class Env:
    current: Env

    def __init__(self) -> None:
        Env.current = self
        self.mock = MockWorkerThread(MockConfig(name="fz", output_tokens=3))
        self.mock.start()
        self.forwarded: list[Forwarded] = []
        app = self.mock.worker.app
        inner = app.handle

        def handle(req: Any) -> Any:
            names = [k.lower() for k, _ in req.headers]
            method, path = req.method.decode("latin-1"), req.path.decode("latin-1")
            self.forwarded.append(Forwarded(method, path, req.body, names))
            return inner(req)

        app.handle = handle  # type: ignore[method-assign]
        self.mesh = Mesh(
            workers=[self.mock.url], routing={"seed": 1}, lifecycle={"probe": False}, bounds=BOUNDS
        )
        self.conns: dict[str, CountingConn] = {}
        self.errors = _Errors()
        for name in ("meshkit", "asyncio"):
            logging.getLogger(name).addHandler(self.errors)
        # long keep-alive: only the examples' own bytes close connections
        self.server = GatewayThread(self.mesh, keep_alive_s=60.0)
        self.server.start()
        self.port = int(urlsplit(self.server.url).port or 0)

    def call(self, fn: Callable[[], Any]) -> Any:
        return self.server.call(fn)

    def close(self) -> None:
        self.server.stop()
        for name in ("meshkit", "asyncio"):
            logging.getLogger(name).removeHandler(self.errors)
        self.mesh.close()
        self.mock.stop()


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(h1_server, "H1Conn", CountingConn)
        e = Env()
        try:
            yield e
        finally:
            e.close()


# -- generated requests -----------------------------------------------------------------------

_TOKEN = "!#$%&'*+-.^_`|~" + "abcdefghijklmnopqrstuvwxyz0123456789"
_NASTY = [b"\r", b"\n", b"\x00", b"\r\n ", b"\r\n\t", b" ", b"\t", b"\x7f", b"\xff", b":", b","]
TARGETS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/models",
    "/v1/tokenize",
    "/generate",
    "/health",
    "/metrics",
    "/workers",
    "/readiness",
    "/nope",
    "*",
    "http://gw/v1/chat/completions",
    "/v1/chat/completions?x=1&y=%20",
    "//health",
    "/%2e%2e/health",
    "/v1/responses/resp_1",
    "gw:443",
]
ROUTED_POST = [
    "/v1/chat/completions",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/generate",
    "/v1/chat/completions?x=1&y=%20",
]
METHODS = ["POST", "POST", "POST", "GET", "GET", "HEAD", "PUT", "DELETE", "OPTIONS", "CONNECT"]
VERSIONS = ["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/0.9", "HTTP/2.0", "HTTP/1.2", "http/1.1", ""]

_bytes_piece = st.binary(max_size=12) | st.sampled_from(_NASTY)
_name = st.sampled_from(
    ["X-A", "Content-Type", "Connection", "Expect", "Upgrade", "Authorization", "Accept"]
) | st.text(alphabet=_TOKEN, min_size=1, max_size=12)
_value = st.sampled_from(
    ["v", "close", "keep-alive", "100-continue", "Upgrade", "h2c", "application/json", ""]
) | st.text(alphabet=_TOKEN + ' \t"', max_size=20)


@st.composite
def headers(draw: st.DrawFn, clean: bool) -> list[bytes]:
    out = []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(_name).encode("latin-1")
        value = draw(_value).encode("latin-1")
        if not clean and draw(st.integers(0, 2)) == 2:  # a nasty byte somewhere in the line
            where = draw(st.sampled_from(["name", "value", "fold"]))
            bad = draw(st.sampled_from(_NASTY))
            if where == "name":
                name += bad
            elif where == "value":
                value += bad + b"x"
            else:
                value += b"\r\n " + value  # obs-fold
        out.append(name + b": " + value)
    if draw(st.integers(0, 7)) == 7:  # asking for another protocol
        proto = draw(st.sampled_from([b"h2c", b"websocket"]))
        out += [b"Connection: Upgrade", b"Upgrade: " + proto]
    if not clean and draw(st.integers(0, 6)) == 6:  # past a head bound
        size = draw(st.sampled_from([8_300, 20_000]))
        out.append(b"X-Pad: " + b"p" * size)
    if not clean and draw(st.integers(0, 6)) == 6:
        out.extend(b"X-N%d: 1" % i for i in range(70))
    return out


def _chunks(body: bytes, draw: st.DrawFn, clean: bool = False) -> bytes:
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
    edges = [0, *cuts, len(body)]
    parts = [body[a:b] for a, b in itertools.pairwise(edges) if b > a]
    out = []
    for part in parts:
        size = b"%x" % len(part)
        style = draw(st.integers(0, 9)) if not clean else 9
        if style == 0:
            size = size.upper()
        elif style == 1:
            size = b"0" * draw(st.integers(1, 20)) + size  # leading zeros
        elif style == 2:
            size += b";ext=" + b"e" * draw(st.sampled_from([1, 100, 70_000]))
        elif style == 3:
            size = draw(st.sampled_from([b"-1", b"zz", b"", b"1 ", b" 1", b"fffffffffffffffff0"]))
        out.append(size + b"\r\n" + part + b"\r\n")
    if clean:
        return b"".join(out) + draw(st.sampled_from([b"0\r\n\r\n", b"0\r\nX-Trailer: t\r\n\r\n"]))
    tail = draw(
        st.sampled_from(
            [b"0\r\n\r\n"] * 4
            + [b"0\r\nX-Trailer: t\r\n\r\n", b"0\r\nX-Trailer: \x01\r\n\r\n"]
            + [b"0\r\n", b"", b"0\n\n"]
        )
    )
    return b"".join(out) + tail


FRAMINGS = [
    "length",
    "length",
    "length",
    "none",
    "chunked",
    "chunked",
    "short length",
    "long length",
    "two equal lengths",
    "two lengths",
    "length and chunked",
    "chunked and length",
    "odd transfer-encoding",
    "huge length",
]


@st.composite
def message(draw: st.DrawFn) -> bytes:
    """One request; two in three are clean (well-formed, mostly routable)."""
    clean = draw(st.integers(0, 2)) < 2  # (hypothesis leans to small numbers)
    if clean:
        method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "HEAD"]))
        if method == "POST":
            target = draw(st.sampled_from(ROUTED_POST))
        else:
            target = draw(st.sampled_from(["/health", "/metrics", "/v1/models", "/workers"]))
        version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]))
    else:
        method = draw(st.sampled_from(METHODS) | st.text(alphabet=_TOKEN, max_size=6))
        target = draw(st.sampled_from(TARGETS))
        version = draw(st.sampled_from(VERSIONS))
        if draw(st.integers(0, 4)) == 4:
            target += draw(st.sampled_from(_NASTY)).decode("latin-1") + "x"
    line = f"{method} {target} {version}".rstrip(" ").encode("latin-1")
    kinds = ["chat", "chat", "json", "bytes", "empty"] + ([] if clean else ["big"])
    kind = draw(st.sampled_from(kinds))
    if kind == "chat":
        body = json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": draw(st.text(max_size=20))}],
                "stream": draw(st.booleans()),
                "max_tokens": draw(st.integers(1, 4)),
            }
        ).encode()
    elif kind == "json":
        body = json.dumps(draw(valid_bodies)).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=64))
    elif kind == "big":  # past the body bound
        body = b'{"model":"m","messages":[],"pad":"' + b"x" * 66_000 + b'"}'
    else:
        body = b""
    hs = [b"Host: gw", *draw(headers(clean))]
    n = len(body)
    if clean:
        framing = draw(st.sampled_from(["length", "length", "chunked", "none"]))
        if framing == "none":
            body = b""
    else:
        framing = draw(st.sampled_from(FRAMINGS))
    if framing == "length":
        hs.append(b"Content-Length: %d" % n)
        payload = body
    elif framing == "none":
        payload = body if draw(st.booleans()) else b""
    elif framing == "chunked":
        hs.append(b"Transfer-Encoding: chunked")
        payload = _chunks(body, draw, clean)
    elif framing == "short length":  # the rest is read as the next request
        hs.append(b"Content-Length: %d" % max(0, n - draw(st.integers(1, 10))))
        payload = body
    elif framing == "long length":  # truncated: the server waits for the rest
        hs.append(b"Content-Length: %d" % (n + draw(st.integers(1, 10))))
        payload = body
    elif framing == "two equal lengths":
        hs += [b"Content-Length: %d" % n, b"Content-Length: %d" % n]
        payload = body
    elif framing == "two lengths":
        hs += [b"Content-Length: %d" % n, b"Content-Length: %d" % (n + 5)]
        payload = body
    elif framing == "length and chunked":
        hs += [b"Content-Length: %d" % n, b"Transfer-Encoding: chunked"]
        payload = _chunks(body, draw)
    elif framing == "chunked and length":
        hs += [b"Transfer-Encoding: chunked", b"Content-Length: %d" % n]
        payload = body
    elif framing == "odd transfer-encoding":
        te = draw(
            st.sampled_from(
                [
                    b"chunked, identity",
                    b"gzip, chunked",
                    b"identity",
                    b"Chunked",
                    b"chunked ",
                    b" chunked",
                    b"chunked\t",
                    b"x-chunked",
                    b"chunked, chunked",
                ]
            )
        )
        hs.append(b"Transfer-Encoding: " + te)
        if draw(st.booleans()):
            hs.append(b"Transfer-Encoding: chunked")
        payload = _chunks(body, draw)
    else:
        hs.append(
            draw(st.sampled_from([b"Content-Length: 99999999999999999999", b"Content-Length: 1e3"]))
        )
        payload = body
    hs = draw(st.permutations(hs))
    sep = b"\r\n"
    if not clean and draw(st.integers(0, 4)) == 4:
        sep = draw(st.sampled_from([b"\n", b"\r", b"\r\r\n"]))
    return line + b"\r\n" + b"".join(h + sep for h in hs) + b"\r\n" + payload


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """One to three messages (pipelined), garbage after them, a few bytes flipped."""
    data = b"".join(draw(st.lists(message(), min_size=1, max_size=3)))
    if draw(st.integers(0, 5)) == 5:
        data += draw(_bytes_piece)
    for _ in range(draw(st.integers(1, 3)) if draw(st.integers(0, 3)) == 3 else 0):
        i = draw(st.integers(0, max(0, len(data) - 1)))
        op = draw(st.sampled_from(["replace", "insert", "delete"]))
        b = draw(st.sampled_from(_NASTY) | st.binary(min_size=1, max_size=2))
        if op == "replace":
            data = data[:i] + b + data[i + 1 :]
        elif op == "insert":
            data = data[:i] + b + data[i:]
        else:
            data = data[:i] + data[i + 1 :]
    return data


# -- the reference parse and the response reader ----------------------------------------------


@dataclass
class Parsed:
    method: str = ""
    url: bytes = b""
    body: list[bytes] = field(default_factory=list)


class Reference:
    """What httptools makes of the same bytes, parsed alone."""

    def __init__(self, data: bytes) -> None:
        self.messages: list[Parsed] = []
        self._cur = Parsed()
        self.stopped: str | None = None
        parser = httptools.HttpRequestParser(self)
        self._parser = parser
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.stopped = "upgrade"
        except httptools.HttpParserError as exc:
            self.stopped = type(exc).__name__

    def on_message_begin(self) -> None:
        self._cur = Parsed()

    def on_url(self, url: bytes) -> None:
        self._cur.url += url

    def on_headers_complete(self) -> None:
        self._cur.method = self._parser.get_method().decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._cur.body.append(body)

    def on_message_complete(self) -> None:
        self.messages.append(self._cur)


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    interim: list[int]


def read_answers(
    sock: socket.socket, methods: list[str], closed: bool
) -> tuple[list[Answer], bytes]:
    """Parse responses strictly (h11), at most one per method; to EOF when ``closed``.

    Returns the answers and the bytes left after them."""
    buf = b""
    eof = False

    def recv() -> bytes:
        nonlocal eof
        if eof:
            return b""
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        eof = not data
        return data

    answers: list[Answer] = []
    for method in methods:
        conn = h11.Connection(h11.CLIENT)
        kind = "HEAD" if method == "HEAD" else ("CONNECT" if method == "CONNECT" else "GET")
        conn.send(h11.Request(method=kind, target="/", headers=[("Host", "gw")]))
        conn.send(h11.EndOfMessage())
        fed = bool(buf)
        if buf:
            conn.receive_data(buf)
            buf = b""
        answer: Answer | None = None
        interim: list[int] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = recv()
                if not data and not fed:
                    break  # the server closed before this one's answer
                fed = True
                conn.receive_data(data)  # b"": EOF (ends a close-delimited body)
                continue
            assert event is not h11.PAUSED, "a 2xx to CONNECT (a tunnel)"
            if isinstance(event, h11.InformationalResponse):
                interim.append(event.status_code)
            elif isinstance(event, h11.Response):
                answer = Answer(event.status_code, dict(event.headers), interim)
            elif isinstance(event, h11.EndOfMessage):
                break
        if answer is None:
            assert not interim, f"only {interim} before the connection closed"
            break
        answers.append(answer)
        rest, _ = conn.trailing_data
        buf = rest
    if closed:
        while data := recv():
            buf += data
    return answers, buf


# -- the property -----------------------------------------------------------------------------


def settle(env: Env, port: int, sent: int) -> CountingConn:
    """The server side of the example's connection, once it is quiet."""
    me = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        state = env.call(
            lambda: (
                c := env.conns.get(me),
                c is not None
                and (c.closed or (c.received >= sent and c.task is None and not c.queue)),
            )
        )
        if state[1]:
            return state[0]  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"the server never settled: {state}"
        time.sleep(0.001)


def normal_request(env: Env) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection(("127.0.0.1", env.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (len(body), body)
        )
        answers, _ = read_answers(s, ["POST"], closed=True)
    assert [a.status for a in answers] == [200]


def run_example(env: Env, data: bytes, figures: Counter[str]) -> None:
    forwarded_before = len(env.forwarded)
    errors_before = len(env.errors.records)
    sock = socket.create_connection(("127.0.0.1", env.port), timeout=10)
    try:
        port = sock.getsockname()[1]
        with contextlib.suppress(OSError):  # the server may close (refuse) first
            sock.sendall(data)
        conn = settle(env, port, len(data))
        closed = bool(env.call(lambda: conn.closed))
        taken: list[Request] = env.call(lambda: list(conn.taken))
        answers, rest = read_answers(sock, [r.method for r in taken], closed)
    finally:
        sock.close()

    # one well-formed answer per request taken in, in order, nothing else
    assert len(answers) == len(taken), (answers, taken)
    if closed:
        assert rest == b"", rest[:200]
    for req, answer in zip(taken, answers, strict=True):
        from_worker = b"x-mock-worker" in answer.headers
        assert answer.status < 500 or from_worker, (answer, req)
        if req.refusal is not None:
            assert answer.status == req.refusal.status
            assert answer.headers.get(b"connection") == b"close"
        figures[f"{answer.status}{'w' if from_worker else ''}"] += 1

    # framed as httptools frames the same bytes
    ref = Reference(data)
    ran = [r for r in taken if r.refusal is None]
    refused = [r for r in taken if r.refusal is not None]
    assert len(refused) <= 1 and (not refused or taken[-1] is refused[0])
    assert len(ran) <= len(ref.messages), (ran, ref.messages)
    # at most one answer beyond the complete requests: the refusal of what followed
    # them (never after an upgrade request: nothing after it is read as HTTP)
    extra = len(taken) - len(ref.messages)
    assert extra <= 0 or (extra == 1 and refused and ref.stopped != "upgrade"), (taken, ref)
    for req, parsed in zip(ran, ref.messages, strict=False):
        assert req.method == parsed.method
        assert req.body == b"".join(parsed.body)
    if refused:
        assert closed
        figures["refused"] += 1
    elif ref.stopped == "upgrade":
        assert closed
        figures["upgrade"] += 1
    elif not closed:
        assert len(ran) == len(ref.messages), (ran, ref.messages, ref.stopped)
    # the worker saw only routed requests, with the bodies the server framed
    seen = env.forwarded[forwarded_before:]
    routed = iter([r for r in ran if r.match is not None])
    for fwd in seen:
        assert b"x-trailer" not in fwd.headers, "a trailer field was merged into the head"
        # (a body sent with GET or DELETE is not forwarded: meshkit's choice)
        assert any(
            fwd.method == r.method and (fwd.body == r.body or (not fwd.body and r.method != "POST"))
            for r in routed
        ), (fwd, ran)
    figures["forwarded"] += len(seen)
    figures["examples"] += 1
    figures["closed" if closed else "open"] += 1

    new_errors = env.errors.records[errors_before:]
    assert not new_errors, [r.getMessage() for r in new_errors]
    assert env.mesh.total_load() == 0 or _settles(env.mesh)
    normal_request(env)


def _settles(mesh: Mesh) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if mesh.total_load() == 0:
            return True
        time.sleep(0.005)
    return False


def test_raw_bytes(env: Env) -> None:
    figures: Counter[str] = Counter()

    @fuzz_settings()
    @given(data=streams())
    def prop(data: bytes) -> None:
        run_example(env, data, figures)

    prop()
    FIGURES["raw_bytes"] = figures
    _report("h1-raw-bytes", figures)


# -- request smuggling, on purpose ------------------------------------------------------------

SMUGGLED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Smuggled: 1\r\nContent-Length: 2\r\n"
    b"\r\n{}"
)


@st.composite
def smuggling(draw: st.DrawFn) -> bytes:
    """A front request whose framing is ambiguous, a smuggled one inside its body."""
    inner = SMUGGLED
    chunked = b"0\r\n\r\n" + inner
    cl_name = draw(st.sampled_from([b"Content-Length", b"content-length", b"CONTENT-LENGTH"]))
    te_name = draw(st.sampled_from([b"Transfer-Encoding", b"transfer-encoding"]))
    te_value = draw(
        st.sampled_from(
            [b"chunked", b"Chunked", b" chunked", b"chunked ", b"gzip, chunked", b"chunked, gzip"]
        )
    )
    ows = draw(st.sampled_from([b"", b" ", b"\t"]))
    variant = draw(
        st.sampled_from(["cl+te", "te+cl", "cl+cl", "te+te", "te obs-fold", "te", "cl", "cl=0"])
    )
    if variant == "te":  # one framing, spelt oddly: the inner request is the next one
        hs = [te_name + b":" + ows + te_value]
        body = chunked
    elif variant == "cl":  # the inner request is the front one's body
        hs = [cl_name + b":" + ows + b"%d" % len(inner)]
        body = inner
    elif variant == "cl=0":  # the inner request is the next one
        hs = [cl_name + b":" + ows + b"0"]
        body = inner
    elif variant == "cl+te":
        hs = [cl_name + b":" + ows + b"5", te_name + b":" + ows + te_value]
        body = chunked
    elif variant == "te+cl":
        hs = [te_name + b": " + te_value, cl_name + b": " + b"%d" % len(chunked)]
        body = chunked
    elif variant == "cl+cl":
        hs = [cl_name + b": 0", cl_name + b":" + ows + b"%d" % len(inner)]
        body = inner
    elif variant == "te+te":
        hs = [te_name + b": " + te_value, te_name + b": identity"]
        body = chunked
    else:
        hs = [te_name + b":\r\n " + te_value, cl_name + b": 5"]
        body = chunked
    hs = [b"Host: gw", *draw(st.permutations(hs))]
    front = draw(st.sampled_from([b"/v1/chat/completions", b"/health", b"/v1/models"]))
    method = b"POST" if front != b"/v1/models" else b"GET"
    return method + b" " + front + b" HTTP/1.1\r\n" + b"\r\n".join(hs) + b"\r\n\r\n" + body


def test_request_smuggling_is_refused_or_framed_as_parsed(env: Env) -> None:
    figures: Counter[str] = Counter()
    examples = max(50, (fuzz_settings().max_examples or 300) // 3)

    @settings(fuzz_settings(), max_examples=examples)
    @given(data=smuggling())
    def prop(data: bytes) -> None:
        before = len(env.forwarded)
        run_example(env, data, figures)
        smuggled = [f for f in env.forwarded[before:] if f.body == b"{}"]
        if smuggled:  # only as the second request of the bytes, as httptools frames them
            ref = Reference(data)
            assert len(ref.messages) == 2 and ref.messages[1].body == [b"{}"], ref.messages
            figures["pipelined, as parsed"] += 1

    prop()
    FIGURES["smuggling"] = figures
    _report("h1-smuggling", figures)


def _report(name: str, figures: Counter[str]) -> None:
    where = os.environ.get("MESHKIT_REPORT_DIR")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"fuzz-{name}.json").write_text(
            json.dumps(dict(figures), indent=2, sort_keys=True)
        )
