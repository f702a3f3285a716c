"""
Consistent-hash ring
====================

A ring of virtual nodes keyed by candidate key (``cand.key``: a stable string such
as ``http://10.0.0.5:8000#dp1``). Each key owns ``virtual_nodes`` points on a
64-bit circle; a request's key hashes to a point and is served by the first
owner clockwise. Adding or removing one of ``N`` owners therefore moves only the
keys whose first owner changed, about ``1/N`` of them.

Hashes come from :mod:`hashlib` (BLAKE2b for keys, SHAKE-256 for an owner's
points), never from :func:`hash`, so every process (whatever its
``PYTHONHASHSEED``) and every replica of a mesh places the same key on the same
worker.

Why 1000 points per owner by default: the owner with the longest arcs takes that
much more of every hash-placed key, for as long as the fleet stays as it is, and
nothing in a router that sees 1/K of the traffic evens it out. Over random fleets
the longest arcs run 1.08 / 1.15 / 1.20 times the mean at the median (4 / 16 / 64
owners) with 150 points, 1.03 / 1.05 / 1.07 with 1000 (``benchmarks/ring_balance.py``).
One SHAKE stream per owner makes the points in C: a ring of 64 owners builds in
tens of milliseconds, once per fleet change.

Usage::

    ring = HashRing(["http://a:8000", "http://b:8000"], virtual_nodes=1000)
    for owner in ring.walk(hash_bytes(b"some prefix")):
        ...  # owners in clockwise order, each once

.. autoclass:: HashRing
.. autofunction:: hash_bytes
.. autofunction:: load_bound
.. autofunction:: bounded_load_pick
"""

from __future__ import annotations

import bisect
import hashlib
import math
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Final

from meshkit.core.workers import Candidate

__all__ = [
    "DEFAULT_VIRTUAL_NODES",
    "HashRing",
    "bounded_load_pick",
    "hash_bytes",
    "hash_token_ids",
    "load_bound",
    "owner_points",
]

_MASK64: Final = (1 << 64) - 1
_MASK32: Final = (1 << 32) - 1

#: ring points per owner unless configured (the module's docstring says why)
DEFAULT_VIRTUAL_NODES: Final = 1000


