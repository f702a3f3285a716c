"""
The built-in HTTP/1.1 server
============================

:class:`H1Server` serves a gateway (``MeshMiddleware`` around the ``ServeApp``)
on a listening socket with :class:`~meshkit.server.h1.conn.H1Conn` connections. It
owns what spans connections:

* ``server.max_connections``: a connection over it is answered 503 and closed;
* ``server.max_pipelined``: how far each connection parses ahead (see
  :class:`~meshkit.server.h1.conn.H1Conn`);
* ``server.keep_alive_s``: a sweep every second closes connections with no
  request running that have been silent that long (idle keep-alives, and heads
  that stall half-sent);
* graceful shutdown (:meth:`shutdown`): stop accepting, close idle connections,
  let running requests finish for up to ``grace_s`` (a connection closes after its
  response), then cancel what is left, which releases leases and upstream
  connections.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from typing import Any

from meshkit.frontends.asgi import MeshMiddleware
from meshkit.server.h1.acceptor import Acceptor, Sharing
from meshkit.server.h1.bridge import run_asgi
from meshkit.server.h1.conn import H1Conn, Request
from meshkit.upstream.fast import FastUpstream

__all__ = ["H1Server"]

log = logging.getLogger("meshkit.server")


class H1Server:
    """Serve ``gateway`` on sockets until :meth:`shutdown`."""

    loop: asyncio.AbstractEventLoop  # set by start()

    def __init__(
        self,
        gateway: MeshMiddleware,
        *,
        keep_alive_s: float = 5.0,
        max_connections: int = 4096,
        max_pipelined: int = 16,
        access_log: bool = False,
        app: Any = None,
        sharing: Sharing | None = None,
    ) -> None:
        self.gateway = gateway
        self.mesh = gateway.mesh
        self.upstream = gateway.upstream
        #: meshkit's own client: a routed request is stepped inline (meshkit.inline);
        #: any other (a transport given to the gateway) runs its requests in Tasks
        self.inline = isinstance(self.upstream, FastUpstream)
        #: what answers the non-inference routes (``app``: another view of them, as
        #: the siblings' private socket of ``serve --processes`` serves)
        self.app = app if app is not None else gateway.app
        self.keep_alive_ticks = max(1, math.ceil(keep_alive_s))
        self.max_connections = max_connections
        self.max_pipelined = max_pipelined
        self.access_log = access_log
        self.conns: set[H1Conn] = set()
        self.tick = 0
        self.draining = False
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.TimerHandle | None = None
        #: the children ``serve --processes`` shares connections among
        self.sharing = sharing
        self._acceptor: Acceptor | None = None

    async def start(self, sock: socket.socket) -> None:
        self.loop = asyncio.get_running_loop()
        if isinstance(self.upstream, FastUpstream):
            self.upstream.pin(self.loop)  # this server's loop sends all it relays
        if self.sharing is not None and self._acceptor is None:
            self._acceptor = Acceptor(self.loop, sock, lambda: H1Conn(self), self.sharing)
        else:
            server = await self.loop.create_server(lambda: H1Conn(self), sock=sock, backlog=2048)
            self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(1.0, self._sweep)

    # -- connections --------------------------------------------------------------

    def attach(self, conn: H1Conn) -> bool:
        """Register a new connection; False when it is over ``max_connections``."""
        if len(self.conns) >= self.max_connections:
            return False
        self.conns.add(conn)
        if self._acceptor is not None:
            self._acceptor.counted(len(self.conns))
        return True

    def detach(self, conn: H1Conn) -> None:
        self.conns.discard(conn)
        if self._acceptor is not None:
            self._acceptor.counted(len(self.conns))

    async def bridge(self, conn: H1Conn, req: Request) -> None:
        await run_asgi(self.app, conn, req)

    def _sweep(self) -> None:
        self.tick += 1
        limit = self.tick - self.keep_alive_ticks
        for conn in [c for c in self.conns if c.idle and c.seen < limit]:
            conn.close()
        self._sweeper = self.loop.call_later(1.0, self._sweep)

    # -- shutdown -----------------------------------------------------------------

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, let running requests finish (``grace_s`` at most), close."""
        self.draining = True
        for server in self._servers:
            server.close()
        if self._acceptor is not None:
            self._acceptor.close()
        for conn in [c for c in self.conns if c.idle]:
            conn.close()
        deadline = self.loop.time() + grace_s
        while any(not c.idle for c in self.conns) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        tasks = [c.task for c in self.conns if c.task is not None]
        if tasks:
            log.warning(
                "graceful shutdown: %d request(s) still running after %.1f s; cancelling them",
                len(tasks),
                grace_s,
            )
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait([task.finished() for task in tasks], timeout=5.0)
        for conn in list(self.conns):
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for server in self._servers:
            await server.wait_closed()

    def stats(self) -> dict[str, Any]:
        return {"connections": len(self.conns), "draining": self.draining}
