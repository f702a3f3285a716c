"""
The fast relay, blocking
========================

:class:`SyncFastUpstream` is :class:`~meshkit.upstream.fast.FastUpstream` for
threads: the default upstream of :class:`~meshkit.frontends.transport.MeshTransport`
for ``http://`` workers. An attempt through httpcore and h11 costs ~200 µs of CPU
on this machine, one on a blocking socket parsed by ``httptools`` ~30 µs
(``benchmarks/RESULTS.md``): more than the whole mesh adds to a client's request.

* one pool of keep-alive sockets per origin, bounded by
  ``upstream.pool_limit_per_worker`` per origin and ``upstream.pool_limit`` in all
  (0 = unbounded); a request over a limit waits for a free socket at most
  ``connect_timeout_s``, then fails with ``Failure.POOL`` (nothing was sent: the
  worker is not blamed). Idle sockets are a stack (the most recently used is
  taken first) and one idle longer than ``idle_timeout_s`` is closed when met;
* the request head is built as the asynchronous relay builds it
  (:func:`~meshkit.upstream.fast.build_head`: a header holding CR or LF is
  refused, here as the client's 400, as httpcore refuses it);
* responses are parsed by ``httptools`` callbacks on the connection: ``Content-Length``,
  chunked and read-until-close bodies; interim 1xx skipped; a response to ``HEAD``
  has no body, and its socket is not reused;
* ``read_timeout_s`` bounds each wait for the worker's bytes (the socket's timeout,
  sends included, as httpcore's read and write timeouts): ``Failure.TIMEOUT``
  before the head, ``Failure.PROTOCOL`` from ``chunks()`` after it;
* an idle socket with something to read when taken (the worker closed it, or sent
  bytes nobody asked for) is closed, not used (one ``poll`` of it); a *reused*
  socket that still ends before any response byte is retried once on a new
  socket; a new socket that does the same is ``Failure.CONNECT``;
* ``close()`` on an exchange whose body did not end closes its socket (the
  worker sees the client leave); a socket returns to its pool only when its
  response ended, keep-alive allowed.

``https://`` workers go to the fallback given (the transport's httpcore pools).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httptools

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt, Failure
from meshkit.errors import InvalidRequest
from meshkit.upstream.drive import SyncExchange, UpstreamFailure, read_upto
from meshkit.upstream.fast import build_head, http_origin

__all__ = ["SyncFastUpstream"]

#: cached request lines (per URL) before the cache is cleared
MAX_ROUTES = 4096
#: bytes asked of the socket per read
READ_SIZE = 64 * 1024
#: a body this long is sent after its head, not copied into one buffer with it
JOIN_LIMIT = 64 * 1024

_FRAMING = (b"content-length", b"transfer-encoding")
# How reading a response head ended.
_OK, _RESET, _TIMEOUT, _PROTOCOL = range(4)


class _Pool:
    """The sockets of one origin (counts are guarded by the upstream's lock)."""

    __slots__ = ("count", "host", "idle", "port")

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: list[_Conn] = []
        self.count = 0  # open sockets, idle or busy


class _Conn:
    """One keep-alive socket and its parser; the callbacks fill the current exchange."""

    __slots__ = (
        "_headers",
        "_interim",
        "_parser",
        "_poll",
        "ex",
        "idle_since",
        "pool",
        "reusable",
        "sock",
    )

    def __init__(self, pool: _Pool, sock: socket.socket) -> None:
        self.pool = pool
        self.sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._parser = httptools.HttpResponseParser(self)
        self._headers: list[tuple[bytes, bytes]] = []
        self._interim = False
        self.ex: _Exchange | None = None
        self.reusable = False  # the last response ended and allows keep-alive
        self.idle_since = 0.0

    def stale(self) -> bool:
        """Whether the idle socket has something to read: the worker closed it, or
        sent bytes nobody asked for. Either way it answers no request any more."""
        return bool(self._poll.poll(0))

    # -- reading ---------------------------------------------------------------------

    def read_head(self, ex: _Exchange) -> int:
        """Read until ``ex`` has its head (or ended): ``_OK`` or how it failed."""
        replied = False
        while not ex.headed:
            try:
                data = self.sock.recv(READ_SIZE)
            except TimeoutError:
                return _TIMEOUT
            except OSError:
                return _PROTOCOL if replied else _RESET
            if not data:
                return _PROTOCOL if replied else _RESET
            replied = True
            try:
                self._parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                if not ex.done:
                    return _PROTOCOL
                self.reusable = False  # garbage after a whole response
        return _OK

    def read_body(self, ex: _Exchange) -> None:
        """One read of ``ex``'s body; raises ``UpstreamFailure(PROTOCOL)`` when it broke."""
        try:
            data = self.sock.recv(READ_SIZE)
        except OSError as exc:  # TimeoutError included: silence after the head
            raise UpstreamFailure(Failure.PROTOCOL) from exc
        if not data:
            if any(k in _FRAMING for k, _ in ex.headers):
                raise UpstreamFailure(Failure.PROTOCOL)
            ex.done = True  # a body delimited by the end of the connection
            self.ex = None
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not ex.done:
                raise UpstreamFailure(Failure.PROTOCOL) from exc
            self.reusable = False  # garbage after a whole response

    # -- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        ex = self.ex
        status = self._parser.get_status_code()
        if ex is None:
            self.reusable = False  # a response nobody asked for: drop the socket
            return
        if status < 200:
            # 1xx (101 raises an upgrade error): an interim response, skipped.
            self._interim = True
            self._headers = []
            return
        ex.status = status
        ex.headers = self._headers
        self._headers = []
        ex.headed = True
        if ex.head_only:
            # A response to HEAD has no body whatever its headers say.
            self._end(False)

    def on_body(self, body: bytes) -> None:
        ex = self.ex
        if ex is None:
            self.reusable = False
        elif body:
            ex.pending.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self.ex is not None:
            self._end(self._parser.should_keep_alive())

    def _end(self, reuse: bool) -> None:
        # Only marked here: the socket goes back to its pool once feed_data has
        # returned, never while this thread is still inside its parser.
        ex = self.ex
        assert ex is not None
        ex.done = True
        self.ex = None
        self.reusable = reuse


class _Exchange:
    """A response being read from one socket (a :class:`SyncExchange`)."""

    __slots__ = (
        "_conn",
        "_upstream",
        "done",
        "head_only",
        "headed",
        "headers",
        "pending",
        "status",
    )

    def __init__(self, upstream: SyncFastUpstream, conn: _Conn, head_only: bool) -> None:
        self._upstream = upstream
        self._conn: _Conn | None = conn
        self.head_only = head_only
        self.headed = False
        self.done = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.pending: list[bytes] = []

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
                raise UpstreamFailure(Failure.PROTOCOL)
            try:
                conn.read_body(self)
            except UpstreamFailure:
                self.close()
                raise

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


class SyncFastUpstream:
    """Pooled keep-alive HTTP/1.1 over blocking sockets (see the module documentation).

    :param fallback: sends the attempts to ``https://`` workers.
    """

    def __init__(
        self,
        config: UpstreamConfig | None = None,
        fallback: Callable[[Attempt], SyncExchange] | None = None,
    ) -> None:
        self.config = config or UpstreamConfig()
        self._fallback = fallback
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._pools: dict[str, _Pool] = {}
        self._total = 0
        self._closed = False
        #: attempt URL -> (its origin's pool, or None for https; the request line)
        self._routes: dict[str, tuple[_Pool | None, bytes]] = {}

    # -- the hot path --------------------------------------------------------------

    def send_sync(self, attempt: Attempt) -> SyncExchange:
        url = attempt.url
        route = self._routes.get(url)
        if route is None:
            route = self._route(url)
        pool, line = route
        if pool is None:
            if self._fallback is None:
                raise UpstreamFailure(Failure.CONNECT)
            return self._fallback(attempt)
        method, body = attempt.method, attempt.body
        try:
            head = build_head(method, line, attempt.headers, len(body))
        except UpstreamFailure:
            raise InvalidRequest(
                "the request's headers or query cannot be sent as valid HTTP"
            ) from None
        if body and len(body) <= JOIN_LIMIT:
            head, body = head + body, b""
        conn, reused = self._take(pool)
        while True:
            ex = _Exchange(self, conn, method == "HEAD")
            conn.ex = ex
            try:
                code = self._exchange(conn, ex, head, body)
            except BaseException:
                conn.ex = None
                self._drop(conn)
                raise
            if code == _OK:
                if ex.done:  # the whole response arrived with its head
                    ex._settle()
                return ex
            conn.ex = None
            self._drop(conn)
            if code == _RESET and reused:
                # A pooled socket the worker had closed: once more, on a new one.
                reused = False
                conn, _ = self._take(pool, fresh=True)
                continue
            if code == _RESET:
                raise UpstreamFailure(Failure.CONNECT)
            raise UpstreamFailure(Failure.TIMEOUT if code == _TIMEOUT else Failure.PROTOCOL)

    def close(self) -> None:
        """Close the idle sockets; busy ones close when their exchange ends."""
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

    # -- sockets -------------------------------------------------------------------

    @staticmethod
    def _exchange(conn: _Conn, ex: _Exchange, head: bytes, body: bytes) -> int:
        try:
            conn.sock.sendall(head)
            if body:
                conn.sock.sendall(body)
        except TimeoutError:
            return _TIMEOUT
        except OSError:
            # Not one byte of an answer yet: as a reset before the reply.
            return _RESET
        return conn.read_head(ex)

    def _take(self, pool: _Pool, *, fresh: bool = False) -> tuple[_Conn, bool]:
        """A socket of ``pool``: ``(an idle one, True)`` unless ``fresh``, else a new
        one once there is room (waiting at most ``connect_timeout_s``)."""
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
                    if deadline is None:
                        deadline = time.monotonic() + c.connect_timeout_s
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._freed.wait(left):
                        # Nothing was sent: the worker is busy, not failing (503).
                        raise UpstreamFailure(Failure.POOL)
        finally:
            for conn in expired:
                _shut(conn.sock)
        return self._open(pool), False

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

    def _open(self, pool: _Pool) -> _Conn:
        c = self.config
        try:
            sock = socket.create_connection((pool.host, pool.port), timeout=c.connect_timeout_s)
        except OSError as exc:  # refused, unreachable, timed out
            self._forget(pool)
            raise UpstreamFailure(Failure.CONNECT) from exc
        except BaseException:
            self._forget(pool)
            raise
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(c.read_timeout_s if c.read_timeout_s > 0 else None)
        return _Conn(pool, sock)

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
        origin = http_origin(url)
        if origin is None:
            route: tuple[_Pool | None, bytes] = (None, b"")
        else:
            key, host, port, line = origin
            with self._lock:
                pool = self._pools.get(key)
                if pool is None:
                    pool = self._pools[key] = _Pool(host, port)
            route = (pool, line)
        if len(self._routes) >= MAX_ROUTES:
            self._routes.clear()
        self._routes[url] = route
        return route


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
