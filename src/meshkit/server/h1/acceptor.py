"""
Accepting as one child of many
==============================

A lone gateway accepts through the loop's own server (``loop.create_server``). A
child of ``serve --processes`` accepts through :class:`Acceptor`, which hands a
connection to a sibling holding fewer and takes the connections its siblings hand
to it (see :mod:`meshkit.server.accept` for why and for the rule).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshkit.server.accept import ABSENT, Shares, hand_to

__all__ = ["Acceptor", "Inboxes", "Sharing"]

log = logging.getLogger("meshkit.server")

#: connections taken per wake at most, so that one burst does not hold the loop
_BURST = 64
#: out of file descriptors or buffers: look again after this long (asyncio's wait)
_EXHAUSTED_S = 1.0


class Inboxes:
    """The Unix datagram sockets connections are handed over: this child's own
    inbox (read) and every child's (written), by child index."""

    def __init__(self, own: socket.socket, to: Sequence[socket.socket]) -> None:
        self.own = own
        self.to = list(to)
        for s in (own, *to):
            s.setblocking(False)

    def close(self) -> None:
        for s in (self.own, *self.to):
            s.close()


@dataclass(frozen=True)
class Sharing:
    """What a child shares its connections with: the counts, the inboxes, its index."""

    shares: Shares
    inboxes: Inboxes
    index: int


class Acceptor:
    """Accept from ``sock`` into ``protocol()`` as one of the children of
    ``sharing``; :meth:`counted` keeps this child's count."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: Callable[[], asyncio.Protocol],
        sharing: Sharing,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.protocol = protocol
        self.shares = sharing.shares
        self.inboxes = sharing.inboxes
        self.index = sharing.index
        self._fd = sock.fileno()
        self._open = True
        self._later: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: open connections, and those taken whose transport is not made yet
        self._connections = 0
        self._pending = 0
        #: pending connections counted open since, whose _connect has not ended
        self._moved = 0
        sock.setblocking(False)
        self._publish()
        loop.add_reader(self._fd, self._ready)
        loop.add_reader(self.inboxes.own.fileno(), self._handed)

    def counted(self, connections: int) -> None:
        """This child now holds ``connections`` open connections."""
        made = connections - self._connections
        if made > 0:
            # A connection taken is open now: it stops counting as pending in the
            # same store, or it counts twice until its _connect resumes (several
            # at once in a burst, and siblings then hand this child too few).
            moved = min(made, self._pending)
            self._pending -= moved
            self._moved += moved
        self._connections = connections
        self._publish()

    def close(self) -> None:
        """Stop accepting: the siblings stop handing connections to this child (those
        already in its inbox wait there; the parent closes them when it exits)."""
        if not self._open:
            return
        self._open = False
        self.shares.set_open(self.index, ABSENT)
        self.loop.remove_reader(self.inboxes.own.fileno())
        if self._later is None:
            self.loop.remove_reader(self._fd)
        else:
            self._later.cancel()
            self._later = None

    def _publish(self) -> None:
        if self._open:
            self.shares.set_open(self.index, self._connections + self._pending)

    def _ready(self) -> None:
        for _ in range(_BURST):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM
                log.error("accepting a connection failed (%s); retrying in 1 s", exc)
                self.loop.remove_reader(self._fd)
                self._later = self.loop.call_later(_EXHAUSTED_S, self._resume)
                return
            to = hand_to(self.shares.held(), self.index)
            if to == self.index or not self._hand(conn, to):
                self._take(conn)

    def _hand(self, conn: socket.socket, to: int) -> bool:
        try:
            socket.send_fds(self.inboxes.to[to], [b"c"], [conn.fileno()])
        except OSError:
            return False  # its inbox is full (or gone): this child serves it
        self.shares.sent(self.index, to)
        conn.close()  # the sibling has its own descriptor of the connection now
        return True

    def _handed(self) -> None:
        for _ in range(_BURST):
            try:
                _, fds, _, _ = socket.recv_fds(self.inboxes.own, 1, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.error("taking a connection handed over failed (%s)", exc)
                return
            self.shares.received(self.index)
            for fd in fds:
                self._take(socket.socket(fileno=fd))

    def _take(self, conn: socket.socket) -> None:
        self._pending += 1
        self._publish()
        task = self.loop.create_task(self._connect(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            await self.loop.connect_accepted_socket(self.protocol, conn)
        except OSError:
            conn.close()  # the client reset it before the transport was made
        finally:
            if self._moved:
                self._moved -= 1  # counted open already
            else:
                self._pending -= 1  # refused, reset, or not made yet
            self._publish()

    def _resume(self) -> None:
        self._later = None
        if self._open:
            self.loop.add_reader(self._fd, self._ready)
