"""
The asyncio client
==================

:class:`FastUpstream` sends ``http://`` requests on raw asyncio protocols, the
relay's hot path: a few µs of CPU per request, where aiohttp's client was ~37 % of
a 1 KiB proxy's samples (``benchmarks/RESULTS.notes.md``). What it cannot send
(``https://``; any request under a loop that is not asyncio's, e.g. trio, where
``asyncio.get_running_loop()`` raises) goes to its ``fallback``.

* one pool of keep-alive connections per origin, bounded by
  ``upstream.pool_limit_per_worker`` per origin and ``pool_limit`` in all (0 =
  unbounded); a request over a limit waits at most ``connect_timeout_s``, then
  fails with ``Failure.POOL``. Idle connections are a stack (the coldest sink and
  expire together after ``idle_timeout_s``: checked when taken, and by one sweep
  timer per hub);
* the head is one ``bytes`` (:func:`~meshkit.http1.build_head`, the request line
  cached per URL), written with the body by one ``writelines``; the response is
  parsed by :class:`~meshkit.http1.ResponseParser` into the protocol itself: no
  task or queue per request, the body a deque with one waiter; reading pauses
  above ``upstream.read_buffer_bytes`` unread bytes and resumes below a quarter
  of it (the most one response holds while its client reads slowly);
* ``read_timeout_s`` bounds the worker's silence with one timer per connection,
  re-armed lazily from the last byte: none per chunk, none per request. A request
  with the client's own read bound (:mod:`~meshkit.upstream.timeouts`) sets it on
  its connection, until the connection returns to its pool; the connect bound is
  the client's too (a write is buffered, never waited for: the silence that
  follows is the read bound's);
* a connection is pooled again only when its response ended with keep-alive;
  ``aclose()`` before the end closes it (the worker sees the client leave).

The pools belong to the loop of the first ``asend``; one from another loop starts
new pools (the old loop's connections are dropped, not closed: that loop owns them).

``uds``: every connection goes to that Unix socket, whatever the URL's host (which
still names the ``host`` header), as httpx's ``AsyncHTTPTransport(uds=...)`` does;
``serve --processes`` asks its siblings so (:mod:`meshkit.server.peers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from typing import Any, Final, cast

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt, Failure
from meshkit.core.requests import Timeouts
from meshkit.http1 import (
    PARSE_ERRORS,
    Headers,
    ResponseParser,
    Unsendable,
    build_head,
    ends_with_connection,
)
from meshkit.inline import Inline, at_once, in_task, stepping
from meshkit.upstream.base import (
    HEAD_OK,
    HEAD_PROTOCOL,
    HEAD_RESET,
    HEAD_TIMEOUT,
    AsyncExchange,
    AsyncUpstream,
    Request,
    UpstreamFailure,
    aread_upto,
    failure,
    http_origin_of,
    remember,
    unsendable,
)
from meshkit.upstream.timeouts import ClientTimeout, connect_bound, silent

__all__ = ["FastUpstream"]

_NO_HEADERS: Final[Headers] = []
# Exchange._stalled: why a body failed for the worker's silence
_OPERATOR: Final = 1
_CLIENT: Final = 2


def _fields(request: Request) -> tuple[str, str, Headers, bytes, Timeouts | None]:
    """``request``'s method, URL, headers, body and timeouts. The flow's requests
    are :class:`Attempt` objects, whose fields a compiled build reads directly;
    through the :class:`Request` protocol each read is an attribute lookup."""
    if isinstance(request, Attempt):
        return request.method, request.url, request.headers, request.body, request.timeout
    return request.method, request.url, request.headers, request.body, request.timeout


class FastUpstream(AsyncUpstream):
    """Pooled keep-alive HTTP/1.1 client on asyncio protocols (see the module doc)."""

    __slots__ = ("_fallback", "_hub", "_pinned", "_routes", "config", "uds")

    def __init__(
        self,
        config: UpstreamConfig | None = None,
        fallback: AsyncUpstream | None = None,
        *,
        uds: str | None = None,
    ) -> None:
        self.config = config or UpstreamConfig()
        self.uds = uds
        self._hub: Hub | None = None
        #: request URL -> (its origin's pool, or None for https; the request line)
        self._routes: dict[str, tuple[Pool | None, bytes]] = {}
        self._fallback = fallback
        self._pinned: asyncio.AbstractEventLoop | None = None

    def pin(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every later request comes from ``loop``: the built-in server pins the
        upstream it owns to its loop. :meth:`asend` then does not ask which loop
        runs, which on Python 3.11 is a ``getpid`` system call per request
        (``asyncio.get_running_loop`` checks the process after a fork)."""
        self._pinned = loop

    # -- the hot path ----------------------------------------------------------

    async def asend(self, request: Request) -> AsyncExchange:
        loop = self._pinned
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # another async library's loop
                return await self._other(request)
        hub = self._hub
        if hub is None or hub.loop is not loop:
            hub = self._bind(loop)
        method, url, headers, body, bounds = _fields(request)
        route = self._routes.get(url)
        if route is None:
            route = self._route(url, hub)
        pool, line = route
        if pool is None:
            return await self._other(request)
        try:
            head = build_head(method, line, headers, len(body))
        except Unsendable:
            raise unsendable() from None
        head_only = method == "HEAD"
        conn = pool.take()
        reused = conn is not None
        if conn is None:
            conn = await self._acquire(pool, loop, bounds, fresh=False)
        while True:
            # Stepped inline (meshkit.inline): resumed where the head arrives, no
            # future; in a Task: a future.
            runner = stepping(loop)
            waits: Inline | asyncio.Future[int] = (
                runner if runner is not None else loop.create_future()
            )
            ex = Exchange(conn, waits)
            if bounds is not None and bounds.read is not None:
                conn.bound(bounds.read)
            conn.send(ex, head, body, head_only)
            try:
                code: int = await waits
            except BaseException:
                # Cancelled (the client left) while the worker may be working.
                ex.abandon()
                raise
            if code == HEAD_OK:
                return ex
            if code == HEAD_TIMEOUT and bounds is not None and bounds.read is not None:
                raise ClientTimeout("read")
            error = failure(code, fresh=not reused)
            if error is not None:
                raise error
            reused = False
            conn = await self._acquire(pool, loop, bounds, fresh=True)

    async def aclose(self) -> None:
        """Close every connection (pooled or busy) and the fallback."""
        hub, self._hub = self._hub, None
        self._pinned = None
        self._routes.clear()
        if hub is not None:
            hub.close()
        if self._fallback is not None:
            await self._fallback.aclose()

    # -- slow paths ------------------------------------------------------------

    async def _other(self, request: Request) -> AsyncExchange:
        if self._fallback is None:
            raise UpstreamFailure(Failure.CONNECT)
        await in_task()  # httpcore's pools run on anyio
        return await self._fallback.asend(request)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> Hub:
        c = self.config
        self._routes.clear()
        hub = self._hub = Hub(
            loop,
            limit=c.pool_limit,
            per_limit=c.pool_limit_per_worker,
            idle_timeout=c.idle_timeout_s,
            read_timeout=c.read_timeout_s,
            high_water=c.read_buffer_bytes,
        )
        return hub

    def _route(self, url: str, hub: Hub) -> tuple[Pool | None, bytes]:
        origin = http_origin_of(url)
        if origin is None:
            route: tuple[Pool | None, bytes] = (None, b"")
        else:
            key, host, port, line = origin
            pool = hub.pools.get(key)
            if pool is None:
                pool = hub.pools[key] = Pool(hub, host, port)
            route = (pool, line)
        return remember(self._routes, url, route, self.config.max_cached_urls)

    async def _acquire(
        self, pool: Pool, loop: asyncio.AbstractEventLoop, bounds: Timeouts | None, *, fresh: bool
    ) -> Conn:
        """A connection of ``pool``: idle (unless ``fresh``), new, or after a wait."""
        hub = pool.hub
        timeout, mine = connect_bound(self.config, bounds)
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
                    return await self._connect(pool, loop, deadline, own=mine)
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
        self, pool: Pool, loop: asyncio.AbstractEventLoop, deadline: float | None, *, own: bool
    ) -> Conn:
        hub = pool.hub
        pool.count += 1
        hub.total += 1
        conn = Conn(pool)
        try:
            async with asyncio.timeout_at(deadline):
                if self.uds is None:
                    await loop.create_connection(lambda: conn, pool.host, pool.port)
                else:
                    await loop.create_unix_connection(lambda: conn, self.uds)
        except BaseException as exc:
            if not conn.closed:
                conn.closed = True
                pool.count -= 1
                hub.total -= 1
                hub.wake(pool)
            if conn.transport is not None:
                conn.transport.abort()
            if own and isinstance(exc, TimeoutError):
                raise ClientTimeout("connect") from exc
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


