"""
Connections and exchanges of the fast relay
===========================================

The moving parts behind :class:`~meshkit.upstream.fast.FastUpstream`:

* :class:`Conn` — one keep-alive HTTP/1.1 connection to a worker, an
  :class:`asyncio.Protocol` that parses responses with
  ``httptools.HttpResponseParser`` (callbacks on the protocol itself, no task);
* :class:`Exchange` — one response: status, headers (names lower-cased, in the
  order received) and the body as a deque of chunks plus one waiter future;
* their pools and limits are in :mod:`meshkit.upstream.fast_pool`.

A connection serves one request at a time. It goes back to its pool when the
parser reports the end of the response (the body is then buffered in the
exchange, whoever reads it), keep-alive allowed and nothing went wrong; any other
end closes it. Silence is bounded by one timer per connection, re-armed lazily
from the time of the last byte received: none per chunk, and none per request of
a keep-alive connection (it stays armed, and drops once it finds the connection
idle). Reading pauses while more than :data:`HIGH_WATER` bytes wait unread and
resumes below :data:`LOW_WATER`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools

from meshkit.core.forward import Failure
from meshkit.upstream.drive import UpstreamFailure

if TYPE_CHECKING:
    from meshkit.upstream.fast_pool import Pool

__all__ = ["HIGH_WATER", "LOW_WATER", "Conn", "Exchange"]

HIGH_WATER = 1024 * 1024
LOW_WATER = 256 * 1024

# Outcomes of the wait for a response head (the head future's result).
HEAD_OK = 0
HEAD_RESET = 1  # the connection ended before any response byte
HEAD_TIMEOUT = 2
HEAD_PROTOCOL = 3

_NO_HEADERS: list[tuple[bytes, bytes]] = []
_FRAMING = (b"content-length", b"transfer-encoding")


class Exchange:
    """One response (an :class:`~meshkit.upstream.drive.AsyncExchange`)."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_failed",
        "_head",
        "_waiter",
        "headers",
        "status",
    )

    status: int
    headers: list[tuple[bytes, bytes]]

    def __init__(self, conn: Conn, head: asyncio.Future[int]) -> None:
        self.status = 0
        self.headers = _NO_HEADERS
        self._conn: Conn | None = conn  # None once the body ended (or failed)
        self._head: asyncio.Future[int] | None = head  # None once the head arrived
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._failed = False
        self._waiter: asyncio.Future[None] | None = None

    def chunks(self) -> Exchange:
        return self

    def whole(self) -> bytes | None:
        """The entire body when it already ended (the common small response, read
        with its head), else None: then read it from :meth:`chunks`."""
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
                if conn is not None and conn.paused and self._buffered < LOW_WATER:
                    conn.resume()
                return data
            if self._done:
                raise StopAsyncIteration
            conn = self._conn
            if self._failed or conn is None:
                raise UpstreamFailure(Failure.PROTOCOL)
            waiter = self._waiter = conn.loop.create_future()
            await waiter

    async def read(self, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        while size < limit:
            try:
                chunk = await self.__anext__()
            except StopAsyncIteration:
                break
            parts.append(chunk)
            size += len(chunk)
        data = b"".join(parts)
        return data if len(data) <= limit else data[:limit]

    async def aclose(self) -> None:
        self.abandon()
        self._chunks.clear()
        self._buffered = 0

    def abandon(self) -> None:
        """Close the connection unless the response already ended (then it is
        pooled again, possibly serving another request: not ours to touch)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            # The body did not end: the worker is still writing. Closing the
            # connection is how it learns the client left (generation stops).
            self._failed = True
            conn.abandon()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


class Conn(asyncio.Protocol):
    """One keep-alive connection to a worker; serves one request at a time."""

    __slots__ = (
        "_ex",
        "_head_only",
        "_headers",
        "_interim",
        "_last_io",
        "_on_timer",
        "_parser",
        "_pool",
        "_replied",
        "_time",
        "_timeout",
        "_timer",
        "closed",
        "idle_since",
        "loop",
        "paused",
        "pooled",
        "transport",
    )

    def __init__(self, pool: Pool) -> None:
        hub = pool.hub
        self._pool = pool
        self.loop = hub.loop
        self._time = hub.loop.time
        self._timeout = hub.read_timeout
        self._parser = httptools.HttpResponseParser(self)
        self._on_timer = self._fire  # bound once
        self.transport: asyncio.Transport | None = None
        self._ex: Exchange | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._last_io = 0.0
        self._replied = False  # a byte of the current response arrived
        self._interim = False  # parsing a 1xx response
        self._head_only = False
        self.closed = False
        self.paused = False
        self.pooled = False
        self.idle_since = 0.0

    # -- the request ---------------------------------------------------------------

    def send(self, ex: Exchange, head: bytes, body: bytes, head_only: bool) -> None:
        transport = self.transport
        assert transport is not None
        self._ex = ex
        self._replied = False
        self._head_only = head_only
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

    def _complete(self, reuse: bool) -> None:
        ex = self._ex
        assert ex is not None
        self._ex = None
        self._headers = []
        ex._conn = None
        ex._done = True
        ex._wake()
        if reuse and not self.closed:
            if self.paused:
                self.resume()
            self._pool.put(self)
        else:
            self.close()

    def _fail(self, code: int) -> None:
        """The current response cannot go on: report ``code`` and abort."""
        ex = self._ex
        self._ex = None
        if ex is not None:
            ex._conn = None
            head = ex._head
            if head is not None:
                ex._head = None
                if not head.done():
                    head.set_result(code)
            else:
                ex._failed = True
                ex._wake()
        self._close(abort=True)

    def _fire(self) -> None:
        self._timer = None
        ex = self._ex
        if ex is None or self.closed:
            return
        left = self._timeout - (self._time() - self._last_io)
        if left > 0:
            self._timer = self.loop.call_later(left, self._on_timer)
        elif ex._head is not None:
            self._fail(HEAD_TIMEOUT)
        elif ex._waiter is not None and not self.paused:
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
        head = ex._head
        if head is not None:
            ex._head = None
            if not head.done():
                head.set_result(HEAD_PROTOCOL if self._replied else HEAD_RESET)
            return
        if exc is None and not any(k in _FRAMING for k, _ in ex.headers):
            ex._done = True  # a body delimited by the end of the connection
        else:
            ex._failed = True
        ex._wake()

    def data_received(self, data: bytes) -> None:
        if self._ex is None:
            self._close(abort=True)  # bytes nobody asked for
            return
        self._replied = True
        if self._timer is not None:
            self._last_io = self._time()
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._fail(HEAD_PROTOCOL)

    # -- httptools callbacks -------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        ex = self._ex
        if ex is None:
            self._close(abort=True)
            return
        status = self._parser.get_status_code()
        if status < 200:
            # 1xx (101 raises an upgrade error): an interim response, skipped.
            self._interim = True
            self._headers = []
            return
        ex.status = status
        ex.headers = self._headers
        head = ex._head
        ex._head = None
        if head is not None and not head.done():
            head.set_result(HEAD_OK)
        if self._head_only:
            # A response to HEAD has no body whatever its headers say.
            self._complete(False)

    def on_body(self, body: bytes) -> None:
        ex = self._ex
        if ex is None or not body:
            return
        ex._chunks.append(body)
        ex._buffered += len(body)
        if ex._buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        if ex._waiter is not None:
            ex._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self._ex is not None:
            self._complete(self._parser.should_keep_alive())
