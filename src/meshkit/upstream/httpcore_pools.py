"""
Requests on httpcore pools
==========================

:class:`HttpcoreUpstream` sends what the fast clients cannot: ``https://``, and
every request under an event loop that is not asyncio's (httpcore runs on trio).
Each client library gets the httpcore it is built on (httpx: ``httpcore``,
httpx2: ``httpcore2``; ``httpcore`` by default), imported by the first request.
``pool_limit`` is httpcore's ``max_connections``; it has no per-origin bound, so
``pool_limit_per_worker`` bounds the idle connections it keeps. A worker with TLS
settings of its own (``tls_ca_file``, ``tls_verify``, a client certificate) gets pools
of its setting's SSL context (one pair per distinct setting, made on first use); a
failed handshake is ``Failure.TLS``, the 502 ``upstream_tls_error``.

A request becomes the ``httpcore.Request`` directly (its URL and ``host`` parsed
once per URL), not an ``httpx.Request`` and back, with the ``[upstream]``
timeouts as its ``timeout`` extension (without it httpcore waits forever), or the
request's own (:mod:`~meshkit.upstream.timeouts`), computed with it.

httpcore cannot tell a reused connection from a new one, so a request closed or
reset before any response byte is always sent once more; nor garbage instead of a
response from a close before any byte (both are ``RemoteProtocolError``).
"""

from __future__ import annotations

import contextlib
import importlib
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Failure
from meshkit.core.requests import Timeouts
from meshkit.core.workers import Tls
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
from meshkit.upstream.timeouts import broken, timed_out

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

    __slots__ = ("_bounds", "_errors", "_stream", "headers", "status")

    def __init__(
        self,
        status: int,
        headers: Headers,
        stream: Any,
        errors: Errors,
        bounds: Timeouts | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self._stream = stream
        self._errors = errors
        self._bounds = bounds

    def whole(self) -> bytes | None:
        return None  # the stream does not say whether its body is all here


class SyncStreamExchange(_StreamExchange):
    __slots__ = ()

    def chunks(self) -> Iterator[bytes]:
        try:
            yield from self._stream
        except self._errors as exc:
            raise broken(exc, self._bounds) from exc

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
            raise broken(exc, self._bounds) from exc

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
        #: (sync, async) pools of the workers with TLS settings of their own: one
        #: pair per distinct setting (httpcore takes one SSL context per pool)
        self._tls_pools: dict[Tls, tuple[Any, Any]] = {}

    def _limits(self) -> dict[str, Any]:
        c = self.config
        return {
            "max_connections": c.pool_limit or None,
            "max_keepalive_connections": c.pool_limit_per_worker or None,
            "keepalive_expiry": c.idle_timeout_s,
        }

    def _load(self) -> None:
        with self._lock:  # threads sharing a new client would each build pools
            if self._pool is not None:
                return
            core = self.core = importlib.import_module(self._name)
            limits = self._limits()
            self._errors = errors_of(core)
            self._apool = core.AsyncConnectionPool(**limits)
            self._pool = core.ConnectionPool(**limits)

    def _pools_for(self, tls: Tls) -> tuple[Any, Any]:
        pools = self._tls_pools.get(tls)
        if pools is not None:
            return pools
        with self._lock:
            pools = self._tls_pools.get(tls)
            if pools is None:
                try:
                    ctx = ssl_context(tls)
                except (OSError, ValueError) as exc:  # a missing or unreadable file
                    raise UpstreamFailure(Failure.TLS) from exc
                core, limits = self.core, self._limits()
                pools = (
                    core.ConnectionPool(ssl_context=ctx, **limits),
                    core.AsyncConnectionPool(ssl_context=ctx, **limits),
                )
                self._tls_pools[tls] = pools
        return pools

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
        bounds = request.timeout
        return self.core.Request(
            request.method,
            target,
            headers=headers,
            content=body if size is not None else None,
            extensions=self._extensions if bounds is None else bounds.extensions,
        )

    def _url(self, url: str) -> tuple[Any, bytes]:
        try:
            scheme, host, port, authority, target = split_url(url)
        except ValueError as exc:
            raise error_of(exc) from None
        core_url = self.core.URL(
            scheme=scheme.encode(), host=host.encode(), port=port, target=target.encode()
        )
        return remember(
            self._urls, url, (core_url, authority.encode()), self.config.max_cached_urls
        )

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
        tls = getattr(request, "tls", None)
        pool = self._pool if tls is None else self._pools_for(tls)[0]
        bounds = request.timeout
        for fresh in (False, True):
            try:
                resp = pool.handle_request(req)
            except self._errors as exc:
                error = _error(exc, fresh, bounds)
                if error is None:
                    continue
                raise error from exc
            return SyncStreamExchange(*self._head(resp), resp.stream, self._errors, bounds)
        raise AssertionError("unreachable")  # pragma: no cover

    async def asend(self, request: Request) -> AsyncStreamExchange:
        req = self._prepared(request)
        tls = getattr(request, "tls", None)
        pool = self._apool if tls is None else self._pools_for(tls)[1]
        bounds = request.timeout
        for fresh in (False, True):
            try:
                resp = await pool.handle_async_request(req)
            except self._errors as exc:
                error = _error(exc, fresh, bounds)
                if error is None:
                    continue
                raise error from exc
            return AsyncStreamExchange(*self._head(resp), resp.stream, self._errors, bounds)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        for pool, _ in self._tls_pools.values():
            pool.close()

    async def aclose(self) -> None:
        if self._apool is not None:
            await self._apool.aclose()
        for _, apool in self._tls_pools.values():
            await apool.aclose()


def _error(exc: BaseException, fresh: bool, bounds: Timeouts | None) -> Exception | None:
    if bounds is not None:
        own = timed_out(exc, bounds)
        if own is not None:
            return own
    return failure(exc, fresh=fresh)


def ssl_context(tls: Tls) -> ssl.SSLContext:
    """The client context of a worker's TLS settings."""
    ctx = ssl.create_default_context(cafile=tls.ca_file)
    if not tls.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.client_cert:
        ctx.load_cert_chain(tls.client_cert, tls.client_key)
    return ctx
