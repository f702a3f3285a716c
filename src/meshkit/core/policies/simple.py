"""Round robin, random, power of two choices and least load."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from meshkit.core.policies.base import BasePolicy, Needs, PlacementContext
from meshkit.core.workers import Candidate

__all__ = ["LeastLoad", "PowerOfTwo", "RandomPolicy", "RoundRobin"]


# Compiled in a wheel (hatch_build.py); a plugin may still subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class RoundRobin(BasePolicy):
    """Each placement takes the next candidate of the fleet's stable order.

    The cursor walks the *whole* fleet order and skips ineligible candidates, so
    two meshes that see the same sequence of requests pick the same workers, and a
    filtered request does not shift the rotation of the others.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, ctx: PlacementContext) -> Candidate:
        order = ctx.fleet or ctx.candidates
        n = len(order)
        if n:
            # The candidate at the cursor is usually eligible: found by identity,
            # it is what the walk below would pick, without building a key set.
            at = order[self._next % n]
            for c in ctx.candidates:
                if c is at:
                    self._next = (self._next + 1) % n
                    return at
        allowed = {c.key for c in ctx.candidates}
        for step in range(n):
            cand = order[(self._next + step) % n]
            if cand.key in allowed:
                self._next = (self._next + step + 1) % n
                return cand
        return ctx.candidates[0]  # pragma: no cover - candidates is never empty


# Compiled in a wheel (hatch_build.py); a plugin may still subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class RandomPolicy(BasePolicy):
    name = "random"

    def select(self, ctx: PlacementContext) -> Candidate:
        return ctx.candidates[ctx.rng.randrange(len(ctx.candidates))]


# Compiled in a wheel (hatch_build.py); a plugin may still subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class PowerOfTwo(BasePolicy):
    """The less loaded (in-flight requests) of two random candidates."""

    name = "power_of_two"

    def select(self, ctx: PlacementContext) -> Candidate:
        cands = ctx.candidates
        if len(cands) == 1:
            return cands[0]
        a, b = ctx.rng.sample(range(len(cands)), 2)
        ca, cb = cands[a], cands[b]
        return ca if ctx.load_of(ca) <= ctx.load_of(cb) else cb


# Compiled in a wheel (hatch_build.py); a plugin may still subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class LeastLoad(BasePolicy):
    """The candidate with the least in-flight work, weighted by prompt size.

    Score = in-flight requests + (in-flight prompt characters + this request's)
    / ``chars_per_request``. For workers that publish KV events both are the
    *uncached* part: a lease weighs what its engine still had to compute
    (:func:`~meshkit.core.placement.uncached_weight`), and this request costs less
    on a worker that holds its prefix. Ties go to the fleet order, so the choice is
    deterministic.
    """

    name = "least_load"
    needs = Needs(kv_events=True)

    def __init__(self, chars_per_request: int = 4096) -> None:
        self.chars_per_request = max(1, chars_per_request)

    def select(self, ctx: PlacementContext) -> Candidate:
        per = self.chars_per_request
        cands = ctx.candidates
        held = _held(ctx)
        view = ctx.view
        own, n_ids = view.prompt_weight, len(view.prompt_ids or ()) or 1
        best = cands[0]
        best_score = float("inf")
        for c in cands:
            cost = own - own * held.get(c.worker.id, 0) // n_ids if held else own
            score = ctx.load.get(c.key, 0) + (ctx.weight.get(c.key, 0) + cost) / per
            if score < best_score:
                best, best_score = c, score
        return best


def _held(ctx: PlacementContext) -> dict[str, int]:
    """Per worker with KV events, how many of the prompt's tokens it holds."""
    ids, kv = ctx.view.prompt_ids, ctx.kv
    if not ids or kv is None:
        return {}
    covered = [c.worker.id for c in ctx.candidates if kv.covers(c.worker.id)]
    return kv.match(ids, covered, ctx.view.kv_keys, ctx.view.model) if covered else {}