def _refuse(waiters: deque[asyncio.Future[bool]]) -> None:
    """Wake every waiter with no connection for it (the upstream is closing)."""
    while waiters:
        _expire(waiters.popleft())


def _broken(stalled: int) -> Exception:
    return silent(stalled == _CLIENT) if stalled else UpstreamFailure(Failure.PROTOCOL)


# -- exchanges and connections ------------------------------------------------------------


class Exchange:
    """One response (an :class:`~meshkit.upstream.base.AsyncExchange`): status,
    headers and the body as a deque of chunks plus one waiter future."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_failed",
        "_head",
        "_stalled",
        "_waiter",
        "headers",
        "status",
    )

    status: int
    headers: Headers

    def __init__(self, conn: Conn, head: Inline | asyncio.Future[int]) -> None:
        self.status = 0
        self.headers = _NO_HEADERS
        self._conn: Conn | None = conn  # None once the body ended (or failed)
        #: what waits for the head (None once it arrived)
        self._head: Inline | asyncio.Future[int] | None = head
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._failed = False
        self._stalled = 0  # _OPERATOR or _CLIENT: the body failed for a silence
        #: what waits for body bytes (None: nobody)
        self._waiter: Inline | asyncio.Future[None] | None = None

    def chunks(self) -> Exchange:
        return self

    def whole(self) -> bytes | None:
        if not self._done:
            return None
        q = self._chunks
        data = q.popleft() if len(q) == 1 else b"".join(q)
        q.clear()
        self._buffered = 0
        return data

    def __aiter__(self) -> Exchange:
        return self

    async def __anext__(self) -> bytes:
        # A class, not an async generator: no asyncgen hooks, nothing to finalise
        # when the consumer stops early.
        q = self._chunks
        while True:
            if q:
                if len(q) == 1:
                    data = q.popleft()
                    self._buffered -= len(data)
                else:
                    data = b"".join(q)
                    q.clear()
                    self._buffered = 0
                conn = self._conn
                if conn is not None and conn.paused and self._buffered < conn.low_water:
                    conn.resume()
                return data
            if self._done:
                raise StopAsyncIteration
            conn = self._conn
            if self._failed or conn is None:
                raise _broken(self._stalled)
            runner = stepping(conn.loop)
            waiter: Inline | asyncio.Future[None] = (
                runner if runner is not None else conn.loop.create_future()
            )
            self._waiter = waiter
            await waiter

    async def read(self, limit: int) -> bytes:
        return await aread_upto(self, limit)

    async def aclose(self) -> None:
        self.abandon()
        self._chunks.clear()
        self._buffered = 0

    def drop(self) -> None:
        """:meth:`abandon` from any thread, on the connection's loop (a relayed
        body collected unclosed: the garbage collector may run anywhere)."""
        conn = self._conn
        if conn is not None and not conn.loop.is_closed():
            conn.loop.call_soon_threadsafe(self.abandon)

    def abandon(self) -> None:
        """Close the connection unless the response already ended (then it is
        pooled again, possibly serving another request: not ours to touch)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            # The body did not end: the worker is still writing. Closing the
            # connection is how it learns the client left (generation stops).
            self._failed = True
            conn.abandon()

    def _wake(self, conn: Conn | None) -> None:
        """Resume the body's reader; ``conn``: the connection whose bytes are being
        parsed (the reader runs when that parse is done), None: on the loop."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            _resume(waiter, None, conn)

    def _answer(self, code: int, conn: Conn | None) -> None:
        """The head's outcome (``HEAD_OK`` or why not); ``conn`` as in :meth:`_wake`."""
        head = self._head
        if head is not None:
            self._head = None
            _resume(head, code, conn)


