"""A worker that answers every API request with what a test scripts: any status,
headers and body (a 429 with its own retry hints, a 204, a 304 ...), for what the
mock worker cannot send. It reads ``content-length`` and chunked request bodies
(Envoy sends a full-duplex body chunked). ``GET /health`` and ``GET /v1/models``
answer as a healthy worker's do."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: (status, headers, body); ``content-length`` is added unless given (or bodiless)
Scripted = tuple[int, list[tuple[str, str]], bytes]
_MODELS = b'{"object":"list","data":[{"id":"m","object":"model","owned_by":"script"}]}'


class ScriptWorker:
    """``ScriptWorker(lambda method, path, body: (status, headers, body))``; ``url``;
    ``seen`` lists the API requests; stop with ``close()``."""

    def __init__(self, answer: Callable[[str, str, bytes], Scripted]) -> None:
        self.seen: list[tuple[str, str, bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                return None

            def _body(self) -> bytes:
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

            def _answer(self) -> None:
                body = self._body()
                if self.command == "GET" and self.path in ("/health", "/v1/models"):
                    status, headers, data = 200, [("content-type", "application/json")], _MODELS
                else:
                    outer.seen.append((self.command, self.path, body))
                    status, headers, data = answer(self.command, self.path, body)
                self.send_response(status)
                framed = any(
                    k.lower() in ("content-length", "transfer-encoding") for k, _ in headers
                )
                for k, v in headers:
                    self.send_header(k, v)
                if not framed and status not in (204, 304):
                    self.send_header("content-length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD" and status not in (204, 304):
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
