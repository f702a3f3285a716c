"""
Attempts straight on httpcore pools
===================================

The client transports' default upstream. An ``httpx.HTTPTransport`` would take
an ``httpx.Request`` (its URL parsed, its headers normalised) and turn it into an
``httpcore.Request``, then wrap httpcore's response in an ``httpx.Response``: for
every attempt meshkit would build a second request and a second response on top
of the client's own (``benchmarks/RESULTS.md``: MeshTransport cost 1.5x a plain
client's CPU). Here an attempt becomes the ``httpcore.Request`` directly: the
worker's scheme/host/port and ``Host`` header are parsed once per origin, the
request target is the tail of the attempt's URL, and the response's raw stream
is relayed. Each client library gets the httpcore it is built on (httpx:
``httpcore``, httpx2: ``httpcore2``) with the limits of ``[upstream]``.

Failures are mapped as in :mod:`meshkit.upstream.inner` (the httpcore
exception names are the same): ``PoolTimeout`` is ``POOL``, a connect timeout or
error ``CONNECT``, another timeout ``TIMEOUT``; closed or reset before any
response byte is tried once more on another connection, then ``CONNECT``; a
request httpcore refuses to send (``LocalProtocolError``) is the client's 400.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt, Failure
from meshkit.errors import InvalidRequest
from meshkit.upstream.drive import UpstreamFailure, aread_upto, read_upto
from meshkit.upstream.inner import timeouts

__all__ = ["CoreUpstream", "core_for"]

#: the httpcore each client library is built on
_CORES = {"httpx": "httpcore", "httpx2": "httpcore2"}
#: parsed attempt URLs kept before the cache is cleared (workers come and go)
MAX_URLS = 4096


def core_for(lib: ModuleType) -> ModuleType | None:
    """The httpcore module under ``lib`` (None for an unknown library)."""
    name = _CORES.get(lib.__name__)
    if name is None:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover
        return None


class _Origin:
    __slots__ = ("host", "host_header", "port", "scheme")

    def __init__(self, origin: str) -> None:
        parts = urlsplit(origin)
        self.scheme = parts.scheme.encode("ascii")
        host = parts.hostname or ""
        self.host = host.encode("idna") if host else b""
        self.port = parts.port
        default = 443 if parts.scheme == "https" else 80
        shown = f"[{host}]" if ":" in host else host
        hh = shown if self.port in (None, default) else f"{shown}:{self.port}"
        self.host_header = hh.encode("idna")


class SyncCoreExchange:
    __slots__ = ("_errors", "_resp", "headers", "status")

    def __init__(
        self, resp: Any, errors: type[BaseException] | tuple[type[BaseException], ...]
    ) -> None:
        self._resp = resp
        self._errors = errors
        self.status: int = resp.status
        self.headers: list[tuple[bytes, bytes]] = resp.headers

    def chunks(self) -> Iterator[bytes]:
        try:
            yield from self._resp.stream
        except self._errors as exc:
            raise UpstreamFailure(Failure.PROTOCOL) from exc

    def read(self, limit: int) -> bytes:
        return read_upto(self.chunks(), limit)

    def close(self) -> None:
        with contextlib.suppress(*_as_tuple(self._errors)):
            self._resp.close()


class AsyncCoreExchange:
    __slots__ = ("_errors", "_resp", "headers", "status")

    def __init__(
        self, resp: Any, errors: type[BaseException] | tuple[type[BaseException], ...]
    ) -> None:
        self._resp = resp
        self._errors = errors
        self.status: int = resp.status
        self.headers: list[tuple[bytes, bytes]] = resp.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.stream:
                yield chunk
        except self._errors as exc:
            raise UpstreamFailure(Failure.PROTOCOL) from exc

    async def read(self, limit: int) -> bytes:
        return await aread_upto(self.chunks(), limit)

    async def aclose(self) -> None:
        with contextlib.suppress(*_as_tuple(self._errors)):
            await self._resp.aclose()


def _as_tuple(
    errors: type[BaseException] | tuple[type[BaseException], ...],
) -> tuple[type[BaseException], ...]:
    return errors if isinstance(errors, tuple) else (errors,)


class CoreUpstream:
    """Sync and async httpcore pools of one library, and attempts sent on them."""

    def __init__(self, core: ModuleType, config: UpstreamConfig) -> None:
        self.core = core
        self.config = config
        self._extensions = {"timeout": timeouts(config)}
        #: attempt URL -> (httpcore URL, Host header); httpcore does not mutate them
        self._urls: dict[str, tuple[Any, bytes]] = {}
        limits = {
            "max_connections": config.pool_limit or None,
            "max_keepalive_connections": config.pool_limit_per_worker or None,
            "keepalive_expiry": config.idle_timeout_s,
        }
        # Built now, not on first use: threads sharing a new client would race.
        self._pool: Any = core.ConnectionPool(**limits)
        self._apool: Any = core.AsyncConnectionPool(**limits)
        c = core
        # Every error the pools raise; each is mapped below.
        self._errors: tuple[type[BaseException], ...] = (
            c.TimeoutException,
            c.NetworkError,
            c.ProtocolError,
            c.ProxyError,
            c.UnsupportedProtocol,
        )
        self._resend = (c.RemoteProtocolError, c.ReadError, c.WriteError)

    # -- requests -------------------------------------------------------------------

    def _request(self, attempt: Attempt) -> Any:
        url = attempt.url
        known = self._urls.get(url)
        if known is None:
            known = self._url(url)
        target, host_header = known
        headers = [(b"host", host_header), *attempt.headers]
        body = attempt.body
        method = attempt.method
        if body or method not in ("GET", "DELETE", "HEAD"):
            headers.append((b"content-length", b"%d" % len(body)))
            content: bytes | None = body
        else:
            content = None
        return self.core.Request(
            method, target, headers=headers, content=content, extensions=self._extensions
        )

    def _url(self, url: str) -> tuple[Any, bytes]:
        """httpcore's URL for an attempt's URL and its ``Host`` (parsed once per URL)."""
        cut = url.find("/", url.find("//") + 2)
        origin, target = (url, "/") if cut < 0 else (url[:cut], url[cut:])
        o = _Origin(origin)
        core_url = self.core.URL(
            scheme=o.scheme, host=o.host, port=o.port, target=target.encode("latin-1")
        )
        if len(self._urls) >= MAX_URLS:
            self._urls.clear()
        known = self._urls[url] = (core_url, o.host_header)
        return known

    def _failure(self, exc: BaseException) -> Failure:
        c = self.core
        if isinstance(exc, c.PoolTimeout):
            return Failure.POOL
        if isinstance(exc, (c.ConnectTimeout, c.ConnectError)):
            return Failure.CONNECT
        if isinstance(exc, c.TimeoutException):
            return Failure.TIMEOUT
        return Failure.CONNECT

    def send_sync(self, attempt: Attempt) -> SyncCoreExchange:
        for again in (False, True):
            try:
                req = self._request(attempt)
                resp = self._pool.handle_request(req)
            except (self.core.LocalProtocolError, UnicodeEncodeError) as exc:
                raise _unsendable() from exc
            except self._resend as exc:
                if again:
                    raise UpstreamFailure(Failure.CONNECT) from exc
                continue
            except self._errors as exc:
                raise UpstreamFailure(self._failure(exc)) from exc
            return SyncCoreExchange(resp, self._errors)
        raise AssertionError("unreachable")  # pragma: no cover

    async def send_async(self, attempt: Attempt) -> AsyncCoreExchange:
        for again in (False, True):
            try:
                req = self._request(attempt)
                resp = await self._apool.handle_async_request(req)
            except (self.core.LocalProtocolError, UnicodeEncodeError) as exc:
                raise _unsendable() from exc
            except self._resend as exc:
                if again:
                    raise UpstreamFailure(Failure.CONNECT) from exc
                continue
            except self._errors as exc:
                raise UpstreamFailure(self._failure(exc)) from exc
            return AsyncCoreExchange(resp, self._errors)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self._pool.close()

    async def aclose(self) -> None:
        await self._apool.aclose()


def _unsendable() -> InvalidRequest:
    return InvalidRequest("the request's headers or query cannot be sent as valid HTTP")