def _resume(waiter: Inline | asyncio.Future[Any], value: Any, conn: Conn | None) -> None:
    if not isinstance(waiter, Inline):
        if not waiter.done():  # a Task waits: the future's callback wakes it
            waiter.set_result(value)
        return
    waiter.give(value)
    if conn is not None and conn._feeding and at_once():
        conn._woken = waiter  # stepped when the parse is done
    else:
        waiter.wake()


class Conn(asyncio.Protocol):
    """One keep-alive connection to a worker, and the sink of its response parser;
    serves one request at a time."""

    __slots__ = (
        "_ex",
        "_feed",
        "_feeding",
        "_high_water",
        "_last_io",
        "_on_timer",
        "_parser",
        "_pool",
        "_replied",
        "_time",
        "_timeout",
        "_timer",
        "_woken",
        "closed",
        "idle_since",
        "loop",
        "low_water",
        "own",
        "paused",
        "pooled",
        "transport",
    )

    def __init__(self, pool: Pool) -> None:
        hub = pool.hub
        self._pool = pool
        self.loop = hub.loop
        self._time = hub.time
        self._timeout = hub.read_timeout
        self._high_water = hub.high_water
        self.low_water = hub.high_water // 4
        self._parser = ResponseParser(self)
        self._feed = self._parser.feed
        self._on_timer = self._fire  # bound once
        self.transport: asyncio.Transport | None = None
        self._ex: Exchange | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_io = 0.0
        self._replied = False  # a byte of the current response arrived
        # while data_received parses: the request to step once it is done
        self._feeding = False
        self._woken: Inline | None = None
        self.closed = False
        self.paused = False
        self.pooled = False
        self.own = False  # _timeout is a client's own read bound
        self.idle_since = 0.0

    # -- the request ---------------------------------------------------------------

    def send(self, ex: Exchange, head: bytes, body: bytes, head_only: bool) -> None:
        transport = self.transport
        assert transport is not None
        self._ex = ex
        self._replied = False
        parser = self._parser
        parser.waiting = True
        parser.head_only = head_only
        if self._timeout > 0:
            self._last_io = self._time()
            if self._timer is None:
                # Left armed across the requests of a keep-alive connection: it
                # re-arms from _last_io when it fires, and drops when idle.
                self._timer = self.loop.call_later(self._timeout, self._on_timer)
        if body:
            transport.writelines((head, body))
        else:
            transport.write(head)

    def bound(self, read: float) -> None:
        """The next exchange's read bound is the client's own, until the connection
        is pooled again; a timer armed for later than it allows is armed anew."""
        self._timeout = read
        self.own = True
        timer = self._timer
        if timer is not None and timer.when() > self._time() + read:
            self._timer = None
            timer.cancel()

    def abandon(self) -> None:
        """The exchange was given up before its end (client gone, send cancelled)."""
        self._ex = None
        self._close(abort=True)

    def close(self) -> None:
        self._close(abort=False)

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def _close(self, *, abort: bool) -> None:
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()
        if self.closed:
            return
        self.closed = True
        self._pool.forget(self)
        transport = self.transport
        if transport is not None:
            if abort:
                transport.abort()
            else:
                transport.close()

    def _fail(self, code: int) -> None:
        """The current response cannot go on: report ``code`` and abort."""
        ex = self._ex
        self._ex = None
        if ex is not None:
            ex._conn = None
            if ex._head is not None:
                ex._answer(code, self)
            else:
                ex._failed = True
                ex._wake(self)
        self._close(abort=True)

    def _fire(self) -> None:
        self._timer = None
        ex = self._ex
        # An unbounded _timeout: a client's bound was lifted since it was armed.
        if ex is None or self.closed or self._timeout <= 0:
            return
        left = self._timeout - (self._time() - self._last_io)
        if left > 0:
            self._timer = self.loop.call_later(left, self._on_timer)
        elif ex._head is not None:
            self._fail(HEAD_TIMEOUT)
        elif ex._waiter is not None and not self.paused:
            ex._stalled = _CLIENT if self.own else _OPERATOR
            self._fail(HEAD_PROTOCOL)
        else:
            # Buffered data waits for a slow consumer: not the worker's silence.
            self._timer = self.loop.call_later(self._timeout, self._on_timer)

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):  # not TCP
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()
        if not self.closed:
            self.closed = True
            self._pool.forget(self)
        ex = self._ex
        if ex is None:
            return
        self._ex = None
        ex._conn = None
        if ex._head is not None:
            ex._answer(HEAD_PROTOCOL if self._replied else HEAD_RESET, None)
            return
        if exc is None and ends_with_connection(ex.headers):
            ex._done = True  # a body delimited by the end of the connection
        else:
            ex._failed = True
        ex._wake(None)

    def data_received(self, data: bytes) -> None:
        if self._ex is None:
            self._close(abort=True)  # bytes nobody asked for
            return
        self._replied = True
        if self._timer is not None:
            self._last_io = self._time()
        self._feeding = True
        try:
            self._feed(data)
        except PARSE_ERRORS:
            self._fail(HEAD_PROTOCOL)
        finally:
            self._feeding = False
        woken = self._woken
        if woken is not None:
            # The request waiting on this response runs now, its bytes all parsed.
            self._woken = None
            woken.step()

    # -- the parser's sink -----------------------------------------------------------

    def on_head(self, status: int, headers: Headers) -> None:
        ex = self._ex
        if ex is None:
            return
        ex.status = status
        ex.headers = headers
        ex._answer(HEAD_OK, self)

    def on_body(self, body: bytes) -> None:
        ex = self._ex
        if ex is None or not body:
            return
        ex._chunks.append(body)
        ex._buffered += len(body)
        if ex._buffered > self._high_water and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        if ex._waiter is not None:
            ex._wake(self)

    def on_end(self, keep_alive: bool) -> None:
        ex = self._ex
        if ex is None:
            return
        self._ex = None
        ex._conn = None
        ex._done = True
        ex._wake(self)
        if keep_alive and not self.closed:
            if self.paused:
                self.resume()
            if self.own:
                self.own = False
                self._timeout = self._pool.hub.read_timeout
            self._pool.put(self)
        else:
            self.close()

    def on_unasked(self) -> None:
        self._close(abort=True)


