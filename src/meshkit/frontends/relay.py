"""
Relaying a response body
========================

The body of the final attempt goes to the client chunk by chunk; each chunk feeds
the accounting. The stream's ``close()`` settles accounting and the lease exactly
once: a stream read to its end counts as completed, one closed early (the client
went away) as aborted. An upstream failure after the first byte ends the stream
with one error event in its own framing. A body without event framing (a plain
JSON answer) has no way to say so in-band: the client transports then raise their
library's ``RemoteProtocolError``, as a direct connection would, instead of
handing over a silently truncated body.

The stream classes subclass both httpx's and httpx2's byte-stream bases, so a
client transport can hand them to either library's ``Response``; the WSGI
middleware returns the sync one as its response iterable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import httpx

from meshkit.core.endpoints import StreamFormat
from meshkit.core.requests import RequestView
from meshkit.core.sse import stream_error_event
from meshkit.mesh import Accounting
from meshkit.upstream.drive import AsyncExchange, SyncExchange, UpstreamFailure

try:
    import httpx2
except ImportError:  # pragma: no cover
    httpx2 = None  # type: ignore[assignment]

__all__ = ["AsyncRelayStream", "Relay", "SyncRelayStream"]

_SyncStream: tuple[type, ...] = (httpx.SyncByteStream,) + (
    (httpx2.SyncByteStream,) if httpx2 else ()
)
_AsyncStream: tuple[type, ...] = (httpx.AsyncByteStream,) + (
    (httpx2.AsyncByteStream,) if httpx2 else ()
)


class Relay:
    """Shared by the sync and async streams: accounting and the lease, once."""

    def __init__(
        self,
        view: RequestView,
        acct: Accounting,
        abort: Callable[[], BaseException] | None = None,
    ) -> None:
        self.view = view
        self.acct = acct
        #: the exception that ends a body cut short without an error event
        self.abort = abort
        self.finished = False

    def failed_tail(self) -> bytes:
        fmt = self.view.match.endpoint.stream_format if self.view.stream else StreamFormat.NONE
        self.acct.abort(client_left=False)
        return stream_error_event(fmt, "upstream_error", "the worker failed mid-response")

    def settle(self) -> None:
        # Accounting releases the lease, exactly once. A client that closes right
        # after the terminal event (the openai SDK stops at [DONE], before EOF)
        # got the whole response: that is a completion, not a disconnect.
        if self.finished or self.acct.accountant.done:
            self.acct.end()
        else:
            self.acct.abort(client_left=True)


class SyncRelayStream(*_SyncStream):  # type: ignore[misc]
    def __init__(self, exchange: SyncExchange, relay: Relay) -> None:
        self._exchange = exchange
        self._relay = relay

    def __iter__(self) -> Iterator[bytes]:
        relay = self._relay
        hold = not relay.view.stream
        held = b""
        try:
            for chunk in self._exchange.chunks():
                relay.acct.feed(chunk)
                if hold:
                    # A whole body is relayed one chunk behind, so the books close
                    # (lease, Responses affinity) before the client holds all of it
                    # and can send its next request (previous_response_id).
                    if held:
                        yield held
                    held = chunk
                    continue
                yield chunk
        except UpstreamFailure:
            if held:
                yield held
            tail = relay.failed_tail()
            if tail:
                yield tail
            elif relay.abort is not None:
                raise relay.abort() from None
            return
        relay.finished = True
        # The worker's body ended: close the books now, not when the server or the
        # client gets round to close() (a whole body's last chunk is still held, so
        # they close before the client holds all of it).
        relay.acct.end()
        if held:
            yield held

    def close(self) -> None:
        self._exchange.close()
        self._relay.settle()


class AsyncRelayStream(*_AsyncStream):  # type: ignore[misc]
    def __init__(self, exchange: AsyncExchange, relay: Relay) -> None:
        self._exchange = exchange
        self._relay = relay

    async def __aiter__(self) -> AsyncIterator[bytes]:
        relay = self._relay
        hold = not relay.view.stream
        held = b""
        try:
            async for chunk in self._exchange.chunks():
                relay.acct.feed(chunk)
                if hold:
                    if held:
                        yield held
                    held = chunk
                    continue
                yield chunk
        except UpstreamFailure:
            if held:
                yield held
            tail = relay.failed_tail()
            if tail:
                yield tail
            elif relay.abort is not None:
                raise relay.abort() from None
            return
        relay.finished = True
        # The worker's body ended: close the books now, not when the server or the
        # client gets round to close() (a whole body's last chunk is still held, so
        # they close before the client holds all of it).
        relay.acct.end()
        if held:
            yield held

    async def aclose(self) -> None:
        await self._exchange.aclose()
        self._relay.settle()
