"""
Relayed bodies for the front ends that hand out an iterable
===========================================================

The WSGI middleware returns a response iterable and the client transports hand
their library a byte stream; both are these two classes, which drive the core
relay (:class:`~meshkit.core.relay.Relay`) with an upstream exchange's chunks.
Their ``close()`` (which every WSGI server calls, also when the client went
away, and every httpx response calls) settles the books exactly once.

A body cut short that has no in-band way to say so (a plain JSON answer) raises
``cut()``'s exception when one is given (the client transports raise their
library's ``RemoteProtocolError``, as a direct connection would); without one the
iterable simply ends, and the server's framing tells the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

from meshkit.core.relay import Relay
from meshkit.upstream.base import AsyncExchange, SyncExchange, UpstreamFailure

__all__ = ["NO_BOOKS", "AsyncRelayStream", "SyncRelayStream"]

Cut = Callable[[], BaseException] | None


class _NoBooks:
    """The books of a body meshkit only passes through: none to keep."""

    done = False
    stopped = False

    def feed(self, chunk: bytes) -> None:
        return None

    def end(self) -> None:
        return None

    def abort(self, *, client_left: bool = True) -> None:
        return None


#: for a request meshkit does not route (``Relay(NO_BOOKS, None)``)
NO_BOOKS = _NoBooks()


class SyncRelayStream:
    """A relayed body as an iterable of bytes (see the module docstring)."""

    __slots__ = ("_cut", "_exchange", "_relay")

    def __init__(self, exchange: SyncExchange, relay: Relay, cut: Cut = None) -> None:
        self._exchange = exchange
        self._relay = relay
        self._cut = cut

    def __iter__(self) -> Iterator[bytes]:
        relay = self._relay
        try:
            for chunk in self._exchange.chunks():
                out = relay.chunk(chunk)
                if out:
                    yield out
                if relay.finished:
                    break
        except UpstreamFailure:
            out = relay.fail()
        else:
            out = relay.end()
        if out:
            yield out
        if relay.cut and self._cut is not None:
            raise self._cut()

    def close(self) -> None:
        self._exchange.close()
        self._relay.close()


class AsyncRelayStream:
    """:class:`SyncRelayStream` for an async exchange."""

    __slots__ = ("_cut", "_exchange", "_relay")

    def __init__(self, exchange: AsyncExchange, relay: Relay, cut: Cut = None) -> None:
        self._exchange = exchange
        self._relay = relay
        self._cut = cut

    async def __aiter__(self) -> AsyncIterator[bytes]:
        relay = self._relay
        try:
            async for chunk in self._exchange.chunks():
                out = relay.chunk(chunk)
                if out:
                    yield out
                if relay.finished:
                    break
        except UpstreamFailure:
            out = relay.fail()
        else:
            out = relay.end()
        if out:
            yield out
        if relay.cut and self._cut is not None:
            raise self._cut()

    async def aclose(self) -> None:
        await self._exchange.aclose()
        self._relay.close()
