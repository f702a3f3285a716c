"""
One routed request, for async servers
=====================================

:class:`Routed` is what an async front end does with a request meshkit owns, once
its head is checked and its body read: prepare it, drive the forward flow, relay
the worker's response (or meshkit's own answer) and settle the books exactly
once. The front end supplies a :class:`Downstream`, the only thing that differs
between :class:`~meshkit.MeshMiddleware` (ASGI ``send`` messages) and the built-in
server (bytes on its own transport), so both take the same steps in the same
order. The body goes through the core relay (:class:`~meshkit.core.relay.Relay`),
as in every mode: the books close before the loop takes the client's next
request, and an upstream failure after the first byte ends the stream with the
one error event every mode sends.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from meshkit.core.credentials import served_headers
from meshkit.core.endpoints import Match
from meshkit.core.relay import Relay
from meshkit.errors import ErrorShape, MeshError
from meshkit.mesh import Mesh
from meshkit.types import Headers
from meshkit.upstream.base import AsyncExchange, AsyncUpstream, UpstreamFailure
from meshkit.upstream.drive import Answered, FlowEnd, Relayed, drive_async

__all__ = ["Downstream", "Headers", "Routed", "error_reply"]


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
        "client_left",
        "down",
        "final",
        "match",
        "mesh",
        "relay",
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
        self.relay: Relay | None = None
        self.final: FlowEnd[AsyncExchange] | None = None

    async def fail(self, exc: MeshError) -> None:
        """Answer a refusal, unless a response already started."""
        if not self.started:
            self.started = self.responded = True
            await self.down.whole(*error_reply(self.mesh, exc, self.match.endpoint.shape))

    async def run(
        self,
        method: str,
        body: bytes,
        headers: Headers,
        query: str,
        watcher: asyncio.Future[Any] | None = None,
    ) -> None:
        """Route, answer a refusal, settle; a cancellation the front end caused because
        the client left (``client_left``) ends here quietly, any other goes on.

        :param watcher: what the front end watches the client with; cancelled
            before the books settle, so no late disconnect cancels the settling.
        """
        # One coroutine for the whole request (the routing inlined, not awaited as
        # another): a frame less to create and to resume through at every wake-up.
        try:
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
            status = exchange.status  # read once: a protocol's attribute, looked up
            relay = self.relay = Relay(mesh.account(view, final.attempt.lease, status), view)
            self.started = True
            await down.start(status, served_headers(exchange.headers, status))
            data = exchange.whole()
            if data is not None:
                # The common small answer, all here with its head: one write, no
                # iteration. ``end`` hands its bytes over before it could suspend, so
                # the books close after the write yet before the loop can read the
                # client's next request (writing first lets it arrive meanwhile).
                self.responded = True
                await down.end(relay.whole(data))
                relay.end()
                self.final = None  # books closed, exchange ended: nothing to settle
                return
            try:
                async for chunk in exchange.chunks():
                    out = relay.chunk(chunk)
                    if out:
                        await down.body(out)
                    if relay.finished:  # the stream's own error event ended it
                        break
            except UpstreamFailure:
                # After the first byte an upstream failure cannot become an HTTP error:
                # one error event, or (no event framing) a body the server cuts short.
                self.responded = True
                with contextlib.suppress(Exception):
                    await down.end(relay.fail())
                return
            self.responded = True
            await down.end(relay.end())
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self.client_left or task is None:
                raise
            task.uncancel()
        except MeshError as exc:
            await self.fail(exc)
        finally:
            if watcher is not None:
                watcher.cancel()
            await self.settle()

    async def settle(self) -> None:
        """Release whatever is still held, exactly once (every path ends here)."""
        final = self.final
        if final is None:
            return
        relay = self.relay
        if relay is not None:
            relay.close()  # closing the books releases the lease (once)
        elif final.attempt is not None:
            # Idempotent: a no-op when accounting released it already. Before the
            # close below, which awaits (and may be cancelled) and may raise.
            final.attempt.lease.release(ok=self.responded)
        if isinstance(final, Relayed):
            await final.exchange.aclose()
