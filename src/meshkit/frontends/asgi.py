"""
ASGI middleware
===============

.. code-block:: python

    app.add_middleware(MeshMiddleware, mesh=mesh)     # FastAPI / Starlette
    app = MeshMiddleware(app)                         # any ASGI app; Mesh.from_env()

Pure ASGI (no ``BaseHTTPMiddleware``): inference paths are routed, every other
path and every non-HTTP scope (websocket, lifespan) go to the wrapped app
untouched. Each routed request gets a :class:`_Exchange` (starlette's per-request
responder pattern) that checks the head (``bounds.max_header_bytes`` and
``bounds.max_headers``, 431), reads the body under its bound (413 as soon as it
is over ``bounds.max_body_bytes``: the rest is never read), prepares it, drives
the forward flow and relays the worker's response chunk by chunk as it arrives.

The server's own limits apply first: uvicorn refuses a head over its parser's
limit before the middleware runs (h11: ``h11_max_incomplete_event_size``,
16 KiB by default; httptools has none), so under uvicorn a request head is
bounded by the smaller of the two.

A client that disconnects cancels the exchange at once: the prepare job if it
has not started, the upstream request (its connection is closed, so the worker
sees the disconnect), and the worker's load and lease.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from meshkit.core.endpoints import Match, shape_for_path
from meshkit.core.requests import check_declared, check_head
from meshkit.errors import MeshError
from meshkit.frontends.asgi_body import receive_body
from meshkit.frontends.routed import Routed, error_reply
from meshkit.mesh import Mesh
from meshkit.types import ASGIApp, Headers, Message, Receive, Scope, Send
from meshkit.upstream.base import AsyncUpstream
from meshkit.upstream.select import async_upstream

__all__ = ["MeshMiddleware"]


log = logging.getLogger("meshkit.asgi")


class MeshMiddleware:
    """Routes inference requests of an ASGI app to a fleet of workers.

    :param app: the wrapped ASGI application (receives every other request).
    :param mesh: the :class:`~meshkit.Mesh`; ``Mesh.from_env()`` when omitted.
    :param upstream: the HTTP client towards workers (default: the one
        :func:`~meshkit.upstream.select.async_upstream` chooses: pooled keep-alive
        connections on raw asyncio protocols, httpcore for https).
    """

    def __init__(
        self,
        app: ASGIApp,
        mesh: Mesh | None = None,
        *,
        upstream: AsyncUpstream | None = None,
    ) -> None:
        self.app = app
        self.mesh = mesh if mesh is not None else Mesh.from_env()
        self.upstream = upstream or async_upstream(self.mesh.config.upstream)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self.app(scope, receive, self._lifespan_send(send))
                return
            await self.app(scope, receive, send)
            return
        raw = scope.get("raw_path")
        path = raw.decode("latin-1") if raw else scope["path"]
        if "?" in path:  # some servers put the query into raw_path
            path = path.split("?", 1)[0]
        try:
            match = self.mesh.resolve(scope["method"], path)
        except MeshError as exc:
            await _AsgiDown(send).whole(*error_reply(self.mesh, exc, shape_for_path(path)))
            return
        if match is None:
            await self.app(scope, receive, send)
            return
        await _Exchange(self, scope, receive, send, match).run()

    def _lifespan_send(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.aclose()
            await send(message)

        return wrapped

    async def aclose(self) -> None:
        await self.upstream.aclose()


class _AsgiDown:
    """A :class:`~meshkit.frontends.routed.Downstream` over ASGI ``send``."""

    __slots__ = ("send",)

    def __init__(self, send: Send) -> None:
        self.send = send

    async def start(self, status: int, headers: Headers) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, chunk: bytes) -> None:
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, chunk: bytes = b"") -> None:
        await self.send({"type": "http.response.body", "body": chunk})

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})


class _Exchange:
    """One routed request: the ASGI side (head, body, disconnects) of a :class:`Routed`."""

    __slots__ = ("match", "mw", "receive", "routed", "scope", "send")

    def __init__(
        self, mw: MeshMiddleware, scope: Scope, receive: Receive, send: Send, match: Match
    ) -> None:
        self.mw = mw
        self.scope = scope
        self.receive = receive
        self.send = send
        self.match = match
        self.routed = Routed(mw.mesh, mw.upstream, match, _AsgiDown(send))

    async def run(self) -> None:
        mesh = self.mw.mesh
        headers: list[tuple[bytes, bytes]] = self.scope["headers"]
        bounds = mesh.config.bounds
        routed = self.routed
        try:
            check_head(headers, max_bytes=bounds.max_header_bytes, max_count=bounds.max_headers)
            body = await self._read_body(headers, bounds.max_body_bytes)
        except MeshError as exc:
            await routed.fail(exc)
            return
        if body is None:  # the client left while sending its body
            return
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self.receive())
        watcher.add_done_callback(lambda w: self._on_receive(w, task))
        query = self.scope.get("query_string", b"").decode("latin-1")
        await routed.run(self.scope["method"], body, headers, query, watcher)

    def _on_receive(self, watcher: asyncio.Future[Message], task: asyncio.Task[Any] | None) -> None:
        if watcher.cancelled() or self.routed.responded:
            return
        if watcher.exception() is None and watcher.result().get("type") == "http.disconnect":
            self.routed.client_left = True
            if task is not None:
                task.cancel()

    async def _read_body(self, headers: list[tuple[bytes, bytes]], limit: int) -> bytes | None:
        if not self.match.endpoint.has_body:
            # Drain nothing: GET/DELETE bodies are not forwarded.
            return b""
        check_declared(headers, limit)
        return await receive_body(self.receive, limit)
