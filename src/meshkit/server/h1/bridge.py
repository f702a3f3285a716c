"""
The built-in server's ASGI bridge
=================================

Requests meshkit does not route (``/health``, ``/metrics``, ``/workers`` ...) go
to the gateway's ASGI app, with the request body already read and bounded. The
bridge is deliberately small: HTTP scopes only (no websockets, no lifespan: the
server closes the gateway itself), one ``http.request`` message, then
``receive()`` waits until the client leaves (its task is cancelled).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

if TYPE_CHECKING:
    from meshkit.server.h1.conn import H1Conn, Request

__all__ = ["INTERNAL", "run_asgi"]

#: the answer to a request whose app failed before its response began
INTERNAL = b'{"error":{"message":"internal error","type":"server_error","code":"internal_error"}}'


async def run_asgi(app: Any, conn: H1Conn, req: Request) -> None:
    """Run ``app`` for one request on ``conn``."""
    transport = conn.transport
    assert transport is not None
    server = transport.get_extra_info("sockname")
    peer = transport.get_extra_info("peername")
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1" if req.http11 else "1.0",
        "server": tuple(server[:2]) if isinstance(server, tuple) else None,
        "client": tuple(peer[:2]) if isinstance(peer, tuple) else None,
        "scheme": "http",
        "method": req.method,
        "root_path": "",
        "path": unquote(req.path),
        "raw_path": req.raw_path,
        "query_string": req.query,
        "headers": req.headers,
        "state": {},
    }
    delivered = False
    started = ended = False

    async def receive() -> MutableMapping[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        # Nothing more will come; the task is cancelled when the client leaves.
        await conn.loop.create_future()
        return {"type": "http.disconnect"}  # pragma: no cover

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal started, ended
        kind = message["type"]
        if kind == "http.response.start" and not started:
            started = True
            headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
            await conn.start(int(message["status"]), headers)
        elif kind == "http.response.body" and started and not ended:
            body = message.get("body", b"")
            if req.method == "HEAD":
                body = b""
            if message.get("more_body", False):
                await conn.body(body)
            else:
                ended = True
                await conn.end(body)

    await app(scope, receive, send)
    if not started:
        conn.keep_alive = False
        await conn.whole(500, [(b"content-type", b"application/json")], INTERNAL)
    elif not ended:
        conn.keep_alive = False  # a body cut short: only closing can say so
