"""Shared by the upstream clients' tests: attempts built by hand (no mesh, no lease
to keep), headers that would inject a line, scripted response bytes, and a raw
HTTP server on 127.0.0.1 that records the exact request bytes and answers with a
script.

The server's threads are daemons and every blocking wait (its sockets, joins,
events) is bounded by ``HANG_S``, so a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from meshkit.core.forward import Attempt
from meshkit.core.workers import Candidate, Worker

JSON = [(b"content-type", b"application/json")]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
#: the bound of every blocking wait in these tests (a hang fails after it)
HANG_S = 10.0
#: headers whose name or value would inject a line into a request head
INJECTED_HEADERS = [
    (b"x-a", b"1\r\nx-injected: 1"),
    (b"x-a", b"1\nx-injected: 1"),
    (b"x-a", b"1\r"),
    (b"x-a\r\nx-injected", b"1"),
    (b"x-a\n", b"1"),
]


class FakeLease:
    """A lease that holds nothing: the upstream clients never look into it."""

    candidate: Any = None
    started = 0.0

    def release(self, *, ok: bool, status: int | None = None) -> None:
        return None

    def abandon(self) -> None:
        return None


#: the worker an attempt names (the URL alone decides where it goes)
_CANDIDATE = Candidate(Worker("http://127.0.0.1:9"))


def attempt(
    url: str,
    body: bytes = b"",
    *,
    method: str = "POST",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> Attempt:
    """One attempt to ``url`` (JSON content type unless ``headers`` are given)."""
    return Attempt(
        number=0,
        candidate=_CANDIDATE,
        lease=FakeLease(),
        method=method,
        url=url,
        headers=list(JSON if headers is None else headers),
        body=body,
    )


def ch(data: bytes, ext: bytes = b"") -> bytes:
    """One chunk of a chunked body (with an optional chunk extension)."""
    return b"%x%s\r\n%s\r\n" % (len(data), ext, data)


#: an SSE answer in chunks, split across writes, with mixed-case header names
CHUNKED_SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"X-Mixed-Case: Kept\r\n\r\n",
    ch(b"data: a"),
    ch(b"\n\n"),
    ch('data: {"k": "\u00e9\u20ac"}\n\n'.encode(), b";ext=1"),
    ch(b"data: [DONE]") + ch(b"\n\n") + b"0\r\n\r\n",
)
CHUNKED_SSE_BODY = b'data: a\n\ndata: {"k": "\xc3\xa9\xe2\x82\xac"}\n\ndata: [DONE]\n\n'


def normal(body: bytes) -> bytes:
    """Without what the mock worker makes anew per request (ids, creation times)."""
    body = re.sub(rb"(chatcmpl|cmpl|resp|msg)[-_][\w-]+", rb"ID", body)
    return re.sub(rb'"created(_at)?":\s*\d+', b'"created":0', body)


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
    close the connection. ``n`` counts the requests on that connection;
    ``requests`` holds every request's exact head and body bytes.

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
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"

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
        if b" /hold " not in head.split(b"\r\n", 1)[0]:
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
