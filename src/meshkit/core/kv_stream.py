"""
Where one worker's KV-event stream stands
=========================================

Sans-I/O bookkeeping for :mod:`meshkit.lifecycle.kv`: the number of the next
batch expected from an engine, and the stamps (the engine's ``ts``) of the last
``kv.trail_batches`` taken. Numbers are the engine's whichever way a batch
arrived (straight from the engine, from a replay, through any ``meshkit
kv-relay``), so one stream spans a worker's relays: when the subscriber moves to
another relay, a batch it missed is a jump forward (a gap, replayed or
forgotten), and a batch it took already, which the new relay may still carry, is
a number behind with the stamp taken before: a copy, skipped. A number behind
with another stamp (or one older than the remembered ones) is a publisher that
began again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

__all__ = ["BatchStream"]


class _Stamped(Protocol):
    @property
    def ts(self) -> float: ...


class BatchStream:
    """The next number expected (None: none yet, or since a reset) and the stamps
    of numbers ``expected - len(seen)`` to ``expected - 1``."""

    __slots__ = ("expected", "seen")

    def __init__(self, trail: int) -> None:
        self.expected: int | None = None
        self.seen: deque[float] = deque(maxlen=trail)

    def took(self, seq: int, ts: float) -> None:
        """Batch ``seq`` (stamped ``ts``) was taken."""
        if seq != self.expected:
            self.seen.clear()  # the first, or after a jump: nothing before it is known
        self.seen.append(ts)
        self.expected = seq + 1

    def took_run(self, first: int, batches: Sequence[_Stamped]) -> None:
        """``batches``, numbered from ``first`` (a replay's), were taken."""
        for i, batch in enumerate(batches):
            self.took(first + i, batch.ts)

    def joined(self, first: int, batches: Sequence[_Stamped]) -> None:
        """A first replay brought ``batches``, numbered from ``first`` (none: the
        engine had published nothing from ``first`` on)."""
        self.seen.clear()
        self.expected = first
        self.took_run(first, batches)

    def copy(self, seq: int, ts: float) -> bool:
        """Whether batch ``seq`` stamped ``ts`` is one taken already."""
        if self.expected is None:
            return False
        i = seq - (self.expected - len(self.seen))
        return 0 <= i < len(self.seen) and self.seen[i] == ts

    def reset(self) -> None:
        """The worker's entries were dropped: the next batch starts afresh."""
        self.expected = None
        self.seen.clear()
