"""
Sharing connections among the children of ``serve --processes``
================================================================

The children accept from one listening socket. The kernel wakes every child that
waits on it, and the first one awake accepts everything queued: a burst of 64
keep-alive connections (a client's pool, a load balancer's upstream connections)
was measured to land 49 / 15 or 16 / 0 on two children, so one core served most
of the traffic for the connections' whole life.

So a child that accepts a connection while it holds more than :data:`SLACK` above
the least loaded sibling hands the connection to that sibling: the socket's file
descriptor goes over the sibling's *inbox*, a Unix datagram socket pair the parent
made and keeps open (``SCM_RIGHTS``), as Envoy's ``exact_balance`` moves accepted
connections between its worker threads. No child waits for another, and a
connection handed to a child that dies waits in its inbox for the child that
replaces it.

The counts live in a small shared file in the private run directory (:class:`Shares`):

* ``open[i]``: the connections child ``i`` holds (:data:`ABSENT` while it is not
  accepting: before it starts, after it stops, once the parent has reaped it);
* ``sent[i][j]``: the connections child ``i`` has handed to child ``j``;
* ``received[j]``: those child ``j`` has taken out of its inbox.

Every slot has one writer, so plain aligned 8-byte stores need no lock: a reader
sees an old value or a new one, and a value a moment old only makes the split one
connection less even. A connection handed over and not yet received counts for
its receiver (``sum(sent[.][j]) - received[j]``), so a burst is not all handed to
the one sibling whose count has not moved yet.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

__all__ = ["ABSENT", "SHARES_FILE", "SLACK", "Shares", "hand_to"]

#: the counts' file in the children's run directory
SHARES_FILE = "connections"
#: a child that is not accepting
ABSENT = -1
#: connections a child may hold above the least loaded sibling before it hands on
SLACK = 1
_SLOT = 8


def hand_to(held: Sequence[int], me: int, slack: int = SLACK) -> int:
    """The child that should take child ``me``'s next connection, given what each
    holds (received or on its way; :data:`ABSENT`: not accepting): the least loaded
    sibling when ``me`` holds more than ``slack`` above it, else ``me``."""
    best = me
    low = held[me] - slack
    for i, n in enumerate(held):
        if i != me and n != ABSENT and n < low:
            best, low = i, n
    return best


class Shares:
    """The connection counts of ``count`` children, in the file ``path``.

    The parent :meth:`create` s the file; each child opens it and keeps its own
    slots; the parent marks a reaped child :data:`ABSENT` (:meth:`set_open`).
    """

    def __init__(self, path: str, count: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _size(count))
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("q")
        self.count = count

    @staticmethod
    def create(path: str, count: int) -> Shares:
        """Write a file for ``count`` children, none accepting (mode 0600), and open it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _size(count))
        finally:
            os.close(fd)
        shares = Shares(path, count)
        for i in range(count):
            shares.set_open(i, ABSENT)
        return shares

    # open[i] at i; sent[i][j] at count + i * count + j; received[j] after them.

    def set_open(self, index: int, value: int) -> None:
        self._slots[index] = value

    def sent(self, sender: int, to: int) -> None:
        """One more connection handed from ``sender`` to ``to``."""
        at = self.count + sender * self.count + to
        self._slots[at] += 1

    def received(self, index: int) -> None:
        """One more connection taken out of ``index``'s inbox."""
        at = self.count + self.count * self.count + index
        self._slots[at] += 1

    def held(self) -> list[int]:
        """What each child holds: open, plus handed to it and not yet received."""
        n = self.count
        slots = self._slots.tolist()
        out = slots[:n]
        for j in range(n):
            if out[j] != ABSENT:
                on_way = sum(slots[n + i * n + j] for i in range(n)) - slots[n + n * n + j]
                out[j] += max(0, on_way)
        return out

    def handed(self) -> int:
        """Connections handed from one child to another so far."""
        n = self.count
        return sum(self._slots[n : n + n * n].tolist())

    def close(self) -> None:
        self._slots.release()
        self._map.close()


def _size(count: int) -> int:
    return (count + count * count + count) * _SLOT
