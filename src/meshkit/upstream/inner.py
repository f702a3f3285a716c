"""
httpx-family upstreams
======================

Attempts sent through an httpx or httpx2 transport (the two libraries share the
transport contract: ``handle_request`` / ``handle_async_request``). Used by the
client transports, which delegate to an inner transport of the client's own
library, and by the WSGI middleware (a pooled ``httpx.HTTPTransport``).

Transport errors are mapped once, here, to the flow's :class:`Failure` kinds:
a connection that could not be made, or that closed before a response head, is
``CONNECT`` (safe to move to another worker); a timeout waiting for the head is
``TIMEOUT``; no pooled connection free within the ``pool`` timeout
(``PoolTimeout``) is ``POOL``: nothing was sent, the worker is busy rather than
failing (503 ``overloaded``, no breaker failure).

A connection closed or reset before any response byte is tried once more at
once (a pooled connection the worker had just closed); then it is ``CONNECT``.

A request the inner transport refuses to *send* (``LocalProtocolError``: a client
header value with surrounding whitespace or a control character, say) is the
client's fault, not the worker's: it is a 400 ``invalid_request``, the worker is
not blamed and no other worker is tried.

Every attempt carries the ``[upstream]`` timeouts as the request's ``timeout``
extension (connect and pool: ``connect_timeout_s``; read and write:
``read_timeout_s``): without it httpcore waits forever, and a stalled worker
would hang the request instead of answering 504 ``upstream_timeout``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt, Failure
from meshkit.errors import InvalidRequest
from meshkit.upstream.drive import UpstreamFailure, aread_upto, read_upto

__all__ = [
    "AsyncHttpxExchange",
    "SyncHttpxExchange",
    "failure_of",
    "send_async",
    "send_sync",
    "timeouts",
]

_DEFAULT = UpstreamConfig()


def timeouts(config: UpstreamConfig | None) -> dict[str, float]:
    """The ``timeout`` request extension httpcore reads, from ``[upstream]``."""
    c = config or _DEFAULT
    return {
        "connect": c.connect_timeout_s,
        "pool": c.connect_timeout_s,
        "read": c.read_timeout_s,
        "write": c.read_timeout_s,
    }


def failure_of(lib: ModuleType, exc: BaseException) -> Failure | None:
    """The flow's failure kind for an httpx/httpx2 transport error (None: not one)."""
    if isinstance(exc, lib.PoolTimeout):
        return Failure.POOL
    if isinstance(exc, lib.ConnectTimeout):
        return Failure.CONNECT
    if isinstance(exc, lib.TimeoutException):
        return Failure.TIMEOUT
    if isinstance(exc, lib.TransportError):
        return Failure.CONNECT
    return None


def _request(lib: ModuleType, attempt: Attempt, config: UpstreamConfig | None) -> Any:
    return lib.Request(
        attempt.method,
        attempt.url,
        headers=attempt.headers,
        content=attempt.body if attempt.body or attempt.method not in ("GET", "DELETE") else None,
        extensions={"timeout": timeouts(config)},
    )


class SyncHttpxExchange:
    __slots__ = ("_lib", "_resp", "headers", "status")

    def __init__(self, lib: ModuleType, resp: Any) -> None:
        self._lib = lib
        self._resp = resp
        self.status: int = resp.status_code
        self.headers: list[tuple[bytes, bytes]] = list(resp.headers.raw)

    def chunks(self) -> Iterator[bytes]:
        try:
            yield from self._resp.stream
        except self._lib.HTTPError as exc:
            raise UpstreamFailure(Failure.PROTOCOL) from exc

    def read(self, limit: int) -> bytes:
        return read_upto(self.chunks(), limit)

    def close(self) -> None:
        with contextlib.suppress(self._lib.HTTPError):
            self._resp.close()


class AsyncHttpxExchange:
    __slots__ = ("_lib", "_resp", "headers", "status")

    def __init__(self, lib: ModuleType, resp: Any) -> None:
        self._lib = lib
        self._resp = resp
        self.status: int = resp.status_code
        self.headers: list[tuple[bytes, bytes]] = list(resp.headers.raw)

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.stream:
                yield chunk
        except self._lib.HTTPError as exc:
            raise UpstreamFailure(Failure.PROTOCOL) from exc

    async def read(self, limit: int) -> bytes:
        return await aread_upto(self.chunks(), limit)

    async def aclose(self) -> None:
        with contextlib.suppress(self._lib.HTTPError):
            await self._resp.aclose()


def _unsendable(exc: BaseException) -> InvalidRequest:
    return InvalidRequest("the request's headers or query cannot be sent as valid HTTP")


def _resend_errors(lib: ModuleType) -> tuple[type[BaseException], ...]:
    """Closed or reset before any response byte: most often a pooled connection
    the worker had just closed (PROTOCOLS.md §7); sent once more, on another
    connection, before the flow blames the worker."""
    return (lib.RemoteProtocolError, lib.ReadError, lib.WriteError)


def send_sync(
    lib: ModuleType, transport: Any, attempt: Attempt, config: UpstreamConfig | None = None
) -> SyncHttpxExchange:
    """Send ``attempt`` with ``[upstream]`` timeouts (defaults when ``config`` is None)."""
    for again in (False, True):
        try:
            resp = transport.handle_request(_request(lib, attempt, config))
        except (lib.LocalProtocolError, lib.InvalidURL) as exc:
            raise _unsendable(exc) from None
        except _resend_errors(lib) as exc:
            if again:
                raise UpstreamFailure(Failure.CONNECT) from exc
            continue
        except lib.TransportError as exc:
            raise UpstreamFailure(failure_of(lib, exc) or Failure.CONNECT) from exc
        return SyncHttpxExchange(lib, resp)
    raise AssertionError("unreachable")  # pragma: no cover


async def send_async(
    lib: ModuleType, transport: Any, attempt: Attempt, config: UpstreamConfig | None = None
) -> AsyncHttpxExchange:
    """Send ``attempt`` with ``[upstream]`` timeouts (defaults when ``config`` is None)."""
    for again in (False, True):
        try:
            resp = await transport.handle_async_request(_request(lib, attempt, config))
        except (lib.LocalProtocolError, lib.InvalidURL) as exc:
            raise _unsendable(exc) from None
        except _resend_errors(lib) as exc:
            if again:
                raise UpstreamFailure(Failure.CONNECT) from exc
            continue
        except lib.TransportError as exc:
            raise UpstreamFailure(failure_of(lib, exc) or Failure.CONNECT) from exc
        return AsyncHttpxExchange(lib, resp)
    raise AssertionError("unreachable")  # pragma: no cover
