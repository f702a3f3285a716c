"""
One routed request, for async servers
=====================================

:class:`Routed` is what an async front end does with a request meshkit owns, once
its head is checked and its body read: prepare it, drive the forward flow, relay
the worker's response (or meshkit's own answer) and settle the books exactly
once. The front end supplies a :class:`Downstream`, the only thing that differs
between :class:`~meshkit.MeshMiddleware` (ASGI ``send`` messages) and the built-in
server (bytes on its own transport), so both take the same steps in the same
order: accounting closes before the loop takes the client's next request (with
no await between the last write and the books), and an upstream failure after
the first byte ends the stream with one error event in its own framing.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from meshkit.core.credentials import response_headers
from meshkit.core.endpoints import Match, StreamFormat
from meshkit.core.sse import stream_error_event
from meshkit.errors import ErrorShape, MeshError
from meshkit.mesh import Accounting, Mesh
from meshkit.upstream.base import AsyncUpstream
from meshkit.upstream.drive import (
    Answered,
    AsyncExchange,
    Final,
    Relayed,
    UpstreamFailure,
    drive_async,
)

__all__ = ["Downstream", "Headers", "Routed", "error_reply"]

Headers = list[tuple[bytes, bytes]]


class Downstream(Protocol):
    """Where a response goes. ``start`` is followed by ``body`` calls and one ``end``;
    ``whole`` is a complete response of known length, instead of all three."""

    async def start(self, status: int, headers: Headers) -> None: ...

    async def body(self, chunk: bytes) -> None: ...

    async def end(self, chunk: bytes = b"") -> None: ...

    async def whole(self, status: int, headers: Headers, body: bytes) -> None: ...


def error_reply(mesh: Mesh, exc: MeshError, shape: ErrorShape) -> tuple[int, Headers, bytes]:
    """Count a refusal and render it in the API's own shape."""
    mesh.reject(exc)
    return exc.status, exc.headers(), exc.body(shape)


class Routed:
    """The per-request responder: route, relay, settle."""

    __slots__ = (
        "acct",
        "client_left",
        "down",
        "final",
        "match",
        "mesh",
        "responded",
        "started",
        "upstream",
    )

    def __init__(self, mesh: Mesh, upstream: AsyncUpstream, match: Match, down: Downstream) -> None:
        self.mesh = mesh
        self.upstream = upstream
        self.match = match
        self.down = down
        #: set by the front end when it saw the client leave
        self.client_left = False
        self.started = False  # a response head was sent
        self.responded = False  # the last body byte was handed to the front end
        self.acct: Accounting | None = None
        self.final: Final[AsyncExchange] | None = None

    async def fail(self, exc: MeshError) -> None:
        """Answer a refusal, unless a response already started."""
        if not self.started:
            self.started = self.responded = True
            await self.down.whole(*error_reply(self.mesh, exc, self.match.endpoint.shape))

    async def route(self, method: str, body: bytes, headers: Headers, query: str) -> None:
        mesh = self.mesh
        view = await mesh.prepare_async(self.match, body, headers, query)
        flow = mesh.forward(view, headers, method)
        final = self.final = await drive_async(flow, self.upstream.asend)
        down = self.down
        if isinstance(final, Answered):
            local = final.local
            mesh.account_local(view, final.attempt, local)
            self.started = self.responded = True
            await down.whole(local.status, list(local.headers), local.body)
            return
        exchange = final.exchange
        acct = self.acct = mesh.account(view, final.attempt.lease, exchange.status)
        self.started = True
        await down.start(exchange.status, response_headers(exchange.headers))
        # An exchange may offer ``whole()``: the body, when it all arrived with its
        # head (the common small answer). One write then, and no iteration.
        whole = getattr(exchange, "whole", None)
        data = whole() if whole is not None else None
        if data is not None:
            acct.feed(data)
            self.responded = True
            await down.end(data)
            # Closed after the write, yet before the loop can read the client's next
            # request: ``end`` hands its bytes over before it could suspend (for a
            # drain, which wakes this task before the client can have read them).
            # Writing first lets that request arrive while this one finishes.
            acct.end()
            self.final = None  # the books are closed and the exchange ended: nothing to settle
            return
        try:
            async for chunk in exchange.chunks():
                acct.feed(chunk)
                await down.body(chunk)
        except UpstreamFailure:
            # After the first byte an upstream failure cannot become an HTTP error.
            fmt = view.match.endpoint.stream_format if view.stream else StreamFormat.NONE
            tail = stream_error_event(
                fmt, "upstream_error", "the worker failed while streaming the response"
            )
            acct.abort(client_left=False)
            self.responded = True
            with contextlib.suppress(Exception):
                await down.end(tail)
            return
        self.responded = True
        # Close the books (lease, Responses affinity) before the client holds the
        # whole response and can send its next request.
        acct.end()
        await down.end()

    async def settle(self) -> None:
        """Release whatever is still held, exactly once (every path ends here)."""
        final = self.final
        if final is None:
            return
        acct = self.acct
        if acct is not None:
            # Closing the books releases the lease (once): nothing else to release.
            if self.responded:
                acct.end()
            else:
                acct.abort(client_left=self.client_left)
        if isinstance(final, Relayed):
            await final.exchange.aclose()
        if acct is None and final.attempt is not None:
            # Idempotent: a no-op when accounting released it already.
            final.attempt.lease.release(ok=self.responded)
