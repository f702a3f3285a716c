"""
Requests on httpcore pools
==========================

:class:`HttpcoreUpstream` sends what the fast clients cannot: ``https://``, and
every request under an event loop that is not asyncio's (httpcore runs on trio).
Each client library gets the httpcore it is built on (httpx: ``httpcore``,
httpx2: ``httpcore2``; ``httpcore`` by default), imported by the first request.
``pool_limit`` is httpcore's ``max_connections``; it has no per-origin bound, so
``pool_limit_per_worker`` bounds the idle connections it keeps.

A request becomes the ``httpcore.Request`` directly (its URL and ``host`` parsed
once per URL), not an ``httpx.Request`` and back, with the ``[upstream]``
timeouts as its ``timeout`` extension: without it httpcore waits forever.

httpcore cannot tell a reused connection from a new one, so a request closed or
reset before any response byte is always sent once more; nor garbage instead of a
response from a close before any byte (both are ``RemoteProtocolError``).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Failure
from meshkit.http1 import Headers, split_url
from meshkit.upstream.base import (
    AsyncUpstream,
    Request,
    SyncUpstream,
    UpstreamFailure,
    aread_upto,
    check_request,
    content_length,
    error_of,
    errors_of,
    failure,
    read_upto,
    remember,
)

__all__ = ["AsyncStreamExchange", "HttpcoreUpstream", "SyncStreamExchange"]

#: the httpcore each client library is built on
_CORES = {"httpx": "httpcore", "httpx2": "httpcore2"}

Errors = tuple[type[BaseException], ...]


def timeouts(config: UpstreamConfig) -> dict[str, float | None]:
    """The ``timeout`` request extension httpcore reads, from ``[upstream]``."""
    connect = config.connect_timeout_s or None
    read = config.read_timeout_s if config.read_timeout_s > 0 else None
    return {"connect": connect, "pool": connect, "read": read, "write": read}


def _lower(headers: Headers) -> Headers:
    return [(k.lower(), v) for k, v in headers]


class _StreamExchange:
    """A response whose body is a library's byte stream (the one close ends)."""

    __slots__ = ("_errors", "_stream", "headers", "status")

    def __init__(self, status: int, headers: Headers, stream: Any, errors: Errors) -> None:
        self.status = status
        self.headers = headers
        self._stream = stream
        self._errors = errors

    def whole(self) -> bytes | None:
        return None  # the stream does not say whether its body is all here


class SyncStreamExchange(_StreamExchange):
    __slots__ = ()

    def chunks(self) -> Iterator[bytes]:
        try:
            yield from self._stream
        except self._errors as exc:
            raise UpstreamFailure(Failure.PROTOCOL) from exc

    def read(self, limit: int) -> bytes:
        return read_upto(self.chunks(), limit)

    def close(self) -> None:
        # Closing a stream that did not end closes its connection (httpcore
        # reuses only a connection whose response completed).
        with contextlib.suppress(*self._errors):
            self._stream.close()


class AsyncStreamExchange(_StreamExchange):
    __slots__ = ()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield chunk
        except self._errors as exc:
            raise UpstreamFailure(Failure.PROTOCOL) from exc

    async def read(self, limit: int) -> bytes:
        return await aread_upto(self.chunks(), limit)

    async def aclose(self) -> None:
        with contextlib.suppress(*self._errors):
            await self._stream.aclose()


class HttpcoreUpstream(SyncUpstream, AsyncUpstream):
    """Sync and async httpcore pools of one library (``send`` and ``asend``).

    :param lib: the client library (``httpx`` or ``httpx2``) whose httpcore to use.
    """

    def __init__(self, config: UpstreamConfig | None = None, lib: ModuleType | None = None) -> None:
        self.config = config or UpstreamConfig()
        self._name = _CORES.get(lib.__name__, "httpcore") if lib is not None else "httpcore"
        self._extensions = {"timeout": timeouts(self.config)}
        #: request URL -> (httpcore URL, host); httpcore does not mutate them
        self._urls: dict[str, tuple[Any, bytes]] = {}
        self._lock = threading.Lock()
        #: the httpcore module and its pools, made by the first request: no httpcore
        #: is imported until a request needs it
        self.core: Any = None
        self._pool: Any = None
        self._apool: Any = None
        self._errors: Errors = ()

    def _load(self) -> None:
        with self._lock:  # threads sharing a new client would each build pools
            if self._pool is not None:
                return
            core = self.core = importlib.import_module(self._name)
            c = self.config
            limits = {
                "max_connections": c.pool_limit or None,
                "max_keepalive_connections": c.pool_limit_per_worker or None,
                "keepalive_expiry": c.idle_timeout_s,
            }
            self._errors = errors_of(core)
            self._apool = core.AsyncConnectionPool(**limits)
            self._pool = core.ConnectionPool(**limits)

    # -- requests -------------------------------------------------------------------

    def _request(self, request: Request) -> Any:
        """The library's request for ``request``; the 400 when it cannot be sent."""
        check_request(request)
        url = request.url
        known = self._urls.get(url)
        if known is None:
            known = self._url(url)
        target, host = known
        headers = [(b"host", host), *request.headers]
        body = request.body
        size = content_length(request.method, body)
        if size is not None:
            headers.append((b"content-length", b"%d" % size))
        return self.core.Request(
            request.method,
            target,
            headers=headers,
            content=body if size is not None else None,
            extensions=self._extensions,
        )

    def _url(self, url: str) -> tuple[Any, bytes]:
        try:
            scheme, host, port, authority, target = split_url(url)
        except ValueError as exc:
            raise error_of(exc) from None
        core_url = self.core.URL(
            scheme=scheme.encode(), host=host.encode(), port=port, target=target.encode()
        )
        return remember(self._urls, url, (core_url, authority.encode()))

    @staticmethod
    def _head(resp: Any) -> tuple[int, Headers]:
        return resp.status, _lower(resp.headers)

    # -- the contract -----------------------------------------------------------------

    def _prepared(self, request: Request) -> Any:
        if self._pool is None:
            self._load()
        try:
            return self._request(request)
        except self._errors as exc:  # an httpx.InvalidURL, say
            raise error_of(exc) from None

    def send(self, request: Request) -> SyncStreamExchange:
        req = self._prepared(request)
        for fresh in (False, True):
            try:
                resp = self._pool.handle_request(req)
            except self._errors as exc:
                error = failure(exc, fresh=fresh)
                if error is None:
                    continue
                raise error from exc
            return SyncStreamExchange(*self._head(resp), resp.stream, self._errors)
        raise AssertionError("unreachable")  # pragma: no cover

    async def asend(self, request: Request) -> AsyncStreamExchange:
        req = self._prepared(request)
        for fresh in (False, True):
            try:
                resp = await self._apool.handle_async_request(req)
            except self._errors as exc:
                error = failure(exc, fresh=fresh)
                if error is None:
                    continue
                raise error from exc
            return AsyncStreamExchange(*self._head(resp), resp.stream, self._errors)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    async def aclose(self) -> None:
        if self._apool is not None:
            await self._apool.aclose()
