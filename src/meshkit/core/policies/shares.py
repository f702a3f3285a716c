"""
Traffic shares: a placement plan every router computes alike
=============================================================

Many independent routers over one fleet agree on where a prefix goes only when
their choice is a function of things they all see alike. In-flight counts are
not (each router sees its own requests), spill memories are not (each remembers
its own spills). What *is* alike: behind any load balancer every router gets a
random sample of the same traffic, so each one's estimate of **what fraction of
the traffic each prefix is** converges to the same numbers.

:class:`TrafficShares` keeps those fractions (decayed counts per prefix point,
bounded) and turns them into a :class:`Plan`, the way consistent hashing with
bounded loads places keys, but on expected shares instead of instantaneous load:

* a prefix whose share is above ``fit / n`` (``n`` workers) is cut into
  ``ceil(share / (fit / n))`` equal *slots*, so one tenant hotter than a worker's
  fair share spreads over a second (third…) worker;
* prefixes are placed hottest first; their slots are the first workers
  clockwise from the prefix's ring point that the hotter prefixes did not fill
  (planned share below ``fit / n``), then the filled ones;
* traffic outside the tracked hot prefixes is spread evenly as background;
* a prefix not in the plan goes to the first worker on its walk that the plan
  did not fill.

A request of a prefix with several slots picks one by :func:`jump_hash` of its
conversation's point: every turn of a conversation takes the same slot, and when
a prefix gains a slot only ``1/slots`` of its conversations move.

Noise: at ``K`` routers each estimate rests on ``1/K`` of the requests, so the
shares differ a little between routers and a prefix near a worker's limit may be
planned differently; the plan is recomputed after 8, 16, 32, … observations,
then every :data:`REPLAN_EVERY`, and when the fleet changes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

from meshkit.core.policies.ring import HashRing

__all__ = ["REPLAN_EVERY", "SLOT_FRACTION", "Decayed", "Plan", "TrafficShares", "jump_hash"]

K = TypeVar("K", bound=Hashable)

#: observations between two plans once the first ones are made
REPLAN_EVERY = 128
#: a slot's share of the traffic, as a fraction of one worker's planned share
SLOT_FRACTION = 0.25
#: prefixes below this fraction of a worker's share are background, not planned
_HOT_FRACTION = 0.125
_MASK64 = (1 << 64) - 1


class Decayed(Generic[K]):
    """Values per key, decayed with a half-life, in O(1) per update: values are kept
    scaled by ``2 ** (t / half_life)`` from one origin, so they all age together;
    the origin moves forward before the scale gets large."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._t0 = 0.0
        self._scaled: dict[K, float] = {}

    def _scale(self, now: float) -> float:
        exp = (now - self._t0) / self.half_life_s
        if exp > 64 or exp < 0:  # rebase (or a clock that went back)
            k = 2.0 ** -max(min(exp, 1e6), 0.0)
            self._scaled = {key: v * k for key, v in self._scaled.items() if v * k > 1e-9}
            self._t0, exp = now, 0.0
        return float(2.0**exp)

    def add(self, key: K, work: float, now: float) -> None:
        self._scaled[key] = self._scaled.get(key, 0.0) + work * self._scale(now)

    def values(self, keys: Sequence[K], now: float) -> list[float]:
        scale = self._scale(now)
        get = self._scaled.get
        return [get(k, 0.0) / scale for k in keys]

    def items(self, now: float) -> list[tuple[K, float]]:
        scale = self._scale(now)
        return [(k, v / scale) for k, v in self._scaled.items()]

    def at_least(self, floor: float, now: float) -> list[tuple[K, float]]:
        """The items whose value is ``floor`` or more (one pass, no copy of the rest)."""
        scale = self._scale(now)
        cut = floor * scale
        return [(k, v / scale) for k, v in self._scaled.items() if v >= cut]

    def forget(self, keys: Iterable[K]) -> None:
        for key in keys:
            self._scaled.pop(key, None)

    def keep_largest(self, count: int) -> None:
        """Drop all but the ``count`` largest values."""
        scaled = self._scaled
        if len(scaled) > count:
            # A sort of the bare values in C, then one pass: several times cheaper
            # than a heap keyed by a Python lambda, and this runs on the request path.
            cut = sorted(scaled.values())[len(scaled) - count]
            kept = {k: v for k, v in scaled.items() if v > cut}
            for k, v in scaled.items():  # ties at the cut, in insertion order
                if len(kept) >= count:
                    break
                if v == cut:
                    kept[k] = v
            self._scaled = kept

    def __len__(self) -> int:
        return len(self._scaled)