# -- pools ----------------------------------------------------------------------------------


class Hub:
    """The limits shared by every origin's pool of one :class:`FastUpstream`, bound to
    one event loop, and the requests waiting for a slot of the total.

    A wake-up (a connection became idle or closed) resolves one waiter, which then
    tries again; a waiter that leaves (timeout, cancellation) after being woken
    passes the wake-up on.
    """

    __slots__ = (
        "closed",
        "high_water",
        "idle_timeout",
        "limit",
        "loop",
        "per_limit",
        "pools",
        "read_timeout",
        "sweeper",
        "time",
        "total",
        "waiters",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        limit: int,
        per_limit: int,
        idle_timeout: float,
        read_timeout: float,
        high_water: int,
    ) -> None:
        self.loop = loop
        #: the loop's clock, bound once (the loop is an interpreted object: a call
        #: through it looks ``time`` up each time; a connection is taken and put
        #: back once per request)
        self.time = loop.time
        self.high_water = high_water  # unread bytes of one response before reading pauses
        self.limit = limit  # 0 = unbounded
        self.per_limit = per_limit
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout  # <= 0: no read timeout
        self.total = 0  # open or opening connections, all origins
        self.pools: dict[str, Pool] = {}
        #: requests waiting because of ``limit`` (the per-origin ones wait on their pool)
        self.waiters: deque[asyncio.Future[bool]] = deque()
        self.closed = False
        #: one timer for all pools, armed while a connection idles
        self.sweeper: asyncio.TimerHandle | None = None

    def sweep(self) -> None:
        """Close the idle connections that expired (oldest first in every pool)."""
        self.sweeper = None
        if self.closed:
            return
        horizon = self.loop.time() - self.idle_timeout
        left = False
        for pool in self.pools.values():
            idle = pool.idle
            while idle and idle[0].idle_since <= horizon:
                idle[0].close()
            left = left or bool(idle)
        if left:
            self.sweeper = self.loop.call_later(self.idle_timeout, self.sweep)

    def wake(self, pool: Pool) -> None:
        """A connection of ``pool`` became idle or went away: let one waiter retry."""
        for q in (pool.waiters, self.waiters):
            while q:
                fut = q.popleft()
                if not fut.done():
                    fut.set_result(True)
                    return

    def evict_idle(self) -> bool:
        """Close the oldest idle connection of any origin; False when none is idle."""
        for pool in self.pools.values():
            if pool.idle:
                pool.idle[0].close()
                return True
        return False

    def close(self) -> None:
        self.closed = True
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        for pool in self.pools.values():
            for conn in list(pool.conns):
                conn.close()
            _refuse(pool.waiters)
        _refuse(self.waiters)