def hash_bytes(data: bytes) -> int:
    """A 64-bit point on the ring, identical in every process and on every host."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def hash_token_ids(ids: Sequence[int]) -> int:
    """Hash a token-id prefix (plain ``int`` ids).

    Ids are written as decimal text rather than packed machine integers, so the
    point is the same on any byte order and for ids of any size.
    """
    n = len(ids)
    fmt = _ID_FORMATS.get(n)
    if fmt is None:
        fmt = b"t:" + b",".join([b"%d"] * n)
        if len(_ID_FORMATS) < 64:
            _ID_FORMATS[n] = fmt
    # One C-level format: half the cost of ",".join(map(str, ids)), the same bytes.
    return hash_bytes(fmt % tuple(ids))


def owner_points(key: str, count: int) -> list[int]:
    """The ``count`` ring points of one owner: its SHAKE-256 stream read as
    big-endian 64-bit words, so every host (whatever its byte order) agrees."""
    words = array("Q", hashlib.shake_256(b"v:" + key.encode("utf-8")).digest(8 * count))
    if sys.byteorder == "little":
        words.byteswap()
    return words.tolist()


#: ``b"t:%d,%d,..."`` per id count (a policy hashes a fixed count: few entries)
_ID_FORMATS: Final[dict[int, bytes]] = {}


class HashRing:
    """An immutable consistent-hash ring over string keys.

    :param keys: the owners, in a stable order (duplicates are ignored).
    :param virtual_nodes: points per owner; more points spread keys more evenly
        (the spread of one owner's share shrinks like ``1/sqrt(virtual_nodes)``).
    """

    __slots__ = ("_members", "_owners", "_points", "keys")

    def __init__(self, keys: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        self.keys: tuple[str, ...] = tuple(dict.fromkeys(keys))
        if len(self.keys) > _MASK32:
            raise ValueError("a ring holds at most 2**32 - 1 owners")
        self._members = frozenset(self.keys)
        # One int per point, (point, owner index) packed, sorted in C: the (astronomically
        # rare) point collisions stay deterministic, and no tuple is made per point.
        packed: list[int] = []
        for idx, key in enumerate(self.keys):
            packed += [(p << 32) | idx for p in owner_points(key, virtual_nodes)]
        packed.sort()
        self._points = [x >> 32 for x in packed]
        self._owners = [x & _MASK32 for x in packed]

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self._members

    def walk(self, point: int) -> Iterator[str]:
        """Owners clockwise from ``point``, each owner once."""
        points = self._points
        if not points:
            return
        n_points = len(points)
        start = bisect.bisect_left(points, point & _MASK64)
        seen: set[int] = set()
        remaining = len(self.keys)
        owners = self._owners
        for step in range(n_points):
            idx = owners[(start + step) % n_points]
            if idx in seen:
                continue
            seen.add(idx)
            yield self.keys[idx]
            remaining -= 1
            if remaining == 0:
                return

    def arcs(self) -> list[float]:
        """Each owner's fraction of the circle, in :attr:`keys` order: the share of
        uniformly hashed keys it takes (for measuring a ring, not for placing)."""
        points, owners = self._points, self._owners
        out = [0] * len(self.keys)
        for i, p in enumerate(points):
            out[owners[i]] += p - (points[i - 1] if i else points[-1] - (1 << 64))
        return [a / (1 << 64) for a in out]

    def owner(self, point: int) -> str | None:
        """The first owner clockwise from ``point`` (``None`` on an empty ring)."""
        points = self._points
        if not points:
            return None
        at = bisect.bisect_left(points, point & _MASK64)
        return self.keys[self._owners[at if at < len(points) else 0]]


def load_bound(load: Mapping[str, int], keys: Iterable[str], load_factor: float) -> int:
    """The most requests a candidate may hold *after* one more placement.

    ``ceil(load_factor * (total + 1) / n)``, where ``total`` is the in-flight load
    over the ``n`` candidates in ``keys`` (at least one).
    """
    total = 0
    n = 0
    for k in keys:
        total += load.get(k, 0)
        n += 1
    return math.ceil(load_factor * (total + 1) / n)


def bounded_load_pick(
    ring: HashRing,
    point: int,
    eligible: Sequence[Candidate],
    load: Mapping[str, int],
    load_factor: float | None,
) -> Candidate:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

    Walk clockwise from ``point`` and take the first eligible candidate whose load
    *after* this placement stays within ``ceil(load_factor * (total + 1) / n)``,
    where ``total`` is the in-flight load over the ``n`` eligible candidates.
    Counting the new request in ``total + 1`` is what keeps the bound from ever
    refusing everyone: if every candidate were at the bound, the loads would add
    up to more than ``total``. ``load_factor=None`` disables the bound (strict
    affinity). Eligible candidates missing from the ring (a caller that did not
    pass the fleet) are tried after the ring's owners, in their given order.
    """
    by_key = {c.key: c for c in eligible}
    bound: float = math.inf
    if load_factor is not None:
        bound = float(load_bound(load, by_key, load_factor))
    first: Candidate | None = None
    for key in ring.walk(point):
        cand = by_key.get(key)
        if cand is None:
            continue
        if first is None:
            first = cand
        if load.get(key, 0) + 1 <= bound:
            return cand
    for cand in eligible:
        if cand.key not in ring and load.get(cand.key, 0) + 1 <= bound:
            return cand
    # Unreachable with a bound (the minimum load always fits it); kept so that a
    # caller passing inconsistent loads still gets a candidate.
    return first if first is not None else eligible[0]  # pragma: no cover
