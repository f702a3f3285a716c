"""
Relayed bodies for the front ends that hand out an iterable
===========================================================

The WSGI middleware returns a response iterable and the client transports hand
their library a byte stream; both are these two classes, which drive the core
relay (:class:`~meshkit.core.relay.Relay`) with an upstream exchange's chunks.
Their ``close()`` (which every WSGI server calls, also when the client went
away, and every httpx response calls) settles the books exactly once; one that
is collected unclosed (a middleware around meshkit's raised past the iterable, a
client dropped a streamed response) settles them when it is collected.

A body cut short that has no in-band way to say so (a plain JSON answer) raises
``cut()``'s exception when one is given (the client transports raise their
library's ``RemoteProtocolError``, as a direct connection would); without one the
iterable simply ends, and the server's framing tells the client.

The worker's silence past a read bound raises ``stalled()``'s exception when one
is given (the client transports' ``ReadTimeout``), in every framing: no error
event first, as a direct connection would. Past ``[upstream]``'s bound the books
close as the worker's failure; past the client's own
(:class:`~meshkit.upstream.timeouts.ClientTimeout`), as the client leaving.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from meshkit.core.forward import Failure
from meshkit.core.relay import NoBooks, Relay
from meshkit.upstream.base import AsyncExchange, SyncExchange, UpstreamFailure
from meshkit.upstream.timeouts import ClientTimeout

__all__ = ["NO_BOOKS", "AsyncRelayStream", "SyncRelayStream"]

Cut = Callable[[], BaseException] | None
_TIMEOUT = Failure.TIMEOUT


#: for a request meshkit does not route (``Relay(NO_BOOKS, None)``)
NO_BOOKS = NoBooks()


def _failed(relay: Relay, exc: BaseException, stalled: Cut) -> tuple[bytes, Cut]:
    """What to write and what to raise after the body failed with ``exc``."""
    if isinstance(exc, ClientTimeout):
        if stalled is None:  # only the client transports set a client's bounds
            raise exc
        relay.close()
        return b"", stalled
    assert isinstance(exc, UpstreamFailure)
    if exc.failure is _TIMEOUT and stalled is not None:
        return relay.fail(in_band=False), stalled
    return relay.fail(), None


class SyncRelayStream:
    """A relayed body as an iterable of bytes (see the module docstring)."""

    __slots__ = ("_cut", "_exchange", "_relay", "_stalled")

    def __init__(
        self, exchange: SyncExchange, relay: Relay, cut: Cut = None, stalled: Cut = None
    ) -> None:
        self._exchange = exchange
        self._relay = relay
        self._cut = cut
        self._stalled = stalled

    def __iter__(self) -> Iterator[bytes]:
        relay = self._relay
        error: Cut = None
        try:
            for chunk in self._exchange.chunks():
                out = relay.chunk(chunk)
                if out:
                    yield out
                if relay.finished:
                    break
        except (UpstreamFailure, ClientTimeout) as exc:
            out, error = _failed(relay, exc, self._stalled)
        else:
            out = relay.end()
        if out:
            yield out
        if error is not None:
            raise error()
        if relay.cut and self._cut is not None:
            raise self._cut()

    def close(self) -> None:
        # The books first: an exchange whose close raises must not keep the lease.
        self._relay.close()
        self._exchange.close()

    def __del__(self) -> None:
        # Collected unclosed (a host's middleware raised past the iterable, a
        # client never closed its response): the lease and the connection go back.
        if not self._relay.finished:
            with contextlib.suppress(Exception):
                self.close()


class AsyncRelayStream:
    """:class:`SyncRelayStream` for an async exchange."""

    __slots__ = ("_cut", "_exchange", "_relay", "_stalled")

    def __init__(
        self, exchange: AsyncExchange, relay: Relay, cut: Cut = None, stalled: Cut = None
    ) -> None:
        self._exchange = exchange
        self._relay = relay
        self._cut = cut
        self._stalled = stalled

    async def __aiter__(self) -> AsyncIterator[bytes]:
        relay = self._relay
        error: Cut = None
        try:
            async for chunk in self._exchange.chunks():
                out = relay.chunk(chunk)
                if out:
                    yield out
                if relay.finished:
                    break
        except (UpstreamFailure, ClientTimeout) as exc:
            out, error = _failed(relay, exc, self._stalled)
        else:
            out = relay.end()
        if out:
            yield out
        if error is not None:
            raise error()
        if relay.cut and self._cut is not None:
            raise self._cut()

    async def aclose(self) -> None:
        self._relay.close()
        await self._exchange.aclose()

    def __del__(self) -> None:
        # Collected unclosed: the lease goes back here; the connection on its own
        # loop (``drop``), since a collection may run on any thread.
        if not self._relay.finished:
            with contextlib.suppress(Exception):
                self._relay.close()
                drop = getattr(self._exchange, "drop", None)
                if drop is not None:
                    drop()
