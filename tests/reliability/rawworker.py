"""A tiny worker that answers every POST with scripted bytes (a chunked SSE body),
for what the mock worker cannot send: overlong events, odd framing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from harness import serve_thread


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive, nothing logged."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        return None

    def read_body(self) -> bytes:
        """The request's body: ``content-length`` or chunked (Envoy's full duplex)."""
        if "chunked" not in (self.headers.get("transfer-encoding") or "").lower():
            return self.rfile.read(int(self.headers.get("content-length") or 0))
        out = b""
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b""):
                    pass  # trailers
                return out
            out += self.rfile.read(size)
            self.rfile.readline()


class Served:
    """A handler class served on 127.0.0.1 by a thread of its own: ``url``; stop
    with ``close()``. The test workers below (and the tests' own) are these."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = serve_thread(self.server)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


class RawWorker(Served):
    """``RawWorker(lambda: [b"data: ...\\n\\n", ...])``; ``url``; stop with ``close()``."""

    def __init__(
        self,
        chunks: Callable[[], Iterable[bytes]],
        name: str = "raw",
        hold: threading.Event | None = None,
    ) -> None:
        """:param hold: when given, the body stays open after the chunks until it is
        set (an engine that reported an error and did not close); ``ended`` counts
        the bodies that were finished."""
        self.paths: list[str] = []
        self.ended = 0
        #: set once the chunks are written (the body still open when ``hold`` is given)
        self.flushed = threading.Event()
        outer = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                outer.paths.append(self.path)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.send_header("x-mock-worker", name)
                self.end_headers()
                for chunk in chunks():
                    self.wfile.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                outer.flushed.set()
                if hold is not None:
                    hold.wait(60)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                outer.ended += 1

            def do_GET(self) -> None:  # health probes
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

        super().__init__(Handler)


class StaleKeepAliveWorker(Served):
    """Keeps connections alive, but the first time a connection is reused it is
    closed as the request arrives, without an answer: what a client sees when it
    reuses a pooled connection just as the worker's keep-alive timer closes it.
    (Once: two such races in a row on one request do not happen; a worker restart
    closes every connection at once, which pools notice before reusing them.)"""

    BODY = (
        b'{"id":"c","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
    )

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0
        outer = self

        class Handler(QuietHandler):
            served = 0

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                if self.served >= 1 and outer.dropped == 0:
                    outer.dropped += 1
                    self.close_connection = True  # no answer at all
                    return
                self.served += 1
                outer.answered += 1
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(outer.BODY)))
                self.send_header("x-mock-worker", "stale")
                self.end_headers()
                self.wfile.write(outer.BODY)

        super().__init__(Handler)


class TruncatingWorker(Served):
    """Answers a plain JSON body announced at 1000 bytes, sends 58, then closes:
    a worker that died half-way through a non-stream answer. With ``silent_s``
    it stays silent that long (or until closed) instead of closing: a worker that
    stalled half-way."""

    PART = b'{"id":"x","choices":[{"index":0,"message":{"content":"part'

    def __init__(self, silent_s: float = 0.0) -> None:
        self.release = threading.Event()
        outer = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "1000")
                self.send_header("x-mock-worker", "cut")
                self.end_headers()
                self.wfile.write(outer.PART)
                self.wfile.flush()
                if silent_s:
                    outer.release.wait(silent_s)
                self.close_connection = True

        super().__init__(Handler)

    def close(self) -> None:
        self.release.set()
        super().close()