class Pool:
    """The connections of one origin (``http://host:port``): the idle ones as a LIFO
    stack, and the requests waiting for a slot of this origin."""

    __slots__ = ("conns", "count", "host", "hub", "idle", "port", "waiters")

    def __init__(self, hub: Hub, host: str, port: int) -> None:
        self.hub = hub
        self.host = host
        self.port = port
        self.count = 0  # open or opening
        self.conns: set[Conn] = set()
        self.idle: list[Conn] = []  # oldest first; taken from the end
        self.waiters: deque[asyncio.Future[bool]] = deque()

    def take(self) -> Conn | None:
        """The most recently used idle connection, unless it expired (then all did)."""
        idle = self.idle
        if not idle:
            return None
        conn = idle.pop()
        conn.pooled = False
        hub = self.hub
        if hub.time() - conn.idle_since < hub.idle_timeout and not conn.closed:
            return conn
        stale = [conn, *idle]
        idle.clear()
        for c in stale:
            c.pooled = False
            c.close()
        return None

    def put(self, conn: Conn) -> None:
        hub = self.hub
        if hub.closed or hub.idle_timeout <= 0:
            conn.close()
            return
        conn.idle_since = hub.time()
        conn.pooled = True
        self.idle.append(conn)
        if hub.sweeper is None:
            hub.sweeper = hub.loop.call_later(hub.idle_timeout, hub.sweep)
        if self.waiters or hub.waiters:
            hub.wake(self)

    def forget(self, conn: Conn) -> None:
        """``conn`` is closed: free its slot."""
        if conn.pooled:
            conn.pooled = False
            self.idle.remove(conn)
        self.conns.discard(conn)
        self.count -= 1
        hub = self.hub
        hub.total -= 1
        if self.waiters or hub.waiters:
            hub.wake(self)
