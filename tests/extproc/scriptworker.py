"""A worker that answers every API request with what a test scripts: any status,
headers and body (a 429 with its own retry hints, a 204, a 304 ...), for what the
mock worker cannot send. It reads ``content-length`` and chunked request bodies
(Envoy sends a full-duplex body chunked). ``GET /health`` and ``GET /v1/models``
answer as a healthy worker's do."""

from __future__ import annotations

from collections.abc import Callable

from reliability.rawworker import QuietHandler, Served

#: (status, headers, body); ``content-length`` is added unless given (or bodiless)
Scripted = tuple[int, list[tuple[str, str]], bytes]
_MODELS = b'{"object":"list","data":[{"id":"m","object":"model","owned_by":"script"}]}'


class ScriptWorker(Served):
    """``ScriptWorker(lambda method, path, body: (status, headers, body))``; ``url``;
    ``seen`` lists the API requests; stop with ``close()``."""

    def __init__(self, answer: Callable[[str, str, bytes], Scripted]) -> None:
        self.seen: list[tuple[str, str, bytes]] = []
        outer = self

        class Handler(QuietHandler):
            def _answer(self) -> None:
                body = self.read_body()
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

        super().__init__(Handler)