def jump_hash(key: int, buckets: int) -> int:
    """Lamping and Veach's jump consistent hash: a bucket in ``[0, buckets)``; going
    from ``b`` to ``b + 1`` buckets moves only ``1/(b + 1)`` of the keys."""
    key &= _MASK64
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & _MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


class Plan:
    """The workers each hot prefix is spread over, and the workers the plan filled."""

    __slots__ = ("full", "planned", "slots")

    def __init__(
        self, slots: dict[int, tuple[str, ...]], planned: dict[str, float], full: frozenset[str]
    ) -> None:
        #: prefix point -> its slots' workers, hottest slot first
        self.slots = slots
        #: worker -> planned share of the traffic (background included)
        self.planned = planned
        #: workers whose planned share reached the limit
        self.full = full

    def workers_for(self, point: int, ring: HashRing) -> tuple[str, ...]:
        """The slots of ``point``; for a prefix not in the plan, the first worker on
        its walk the plan did not fill (the ring's owner when all are full)."""
        got = self.slots.get(point)
        if got is not None:
            return got
        full = self.full
        first = None
        for key in ring.walk(point):
            if key not in self.planned:
                continue  # on the ring, not a candidate the plan was made for
            if first is None:
                first = key
            if key not in full:
                return (key,)
        return (first,) if first is not None else ()


class TrafficShares:
    """Decayed request counts per prefix point (at most ``max_prefixes``) and the
    :class:`Plan` made from them.

    :param fit: a worker's planned share stays within ``fit / n``; ``>= 1``.
    :param half_life_s: how fast old traffic stops counting.
    :param max_prefixes: prefixes tracked; the least requested are dropped first.
    """

    def __init__(self, *, fit: float, half_life_s: float, max_prefixes: int) -> None:
        self.fit = fit
        self.max_prefixes = max_prefixes
        self._counts: Decayed[int] = Decayed(half_life_s)
        self._total: Decayed[int] = Decayed(half_life_s)
        self._seen = 0
        self._next_plan = 8
        self._plan: Plan | None = None
        self._members: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self._counts)

    def observe(self, point: int, now: float) -> None:
        """One request of the prefix at ``point``."""
        counts = self._counts
        counts.add(point, 1.0, now)
        self._total.add(0, 1.0, now)
        if len(counts) > self.max_prefixes:
            # A quarter of room at a time: the selection is O(n log k), not per request.
            counts.keep_largest(max(1, self.max_prefixes * 3 // 4))
        self._seen += 1

    def plan(self, ring: HashRing, members: Sequence[str], now: float) -> Plan:
        """The plan over ``members`` (keys on ``ring``), recomputed when due."""
        members = tuple(members)
        due = self._seen >= self._next_plan
        if due:
            # 8, 16, 32, 64, 128 observations, then every REPLAN_EVERY
            nxt = self._next_plan
            self._next_plan = nxt * 2 if nxt < REPLAN_EVERY else self._seen + REPLAN_EVERY
        if due or self._plan is None or members != self._members:
            self._plan = self._make(ring, members, now)
            self._members = members
        return self._plan

    def forget(self) -> None:
        """Start over (the fleet changed shape in a way the shares do not survive)."""
        self._plan = None

    def _make(self, ring: HashRing, members: tuple[str, ...], now: float) -> Plan:
        n = len(members)
        planned = dict.fromkeys(members, 0.0)
        if not n:
            return Plan({}, planned, frozenset())
        total = self._total.values([0], now)[0]
        limit = self.fit / n
        hot: list[tuple[float, int]] = []
        if total > 0:
            floor = _HOT_FRACTION * limit * total
            hot = [(v / total, p) for p, v in self._counts.at_least(floor, now)]
        # Hottest first; the point breaks ties the same way in every process.
        hot.sort(key=lambda sp: (-sp[0], sp[1]))
        background = max(0.0, 1.0 - sum(s for s, _ in hot)) / n
        for key in members:
            planned[key] = background
        slots: dict[int, tuple[str, ...]] = {}
        unit = limit * SLOT_FRACTION
        for share, point in hot:
            # The first workers of the prefix's own walk that hotter prefixes did
            # not fill, not a best fit: a small difference in a cooler prefix's
            # estimate (another router's sample) never moves a hotter one.
            count = min(n, max(1, math.ceil(share / unit - 1e-9)))
            walk = [k for k in ring.walk(point) if k in planned]
            room = [k for k in walk if planned[k] < limit - 1e-12]
            chosen = tuple(
                itertools.islice(itertools.chain(room, (k for k in walk if k not in room)), count)
            )
            part = share / len(chosen)
            for key in chosen:
                planned[key] += part
            slots[point] = chosen
        full = frozenset(k for k, v in planned.items() if v >= limit - 1e-12)
        return Plan(slots, planned, full)
