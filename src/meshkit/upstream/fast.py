"""
A fast upstream relay on raw asyncio protocols
==============================================

:class:`FastUpstream` is an :class:`~meshkit.upstream.aio.AsyncUpstream`
built for the relay's hot path (``benchmarks/RESULTS.notes.md``: aiohttp's client
was ~37 % of a 1 KiB proxy's samples)::

    MeshMiddleware(app, mesh=mesh, upstream=FastUpstream(mesh.config.upstream))

* one pool of keep-alive connections per origin, bounded by
  ``upstream.pool_limit_per_worker`` per origin and ``upstream.pool_limit`` in all
  (0 = unbounded, as aiohttp); a request over a limit waits for a free connection
  at most ``connect_timeout_s``, then fails with ``Failure.POOL`` (503
  ``overloaded``; the worker is not blamed). Idle
  connections expire after ``idle_timeout_s`` (checked when one is taken, and by
  one sweep timer; the pool is a stack, the most recently used first, so the
  stale ones sink and expire together);
* the request head is one ``bytes`` (request line and ``host`` cached per URL,
  the headers joined in C), written with the body by one ``writelines``;
  a header name or value holding CR or LF is refused (``Failure.PROTOCOL``):
  nothing can inject a line;
* responses are parsed by ``httptools`` callbacks on the protocol itself: no task
  and no queue per request, body chunks go to a deque with one waiter future;
  ``Content-Length``, chunked and read-until-close bodies; interim 1xx skipped;
* ``read_timeout_s`` bounds the worker's silence while a response head or a body
  chunk is awaited (``Failure.TIMEOUT`` before the head, ``Failure.PROTOCOL``
  from ``chunks()`` after it) with one timer per connection, re-armed lazily;
* a *reused* connection that ends before any response byte (the worker closed an
  idle keep-alive, as SGLang does after 5 s) is retried once, transparently, on a
  new connection; a new connection that does the same is ``Failure.CONNECT``, so
  the forward flow moves the request to another worker;
* ``aclose()`` on an exchange whose body did not end closes its connection (the
  worker sees the client leave); a connection returns to its pool only when its
  response ended, keep-alive allowed.

``https://`` workers are delegated to the ``fallback`` given, else to a lazily
created :class:`~meshkit.upstream.aio.AiohttpUpstream`. The pools belong to the
event loop of the first ``send``; a ``send`` from another loop starts new pools
(the old loop's connections are dropped, not closed: that loop owns them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from urllib.parse import quote, urlsplit

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt, Failure
from meshkit.upstream.aio import AiohttpUpstream
from meshkit.upstream.drive import AsyncExchange, UpstreamFailure
from meshkit.upstream.fast_conn import HEAD_OK, HEAD_RESET, HEAD_TIMEOUT, Conn, Exchange
from meshkit.upstream.fast_pool import Hub, Pool

__all__ = ["FastUpstream", "build_head", "http_origin"]

#: cached request lines (per URL) before the cache is cleared
MAX_ROUTES = 4096

_METHODS = {m: m.encode() for m in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")}
_NO_BODY = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# RFC 9110 token characters (a method); anything else is refused.
_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
# Kept as is in a path + query; everything else (controls, space, non-ASCII) is
# percent-encoded.
_PATH_SAFE = "/?#[]@!$&'()*+,;=:%-._~"


def build_head(method: str, line: bytes, headers: list[tuple[bytes, bytes]], size: int) -> bytes:
    """``METHOD SP line`` + headers + ``content-length`` + CRLF; ``line`` is
    ``b" /path HTTP/1.1\\r\\nhost: h:p\\r\\n"``. Raises ``UpstreamFailure(PROTOCOL)``
    when a header name or value holds CR or LF (it would inject a line)."""
    m = _METHODS.get(method)
    if m is None:
        m = method.encode("latin-1")
        if not m or not set(m) <= _TCHAR:
            raise UpstreamFailure(Failure.PROTOCOL)
    bare = not size and method in _NO_BODY  # no content-length, as aiohttp
    if not headers:
        if bare:
            return b"%s%s\r\n" % (m, line)
        return b"%s%scontent-length: %d\r\n\r\n" % (m, line, size)
    block = b"\r\n".join(map(b": ".join, headers))
    # The joints put exactly len(headers) - 1 of each; any other is in a header.
    joints = len(headers) - 1
    if block.count(b"\n") != joints or block.count(b"\r") != joints:
        raise UpstreamFailure(Failure.PROTOCOL)
    if bare:
        return b"%s%s%s\r\n\r\n" % (m, line, block)
    return b"%s%s%s\r\ncontent-length: %d\r\n\r\n" % (m, line, block, size)


def http_origin(url: str) -> tuple[str, str, int, bytes] | None:
    """``(origin key, host, port, request line)`` of an ``http://`` attempt URL,
    None for ``https://``; the line is ``b" /path?query HTTP/1.1\\r\\nhost: h:p\\r\\n"``
    (the target percent-encoded where it must be). Another scheme, or no host,
    is ``Failure.CONNECT``."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return None
    host = parts.hostname
    if parts.scheme != "http" or not host:
        raise UpstreamFailure(Failure.CONNECT)
    try:
        port = parts.port or 80
    except ValueError:
        raise UpstreamFailure(Failure.CONNECT) from None
    netloc = f"[{host}]" if ":" in host else host
    if port != 80:
        netloc = f"{netloc}:{port}"
    key = f"http://{netloc}"
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    if not target.isascii() or not target.isprintable() or " " in target:
        target = quote(target, safe=_PATH_SAFE)
    if not netloc.isascii():
        netloc = netloc.replace(host, host.encode("idna").decode("ascii"))
    line = b" %s HTTP/1.1\r\nhost: %s\r\n" % (target.encode(), netloc.encode())
    return key, host, port, line


