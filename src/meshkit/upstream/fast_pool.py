"""
Pools of the fast relay
=======================

* :class:`Pool` — the connections of one origin: the idle ones as a LIFO stack
  (the most recently used is taken first, so the coldest sink and expire together)
  and the requests waiting for a slot of this origin;
* :class:`Hub` — the limits shared by every origin, bound to one event loop, and
  the requests waiting for a slot of the total.

Idle connections are checked when taken, and swept by one timer per hub (armed
while any connection idles), so none outlives ``idle_timeout_s`` by much.

A wake-up (a connection became idle or closed) resolves one waiter, which then
tries again; a waiter that leaves (timeout, cancellation) after being woken passes
the wake-up on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshkit.upstream.fast_conn import Conn

__all__ = ["Hub", "Pool"]


class Hub:
    """Limits and state shared by the pools of one :class:`FastUpstream` on one loop."""

    __slots__ = (
        "closed",
        "idle_timeout",
        "limit",
        "loop",
        "per_limit",
        "pools",
        "read_timeout",
        "sweeper",
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
    ) -> None:
        self.loop = loop
        self.limit = limit  # 0 = unbounded (as aiohttp)
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
            for fut in pool.waiters:
                if not fut.done():
                    fut.set_result(False)
            pool.waiters.clear()
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(False)
        self.waiters.clear()


class Pool:
    """The connections of one origin (``http://host:port``)."""

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
        if self.hub.loop.time() - conn.idle_since < self.hub.idle_timeout and not conn.closed:
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
        conn.idle_since = hub.loop.time()
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
