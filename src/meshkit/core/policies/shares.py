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
bounded) and turns them into a :class:`Plan`:

* each prefix's *owner*, the first worker of its ring walk, keeps up to
  ``cap = owner_share / n`` of the traffic: all of a small prefix, and of a
  hotter one the conversations whose hash (:func:`unit_interval`) falls under
  ``cap / share``;
* a worker that owns more than its fair share ``1 / n`` sheds the excess, so the
  ring's draw never overloads it: its prefixes in point order, whole prefixes first
  and the last one split (the split moves continuously with the estimates). What a
  small prefix (one under the cap) sheds goes to its *heir*, the next worker of its
  ring walk that owns no more than its share, so the prefix is cached on one or two
  workers, not spread over the pool;
* the rest of every prefix is the *pool*; it fills the workers least planned
  first (water-filling) until the planned shares are level. The pooled prefixes
  lie on the pool's line one after another in point order, each on a segment as
  long as its pooled share, and a pool conversation picks the point of its
  prefix's segment its second hash (:func:`mix64`) gives, the workers in key
  order along the line. A prefix is then cached on the pool workers its
  segment spans (one or two unless it is longer than a worker's stretch), not
  on every one: under a cache that holds little more than the tenants' system
  prompts, every extra copy evicts another tenant's.
  A segment's start depends on the estimates of the prefixes before it, which
  routers that have seen few requests disagree on, so a router puts only
  ``recent requests / PACK_AFTER`` of the pooled conversations on the segments
  (a third hash decides which) and spreads the rest over the whole line;
* prefixes under an eighth of the cap are background (they go to their owner and
  count as spread evenly).

Every threshold moves continuously with the estimates. Two routers whose
estimates differ a little send only the conversations whose hashes fall between
their thresholds to different workers, never a whole prefix: a plan of steps
(whole slots, a worker "filled" or not) moves every conversation of a prefix
whose estimate straddles a step, and at K routers the mid-sized prefixes do.

Noise: at ``K`` routers each estimate rests on ``1/K`` of the requests, so the
shares differ a little between routers; the plan is recomputed after 1, 2, 4, 8,
… observations, then every :data:`REPLAN_EVERY`, and when the fleet changes. (A
first plan kept until the eighth request sent the second to seventh tenants to
their ring owners whatever those already held.)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Final, Generic, TypeVar

from meshkit.core.policies.ring import HashRing

__all__ = [
    "REPLAN_EVERY",
    "Decayed",
    "OwnTurns",
    "Plan",
    "TrafficShares",
    "mix64",
    "unit_interval",
]

K = TypeVar("K", bound=Hashable)

#: observations between two plans once the first ones are made
REPLAN_EVERY: Final = 128
#: recent observations (decayed) at which every pooled conversation lies on its
#: prefix's segment; under it, that part grows in proportion
PACK_AFTER: Final = 512.0
#: prefixes below this fraction of the owner's cap are background, not planned
_BACKGROUND: Final = 0.125
_MASK64: Final = (1 << 64) - 1
#: a third draw from a conversation point: on its prefix's segment or not
_PACK_SALT: Final = 0x5BD1E9955BD1E995
_MASK53: Final = (1 << 53) - 1
_TO_UNIT: Final = 1.0 / (1 << 53)


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


#: running-conversation turns over which a router judges whether it sees its
#: conversations' turns itself (older ones count half, then a quarter...)
_TURNS_WINDOW: Final = 64.0


class OwnTurns:
    """Whether this router sees its conversations' turns one after another.

    It does when it is the only router, or when the balancer in front keeps a
    conversation on one router: what it places off the deterministic plan is then
    found again, by this router alone. Behind a balancer that deals turns over K
    routers it sees the turn before about ``1/K`` of the time. Judged over the
    last ~64 running-conversation turns, once ``least`` were counted; until then
    it neither :meth:`holds` nor :meth:`fails`.

    :param threshold: the share of turns whose turn before this router saw.
    :param least: turns counted before either judgement is made.
    """

    __slots__ = ("least", "own", "seen", "threshold")

    def __init__(self, threshold: float, least: float = 16.0) -> None:
        self.threshold = threshold
        self.least = least
        self.seen = 0.0
        self.own = 0.0

    def observe(self, own: bool) -> None:
        """One running conversation's turn: did this router see the turn before it?"""
        self.seen += 1.0
        if own:
            self.own += 1.0
        if self.seen >= _TURNS_WINDOW:
            self.seen *= 0.5
            self.own *= 0.5

    def holds(self) -> bool:
        """Seen to: enough turns counted, and enough of them its own."""
        seen = self.seen
        return seen >= self.least and self.own >= self.threshold * seen

    def fails(self) -> bool:
        """Seen not to: enough turns counted, and too few of them its own."""
        seen = self.seen
        return seen >= self.least and self.own < self.threshold * seen


def unit_interval(point: int) -> float:
    """``point``'s low 53 bits as a float in ``[0, 1)``."""
    return (point & _MASK53) * _TO_UNIT


def mix64(point: int) -> int:
    """A second, independent-looking 64-bit value from ``point`` (the splitmix64
    finalizer): one conversation point gives two uncorrelated draws."""
    z = (point + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Plan:
    """Where each prefix's traffic goes: its ring owner keeps up to ``owner_share``
    of a worker's fair share, the rest joins a pool that levels the fleet."""

    __slots__ = ("_owners", "bounds", "heirs", "kept", "packed", "planned", "pool", "segments")

    def __init__(
        self,
        owners: dict[int, str],
        kept: dict[int, float],
        pool: tuple[str, ...],
        bounds: tuple[float, ...],
        planned: dict[str, float],
        heirs: dict[int, str] | None = None,
        segments: dict[int, tuple[float, float]] | None = None,
        packed: float = 1.0,
    ) -> None:
        self._owners = owners
        #: pooled prefix point -> (start, width) of its segment of the pool line
        self.segments = segments or {}
        #: the part of each pooled prefix's conversations placed on its segment
        #: (the rest anywhere on the line)
        self.packed = packed
        #: small prefix point -> the worker that takes what its owner sheds
        self.heirs = heirs or {}
        #: prefix point -> the fraction of its conversations its owner keeps (< 1)
        self.kept = kept
        #: the workers the pool fills, each with its upper bound in ``bounds``
        self.pool = pool
        self.bounds = bounds
        #: worker -> planned share of the traffic (owned, background and pool)
        self.planned = planned

    def owner(self, point: int, ring: HashRing) -> str | None:
        """The first worker on ``point``'s walk that the plan was made for."""
        got = self._owners.get(point)
        return got if got is not None else _first_member(ring, point, self.planned)

    def pooled(self, point: int, kept: float, spread: int) -> str | None:
        """Where the conversation at ``spread`` of the prefix at ``point`` goes when
        its owner keeps only ``kept`` of it (``self.kept[point]``): the prefix's heir
        or a pool worker, or ``None`` when the owner keeps it."""
        if unit_interval(spread) < kept:
            return None
        heir = self.heirs.get(point)
        if heir is not None:
            return heir
        if not self.pool:
            return None
        u = unit_interval(mix64(spread))
        seg = self.segments.get(point)
        packed = self.packed
        if seg is not None and (
            packed >= 1.0 or unit_interval(mix64(spread ^ _PACK_SALT)) < packed
        ):
            u = seg[0] + u * seg[1]
        at = bisect.bisect_right(self.bounds, u)
        return self.pool[min(at, len(self.pool) - 1)]

    def second(self, spread: int) -> str | None:
        """A pool conversation's second choice: another draw against the pool's
        shares (``None`` without a pool). A router that sees every turn of its
        conversations may take it over the first when the first is busier."""
        if not self.pool:
            return None
        at = bisect.bisect_right(self.bounds, unit_interval(mix64(mix64(spread))))
        return self.pool[min(at, len(self.pool) - 1)]

    def worker(self, point: int, spread: int, ring: HashRing) -> str | None:
        """The worker for a request of prefix ``point`` whose conversation is at
        ``spread``: the same for every turn while the plan holds, and a small change
        in the shares moves few conversations (each threshold moves continuously)."""
        kept = self.kept.get(point)
        got = None if kept is None else self.pooled(point, kept, spread)
        return got if got is not None else self.owner(point, ring)


class TrafficShares:
    """Decayed request counts per prefix point (at most ``max_prefixes``) and the
    :class:`Plan` made from them.

    :param fit: a worker's planned share stays within ``fit / n``; ``>= 1``.
    :param half_life_s: how fast old traffic stops counting.
    :param max_prefixes: prefixes tracked; the least requested are dropped first.
    """

    def __init__(self, *, owner_share: float, half_life_s: float, max_prefixes: int) -> None:
        self.owner_share = owner_share
        self.max_prefixes = max_prefixes
        self._counts: Decayed[int] = Decayed(half_life_s)
        self._total: Decayed[int] = Decayed(half_life_s)
        self._seen = 0
        self._next_plan = 1
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
            # 1, 2, 4, ... 128 observations, then every REPLAN_EVERY
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
        owners: dict[int, str] = {}
        kept: dict[int, float] = {}
        total = self._total.values([0], now)[0]
        if not n or total <= 0:
            return Plan(owners, kept, (), (), planned)
        cap = self.owner_share / n
        # Prefixes below an eighth of the cap are background: each one's owner
        # changes by less than that when it crosses, and walking the ring for all
        # of ``max_prefixes`` at every plan would cost more than the placement.
        tracked = self._counts.at_least(cap * _BACKGROUND * total, now)
        owned: list[tuple[int, str, float, float]] = []  # point, owner, share, own
        by_owner = dict.fromkeys(members, 0.0)
        for point, count in tracked:
            share = count / total
            owner = _first_member(ring, point, planned)
            if owner is None:
                continue
            own = min(share, cap)
            owned.append((point, owner, share, own))
            by_owner[owner] += own
        background = max(0.0, 1.0 - sum(share for _, _, share, _ in owned)) / n
        room = max(0.0, 1.0 / n - background)
        # A worker that owns more than its fair share sheds the excess from its
        # prefixes in point order: whole prefixes, and one split at the boundary,
        # which moves continuously with the estimates. A fraction shed from every
        # prefix would cache each of them twice.
        excess = {key: max(0.0, v - room) for key, v in by_owner.items()}
        fits = {key for key, v in by_owner.items() if v <= room}
        owned.sort()
        for key in members:
            planned[key] = background
        heirs: dict[int, str] = {}
        spilled: list[tuple[int, float]] = []
        for point, owner, share, own in owned:
            whole = own == share
            cut = min(own, excess[owner])
            if cut > 0.0:
                excess[owner] -= cut
                own -= cut
            planned[owner] += own
            owners[point] = owner
            if share - own > 1e-12:
                kept[point] = own / share
                heir = _heir(ring, point, owner, fits) if whole else None
                if heir is not None:
                    # Spread over the pool, a small prefix would be cached everywhere
                    # and its few conversations would each miss it somewhere new.
                    heirs[point] = heir
                    planned[heir] += share - own
                else:
                    spilled.append((point, share - own))
        pooled = sum(part for _, part in spilled)
        pool, bounds = _level(planned, pooled)
        # Each pooled prefix takes one segment of the pool's line, in point order:
        # it is cached on the few pool workers its segment spans.
        segments: dict[int, tuple[float, float]] = {}
        at = 0.0
        for point, part in spilled:
            width = part / pooled
            segments[point] = (at, width)
            at += width
        # Where each prefix's segment starts depends on the estimates of the ones
        # before it: routers that have seen few requests disagree on it more than
        # on a spread over the whole pool, so they put fewer conversations on it.
        packed = min(1.0, total / PACK_AFTER)
        return Plan(owners, kept, pool, bounds, planned, heirs, segments, packed)


def _first_member(ring: HashRing, point: int, members: dict[str, float]) -> str | None:
    """The first of ``members`` clockwise from ``point``: the ring's owner (one
    bisection) unless the plan was made for fewer workers than the ring holds."""
    owner = ring.owner(point)
    if owner is None or owner in members:
        return owner
    return next((k for k in ring.walk(point) if k in members), None)


def _heir(ring: HashRing, point: int, owner: str, fits: set[str]) -> str | None:
    """The first worker after ``owner`` on ``point``'s walk that owns no more than
    its share (one of ``fits``), or ``None``."""
    for key in ring.walk(point):
        if key != owner and key in fits:
            return key
    return None


def _level(planned: dict[str, float], pooled: float) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Water-fill ``pooled`` onto the least planned workers (updating ``planned``):
    the pool's workers in key order (the same in every process) and the cumulative
    fraction of the pool each one ends at."""
    if pooled <= 0:
        return (), ()
    levels = sorted(planned.values())
    level, left = levels[0], pooled
    for i in range(len(levels)):
        nxt = levels[i + 1] if i + 1 < len(levels) else math.inf
        need = (nxt - level) * (i + 1)
        if need >= left:
            level += left / (i + 1)
            break
        left -= need
        level = nxt
    pool: list[str] = []
    bounds: list[float] = []
    acc = 0.0
    for key in sorted(planned):
        part = level - planned[key]
        if part > 1e-12:
            planned[key] = level
            acc += part
            pool.append(key)
            bounds.append(acc / pooled)
    return tuple(pool), tuple(bounds)
