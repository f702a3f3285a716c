"""
The blocking client
===================

:class:`BlockingUpstream` is :class:`~meshkit.upstream.fast.FastUpstream` for
threads (the sync client transport and the WSGI middleware): an attempt through
httpcore and h11 costs ~200 µs of CPU, one on a blocking socket parsed by
``httptools`` ~30 µs (``benchmarks/RESULTS.md``), more than the whole mesh adds.

* pools and limits as the asyncio client's (a thread waits on a condition, at
  most ``connect_timeout_s``, 0: unbounded); an idle socket past
  ``idle_timeout_s``, or with something to read when taken (the worker closed it,
  or sent bytes nobody asked for: one ``poll``), is closed, not used;
* the head is :func:`~meshkit.http1.build_head`'s, sent with a body up to
  :data:`JOIN_LIMIT` in one ``sendall``; :class:`~meshkit.http1.ResponseParser`
  parses into the connection;
* ``read_timeout_s`` is the socket's timeout (sends included, as httpcore's read
  and write timeouts). A request with the client's own timeouts
  (:mod:`~meshkit.upstream.timeouts`) sends under its write bound and reads under
  its read bound; the socket keeps them until a request without them (or with
  others) takes it, so one client's requests change nothing once set;
* a socket is pooled again only when its response ended with keep-alive;
  ``close()`` before the end closes it.

``https://`` requests go to the ``fallback``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Final

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Failure
from meshkit.core.requests import Timeouts
from meshkit.http1 import (
    PARSE_ERRORS,
    Headers,
    ResponseParser,
    Unsendable,
    build_head,
    ends_with_connection,
)
from meshkit.upstream.base import (
    HEAD_OK,
    HEAD_PROTOCOL,
    HEAD_RESET,
    HEAD_TIMEOUT,
    Request,
    SyncExchange,
    SyncUpstream,
    UpstreamFailure,
    failure,
    http_origin_of,
    read_upto,
    remember,
    unsendable,
)
from meshkit.upstream.timeouts import ClientTimeout, connect_bound, silent

__all__ = ["JOIN_LIMIT", "BlockingUpstream"]

#: bytes asked of the socket per read
READ_SIZE: Final = 64 * 1024
#: a body this long is sent after its head, not copied into one buffer with it
JOIN_LIMIT: Final = 64 * 1024
#: read_head: the head arrived, then bytes that are no body
_BROKEN: Final = -1


class _Pool:
    """The sockets of one origin (counts are guarded by the upstream's lock)."""

    __slots__ = ("count", "host", "idle", "port")

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: list[_Conn] = []
        self.count = 0  # open sockets, idle or busy


class _Conn:
    """One keep-alive socket, and the sink of its response parser."""

    __slots__ = (
        "_feed",
        "_poll",
        "bounded",
        "ex",
        "idle_since",
        "parser",
        "pool",
        "reusable",
        "sock",
        "timeout",
    )

    def __init__(self, pool: _Pool, sock: socket.socket, timeout: float | None) -> None:
        self.pool = pool
        self.sock = sock
        self.timeout = timeout  # the socket's
        self.bounded = False  # it has a client's own timeout, not [upstream]'s
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.parser = ResponseParser(self)
        self._feed = self.parser.feed
        self.ex: _Exchange | None = None
        self.reusable = False  # the last response ended and allows keep-alive
        self.idle_since = 0.0

    def stale(self) -> bool:
        """Whether the idle socket has something to read: the worker closed it, or
        sent bytes nobody asked for. Either way it answers no request any more."""
        return bool(self._poll.poll(0))

    def set_timeout(self, timeout: float | None) -> None:
        if timeout != self.timeout:
            self.sock.settimeout(timeout)
            self.timeout = timeout

    # -- reading ---------------------------------------------------------------------

    def read_head(self, ex: _Exchange) -> int:
        """Read until ``ex`` has its head (or ended): ``HEAD_OK``, ``_BROKEN`` (the
        head, then bytes that are no body) or how it failed."""
        replied = False
        while not ex.headed:
            try:
                data = self.sock.recv(READ_SIZE)
            except TimeoutError:
                return HEAD_TIMEOUT
            except OSError:
                return HEAD_PROTOCOL if replied else HEAD_RESET
            if not data:
                return HEAD_PROTOCOL if replied else HEAD_RESET
            replied = True
            try:
                self._feed(data)
            except PARSE_ERRORS:
                if not ex.done:
                    return _BROKEN if ex.headed else HEAD_PROTOCOL
                self.reusable = False  # garbage after a whole response
        return HEAD_OK

    def read_body(self, ex: _Exchange) -> bool:
        """One read of ``ex``'s body; False when it broke (what came before is kept)."""
        try:
            data = self.sock.recv(READ_SIZE)
        except TimeoutError:  # silence after the head
            ex.stalled = True
            return False
        except OSError:
            return False
        if not data:
            if not ends_with_connection(ex.headers):
                return False
            ex.done = True  # a body delimited by the end of the connection
            self.ex = None
            return True
        try:
            self._feed(data)
        except PARSE_ERRORS:
            if not ex.done:
                return False
            self.reusable = False  # garbage after a whole response
        return True

    # -- the parser's sink ------------------------------------------------------------

    def on_head(self, status: int, headers: Headers) -> None:
        ex = self.ex
        if ex is not None:
            ex.status = status
            ex.headers = headers
            ex.headed = True

    def on_body(self, body: bytes) -> None:
        ex = self.ex
        if ex is None:
            self.reusable = False  # the body of a response nobody asked for (or of a HEAD)
        elif body:
            ex.pending.append(body)

    def on_end(self, keep_alive: bool) -> None:
        # Only marked here: the socket goes back to its pool once feed has
        # returned, never while this thread is still inside its parser.
        ex = self.ex
        if ex is not None:
            ex.done = True
            self.ex = None
            self.reusable = keep_alive

    def on_unasked(self) -> None:
        self.reusable = False


class _Exchange:
    """A response being read from one socket (a :class:`SyncExchange`)."""

    __slots__ = (
        "_conn",
        "_upstream",
        "bounds",
        "done",
        "headed",
        "headers",
        "pending",
        "stalled",
        "status",
    )

    def __init__(self, upstream: BlockingUpstream, conn: _Conn, bounds: Timeouts | None) -> None:
        self._upstream = upstream
        self._conn: _Conn | None = conn
        self.bounds = bounds
        self.stalled = False  # the body failed for the worker's silence
        self.headed = False
        self.done = False
        self.status = 0
        self.headers: Headers = []
        self.pending: list[bytes] = []

    def whole(self) -> bytes | None:
        if not self.done:
            return None
        got, self.pending = self.pending, []
        self._settle()
        return got[0] if len(got) == 1 else b"".join(got)

    def chunks(self) -> Iterator[bytes]:
        while True:
            if self.pending:
                got, self.pending = self.pending, []
                yield from got
            if self.done:
                self._settle()
                return
            conn = self._conn
            if conn is None:
                raise self._broken()
            if not conn.read_body(self):
                self.close()  # then the chunks that came first, then the failure

    def read(self, limit: int) -> bytes:
        return read_upto(self.chunks(), limit)

    def close(self) -> None:
        """The socket back to its pool when the body ended, else closed."""
        if self.done:
            self._settle()
            return
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.ex = None
            self._upstream._drop(conn)

    def _settle(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._upstream._release(conn)

    def _broken(self) -> Exception:
        if not self.stalled:
            return UpstreamFailure(Failure.PROTOCOL)
        bounds = self.bounds
        return silent(bounds is not None and bounds.read is not None)


class BlockingUpstream(SyncUpstream):
    """Pooled keep-alive HTTP/1.1 over blocking sockets (see the module documentation).

    :param fallback: sends the requests to ``https://`` workers.
    """

    def __init__(
        self, config: UpstreamConfig | None = None, fallback: SyncUpstream | None = None
    ) -> None:
        self.config = config or UpstreamConfig()
        self._fallback = fallback
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._pools: dict[str, _Pool] = {}
        self._total = 0
        self._closed = False
        #: request URL -> (its origin's pool, or None for https; the request line)
        self._routes: dict[str, tuple[_Pool | None, bytes]] = {}

    # -- the hot path --------------------------------------------------------------

    def send(self, request: Request) -> SyncExchange:
        url = request.url
        route = self._routes.get(url)
        if route is None:
            route = self._route(url)
        pool, line = route
        if pool is None:
            if self._fallback is None:
                raise UpstreamFailure(Failure.CONNECT)
            return self._fallback.send(request)
        method, body = request.method, request.body
        try:
            head = build_head(method, line, request.headers, len(body))
        except Unsendable:
            raise unsendable() from None
        if body and len(body) <= JOIN_LIMIT:
            head, body = head + body, b""
        head_only = method == "HEAD"
        bounds = request.timeout
        conn, reused = self._take(pool, bounds)
        while True:
            ex = _Exchange(self, conn, bounds)
            conn.ex = ex
            parser = conn.parser
            parser.waiting = True
            parser.head_only = head_only
            try:
                if bounds is None and not conn.bounded:
                    code = self._exchange(conn, ex, head, body)
                else:
                    code = self._bounded(conn, ex, head, body, bounds)
            except BaseException:
                conn.ex = None
                self._drop(conn)
                raise
            if code == HEAD_OK:
                if ex.done:  # the whole response arrived with its head
                    ex._settle()
                return ex
            conn.ex = None
            self._drop(conn)
            if code == _BROKEN:  # the body fails from chunks(), after what came first
                ex._conn = None
                return ex
            error = failure(code, fresh=not reused)
            if error is not None:
                raise error
            reused = False
            conn, _ = self._take(pool, bounds, fresh=True)

    def close(self) -> None:
        """Close the idle sockets (busy ones close when their exchange ends) and
        the fallback."""
        with self._lock:
            self._closed = True
            idle = [c for p in self._pools.values() for c in p.idle]
            for p in self._pools.values():
                p.count -= len(p.idle)
                p.idle.clear()
            self._total -= len(idle)
            self._freed.notify_all()
        for conn in idle:
            _shut(conn.sock)
        if self._fallback is not None:
            self._fallback.close()

    # -- sockets -------------------------------------------------------------------

    @staticmethod
    def _exchange(conn: _Conn, ex: _Exchange, head: bytes, body: bytes) -> int:
        try:
            conn.sock.sendall(head)
            if body:
                conn.sock.sendall(body)
        except TimeoutError:
            return HEAD_TIMEOUT
        except OSError:
            # Not one byte of an answer yet: as a reset before the reply.
            return HEAD_RESET
        return conn.read_head(ex)

    def _bounded(
        self, conn: _Conn, ex: _Exchange, head: bytes, body: bytes, bounds: Timeouts | None
    ) -> int:
        """:meth:`_exchange` under the client's own timeouts, or (``bounds`` None) on
        a socket that had some, with ``[upstream]``'s again."""
        c = self.config
        default = c.read_timeout_s if c.read_timeout_s > 0 else None
        conn.bounded = bounds is not None
        if bounds is None:
            conn.set_timeout(default)
            return self._exchange(conn, ex, head, body)
        conn.set_timeout(default if bounds.write is None else bounds.write)
        try:
            conn.sock.sendall(head)
            if body:
                conn.sock.sendall(body)
        except TimeoutError:
            if bounds.write is not None:
                raise ClientTimeout("write") from None
            return HEAD_TIMEOUT
        except OSError:
            return HEAD_RESET
        conn.set_timeout(default if bounds.read is None else bounds.read)
        code = conn.read_head(ex)
        if code == HEAD_TIMEOUT and bounds.read is not None:
            raise ClientTimeout("read")
        return code

    def _take(
        self, pool: _Pool, bounds: Timeouts | None, *, fresh: bool = False
    ) -> tuple[_Conn, bool]:
        """A socket of ``pool``: ``(an idle one, True)`` unless ``fresh``, else a new
        one once there is room (waiting at most ``connect_timeout_s``, or the
        client's own connect bound)."""
        c = self.config
        per, limit = c.pool_limit_per_worker, c.pool_limit
        expired: list[_Conn] = []
        deadline: float | None = None
        try:
            with self._lock:
                while True:
                    if not fresh:
                        now = time.monotonic()
                        while pool.idle:
                            conn = pool.idle.pop()
                            if now - conn.idle_since <= c.idle_timeout_s and not conn.stale():
                                return conn, True
                            self._uncount(pool)
                            expired.append(conn)
                    if self._closed:
                        raise UpstreamFailure(Failure.CONNECT)
                    per_full = bool(per) and pool.count >= per
                    if not per_full and (not limit or self._total < limit):
                        pool.count += 1
                        self._total += 1
                        break
                    # Room made by closing an idle socket: this origin's when its own
                    # limit is the one reached, else the one idle longest anywhere.
                    victim = pool if per_full else self._longest_idle()
                    if victim is not None and victim.idle:
                        expired.append(victim.idle.pop(0))
                        self._uncount(victim)
                        continue
                    wait = connect_bound(c, bounds)[0]
                    if deadline is None and wait > 0:
                        deadline = time.monotonic() + wait
                    left = None if deadline is None else deadline - time.monotonic()
                    if (left is not None and left <= 0) or not self._freed.wait(left):
                        # Nothing was sent: the worker is busy, not failing (503).
                        raise UpstreamFailure(Failure.POOL)
        finally:
            for conn in expired:
                _shut(conn.sock)
        return self._open(pool, bounds), False

    def _uncount(self, pool: _Pool) -> None:
        pool.count -= 1
        self._total -= 1

    def _longest_idle(self) -> _Pool | None:
        """(lock) The pool whose oldest idle socket idled longest (None: none idle)."""
        oldest: _Pool | None = None
        for p in self._pools.values():
            if p.idle and (oldest is None or p.idle[0].idle_since < oldest.idle[0].idle_since):
                oldest = p
        return oldest

    def _open(self, pool: _Pool, bounds: Timeouts | None) -> _Conn:
        c = self.config
        connect, mine = connect_bound(c, bounds)
        try:
            sock = socket.create_connection((pool.host, pool.port), timeout=connect or None)
        except OSError as exc:  # refused, unreachable, timed out
            self._forget(pool)
            if mine and isinstance(exc, TimeoutError):
                raise ClientTimeout("connect") from exc
            raise UpstreamFailure(Failure.CONNECT) from exc
        except BaseException:
            self._forget(pool)
            raise
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        timeout = c.read_timeout_s if c.read_timeout_s > 0 else None
        sock.settimeout(timeout)
        return _Conn(pool, sock, timeout)

    def _forget(self, pool: _Pool) -> None:
        with self._lock:
            self._uncount(pool)
            # Every waiter: one notified alone may be waiting for another origin's
            # limit and go back to sleep, leaving one this room was for asleep.
            self._freed.notify_all()

    def _release(self, conn: _Conn) -> None:
        """A socket whose response ended: back to its pool, or closed."""
        if not conn.reusable or self._closed:
            self._drop(conn)
            return
        conn.reusable = False
        conn.idle_since = time.monotonic()
        with self._lock:
            if self._closed:
                self._uncount(conn.pool)
                _shut(conn.sock)
                return
            conn.pool.idle.append(conn)
            self._freed.notify_all()  # as in _forget

    def _drop(self, conn: _Conn) -> None:
        _shut(conn.sock)
        self._forget(conn.pool)

    def _route(self, url: str) -> tuple[_Pool | None, bytes]:
        origin = http_origin_of(url)
        if origin is None:
            route: tuple[_Pool | None, bytes] = (None, b"")
        else:
            key, host, port, line = origin
            with self._lock:
                pool = self._pools.get(key)
                if pool is None:
                    pool = self._pools[key] = _Pool(host, port)
            route = (pool, line)
        return remember(self._routes, url, route, self.config.max_cached_urls)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