class FastUpstream:
    """Pooled keep-alive HTTP/1.1 client on asyncio protocols (see the module doc)."""

    __slots__ = ("_fallback", "_hub", "_routes", "_send_https", "config")

    def __init__(
        self,
        config: UpstreamConfig | None = None,
        fallback: Callable[[Attempt], Awaitable[AsyncExchange]] | None = None,
    ) -> None:
        self.config = config or UpstreamConfig()
        self._hub: Hub | None = None
        #: attempt URL -> (its origin's pool, or None for https; the request line)
        self._routes: dict[str, tuple[Pool | None, bytes]] = {}
        self._fallback: AiohttpUpstream | None = None
        self._send_https = fallback

    # -- the hot path ----------------------------------------------------------

    async def send(self, attempt: Attempt) -> AsyncExchange:
        loop = asyncio.get_running_loop()
        hub = self._hub
        if hub is None or hub.loop is not loop:
            hub = self._bind(loop)
        url = attempt.url
        route = self._routes.get(url)
        if route is None:
            route = self._route(url, hub)
        pool, line = route
        if pool is None:
            if self._send_https is not None:
                return await self._send_https(attempt)
            return await self._https().send(attempt)
        method = attempt.method
        body = attempt.body
        head = build_head(method, line, attempt.headers, len(body))
        head_only = method == "HEAD"
        conn = pool.take()
        reused = conn is not None
        if conn is None:
            conn = await self._acquire(pool, loop, fresh=False)
        while True:
            fut: asyncio.Future[int] = loop.create_future()
            ex = Exchange(conn, fut)
            conn.send(ex, head, body, head_only)
            try:
                code = await fut
            except BaseException:
                # Cancelled (the client left) while the worker may be working.
                ex.abandon()
                raise
            if code == HEAD_OK:
                return ex
            if code == HEAD_RESET and reused:
                # A pooled connection the worker had closed: once more, on a new one.
                reused = False
                conn = await self._acquire(pool, loop, fresh=True)
                continue
            if code == HEAD_RESET:
                raise UpstreamFailure(Failure.CONNECT)
            if code == HEAD_TIMEOUT:
                raise UpstreamFailure(Failure.TIMEOUT)
            raise UpstreamFailure(Failure.PROTOCOL)

    async def aclose(self) -> None:
        """Close every connection (pooled or busy) and the https fallback."""
        hub, self._hub = self._hub, None
        self._routes.clear()
        if hub is not None:
            hub.close()
        fallback, self._fallback = self._fallback, None
        if fallback is not None:
            await fallback.aclose()

    # -- slow paths ------------------------------------------------------------

    def _bind(self, loop: asyncio.AbstractEventLoop) -> Hub:
        c = self.config
        self._routes.clear()
        hub = self._hub = Hub(
            loop,
            limit=c.pool_limit,
            per_limit=c.pool_limit_per_worker,
            idle_timeout=c.idle_timeout_s,
            read_timeout=c.read_timeout_s,
        )
        return hub

    def _route(self, url: str, hub: Hub) -> tuple[Pool | None, bytes]:
        origin = http_origin(url)
        if origin is None:
            route: tuple[Pool | None, bytes] = (None, b"")
        else:
            key, host, port, line = origin
            pool = hub.pools.get(key)
            if pool is None:
                pool = hub.pools[key] = Pool(hub, host, port)
            route = (pool, line)
        if len(self._routes) >= MAX_ROUTES:
            self._routes.clear()
        self._routes[url] = route
        return route

    def _https(self) -> AiohttpUpstream:
        fallback = self._fallback
        if fallback is None:
            fallback = self._fallback = AiohttpUpstream(self.config)
        return fallback

    async def _acquire(self, pool: Pool, loop: asyncio.AbstractEventLoop, *, fresh: bool) -> Conn:
        """A connection of ``pool``: idle (unless ``fresh``), new, or after a wait."""
        hub = pool.hub
        timeout = self.config.connect_timeout_s
        deadline = loop.time() + timeout if timeout > 0 else None
        while True:
            if not fresh:
                conn = pool.take()
                if conn is not None:
                    return conn
            if hub.closed:
                raise UpstreamFailure(Failure.CONNECT)
            per, limit = hub.per_limit, hub.limit
            if fresh and per and pool.count >= per and pool.idle:
                pool.idle[0].close()  # make room for the new connection
            if not per or pool.count < per:
                if not limit or hub.total < limit or hub.evict_idle():
                    return await self._connect(pool, loop, deadline)
                queue = hub.waiters
            else:
                queue = pool.waiters
            waiter: asyncio.Future[bool] = loop.create_future()
            queue.append(waiter)
            timer = None
            if deadline is not None:
                timer = loop.call_later(max(0.0, deadline - loop.time()), _expire, waiter)
            try:
                woken = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.result():
                    hub.wake(pool)  # pass the wake-up on
                else:
                    _discard(queue, waiter)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            if not woken:
                # Nothing was sent: the worker is busy, not failing (503 overloaded).
                _discard(queue, waiter)
                raise UpstreamFailure(Failure.POOL)

    async def _connect(
        self, pool: Pool, loop: asyncio.AbstractEventLoop, deadline: float | None
    ) -> Conn:
        hub = pool.hub
        pool.count += 1
        hub.total += 1
        conn = Conn(pool)
        try:
            if deadline is None:
                await loop.create_connection(lambda: conn, pool.host, pool.port)
            else:
                async with asyncio.timeout_at(deadline):
                    await loop.create_connection(lambda: conn, pool.host, pool.port)
        except BaseException as exc:
            if not conn.closed:
                conn.closed = True
                pool.count -= 1
                hub.total -= 1
                hub.wake(pool)
            if conn.transport is not None:
                conn.transport.abort()
            if isinstance(exc, OSError | TimeoutError):
                raise UpstreamFailure(Failure.CONNECT) from exc
            raise
        if conn.closed:  # lost already (the worker closed it at once)
            raise UpstreamFailure(Failure.CONNECT)
        pool.conns.add(conn)
        return conn


def _discard(queue: deque[asyncio.Future[bool]], waiter: asyncio.Future[bool]) -> None:
    with contextlib.suppress(ValueError):
        queue.remove(waiter)


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
