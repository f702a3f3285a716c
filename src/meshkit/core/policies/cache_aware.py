"""
Cache-aware placement
=====================

``cache_aware`` keeps an approximate :class:`~meshkit.core.policies.radix.RadixTree`
per model of the routing texts it sent to each worker origin (DP ranks of one
origin share one KV cache, so the origin is the tenant), and sends a request to
the worker that most likely still holds the longest prefix of it.

Selection, for the eligible candidates:

1. The match rate of an origin is ``matched characters / len(text)``.
2. If the best rate exceeds ``cache_threshold``, the candidates above the
   threshold are tried in order: first those within ``match_slack_chars`` of the
   best match (about one KV block: a few more matching characters do not justify
   a longer queue), least loaded first; then the others by descending match. The
   first one that is not *hot* wins. A candidate is hot when its in-flight load
   exceeds both ``balance_rel_threshold`` times the mean load and the mean plus
   ``balance_abs_threshold``. The gate is per candidate: a hot best match spills
   to the next-best match (or to the least loaded), while a moderately loaded
   best match keeps its requests. The slack matters for shared system prompts:
   without it, a request that happens to share two more characters with one
   worker's history (``"user: H"``) pins a whole tenant to that worker.
3. Otherwise (a cache miss) the least-loaded candidate wins. Ties go to a hash of
   the prompt's first ``spill_prefix_chars`` characters, not to the fleet order:
   misses of different heads spread over all idle replicas instead of all landing
   on the first one (sglang#32983), and every router sends the misses of one head
   (a tenant's system prompt, a conversation) to the same worker, whose cache then
   serves the rest, as the spill does.

:meth:`CacheAware.on_placed` inserts the text for the chosen origin with the
caller's ``now``. Each model's tree has one character budget, ``max_tree_size``,
shared by all workers; inserts beyond it evict least recently used leaves.
:meth:`CacheAware.sweep` lets a caller enforce the budget and, with ``ttl_s``,
forget prefixes idle for longer than that. :meth:`CacheAware.on_removed` forgets
a worker's origin everywhere.

The model name comes from the client, so the number of trees is capped too
(``max_models``, least recently used first): memory stays below
``max_models * max_tree_size`` characters whatever clients send.

.. code-block:: toml

    policy = "cache_aware"
    [policies.cache_aware]
    cache_threshold = 0.3
    max_tree_size = 2000000
    match_chars = 65536

.. autoclass:: CacheAware
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final

from mypy_extensions import mypyc_attr

from meshkit.core.policies.base import BasePolicy, Needs, PlacementContext
from meshkit.core.policies.prefix_hash import PrefixHash, answers_after, conversation_head
from meshkit.core.policies.radix import RadixTree
from meshkit.core.policies.shares import Decayed, OwnTurns
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker, candidates_for
from meshkit.errors import ConfigError

__all__ = ["CacheAware", "least_loaded"]


def _spread_key(digest: bytes, cand: Candidate) -> bytes:
    # Rendezvous hashing: each (text, candidate) pair gets its own rank, so equal
    # loads are broken differently for different texts yet the same way each time.
    return hashlib.blake2b(digest + cand.key.encode("utf-8"), digest_size=8).digest()


#: running-conversation turns counted before judging whether others place them
_DECIDE_AFTER: Final = 4.0


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _past_share(counts: Sequence[float], factor: float, slack: float) -> list[bool]:
    """Which counts would pass ``max(ceil(factor * share), share + slack)`` with one more."""
    share = (sum(counts) + 1) / len(counts)
    bound = max(math.ceil(factor * share), share + slack)
    return [r + 1 > bound for r in counts]


def least_loaded(cands: Sequence[Candidate], loads: Sequence[int], text: str) -> Candidate:
    """The least-loaded candidate; ties are spread by a hash of ``text``."""
    low = min(loads)
    ties = [c for c, load in zip(cands, loads, strict=True) if load == low]
    if len(ties) == 1:
        return ties[0]
    digest = _digest(text)
    return min(ties, key=lambda c: _spread_key(digest, c))


# Compiled in a wheel (hatch_build.py); a plugin may still subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class CacheAware(BasePolicy):
    """Route to the worker whose prefix cache most likely holds the prompt.

    :param cache_threshold: the match rate (0-1) above which the cache wins over load.
    :param balance_abs_threshold: a candidate is hot only when its load exceeds the
        mean by more than this many requests...
    :param balance_rel_threshold: ...and is more than this many times the mean.
    :param max_tree_size: characters per model tree, shared by all workers.
    :param match_chars: read, match and insert at most this many leading characters
        (``None``: the whole text). Bounds the CPU spent on very long prompts.
    :param match_slack_chars: matches this close to the best count as equally good.
    :param max_models: how many model trees to keep (least recently used dropped).
    :param ttl_s: :meth:`sweep` forgets tenancies idle for longer (``None``: never).
    :param own_turns: a router that saw the turn before of fewer than this share of
        its running conversations' turns (other routers place the turns between)
        places chats on workers without KV events as ``prefix_hash`` does, alike in
        every router, instead of by its own tree. ``0``: always the tree.
    :param ring_options: the options of that ``prefix_hash`` (the keys of
        ``[policies.prefix_hash]``). Its key is the routing text's head: this
        policy asks for no token ids (with them the benchmark's growing
        conversations lost 0.02-0.06 of the bound, for a cause not found).
    """

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 4,
        balance_rel_threshold: float = 1.2,
        max_tree_size: int = 8_000_000,
        match_chars: int | None = None,
        match_slack_chars: int = 64,
        max_models: int = 32,
        ttl_s: float | None = None,
        load_factor: float | None = 1.25,
        work_half_life_s: float = 300.0,
        spill_prefix_chars: int = 256,
        conversation_slack: float = 1.0,
        own_turns: float = 0.75,
        ring_options: Mapping[str, Any] | None = None,
    ) -> None:
        key = "policies.cache_aware."
        if load_factor is not None and not load_factor >= 1.0:
            raise ConfigError(key + "load_factor", "must be >= 1.0 or unset")
        if not work_half_life_s > 0:
            raise ConfigError(key + "work_half_life_s", "must be > 0")
        if spill_prefix_chars < 1:
            raise ConfigError(key + "spill_prefix_chars", "must be >= 1")
        if not conversation_slack >= 0:
            raise ConfigError(key + "conversation_slack", "must be >= 0")
        if not 0.0 <= own_turns <= 1.0:
            raise ConfigError(key + "own_turns", "must be 0 (off) to 1")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError(key + "cache_threshold", "must be in [0, 1]")
        if balance_abs_threshold < 0:
            raise ConfigError(key + "balance_abs_threshold", "must be >= 0")
        if not balance_rel_threshold >= 1.0:
            raise ConfigError(key + "balance_rel_threshold", "must be >= 1.0")
        if max_tree_size < 1:
            raise ConfigError(key + "max_tree_size", "must be >= 1")
        if match_chars is not None and match_chars < 1:
            raise ConfigError(key + "match_chars", "must be >= 1 or unset")
        if match_slack_chars < 0:
            raise ConfigError(key + "match_slack_chars", "must be >= 0")
        if max_models < 1:
            raise ConfigError(key + "max_models", "must be >= 1")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(key + "ttl_s", "must be > 0 or unset")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_size = max_tree_size
        self.match_chars = match_chars
        self.match_slack_chars = match_slack_chars
        self.max_models = max_models
        self.ttl_s = ttl_s
        self.load_factor = None if load_factor is None else float(load_factor)
        self.work_half_life_s = float(work_half_life_s)
        self.spill_prefix_chars = spill_prefix_chars
        self.conversation_slack = float(conversation_slack)
        self.needs = Needs(text=True, prefix_chars=match_chars, kv_events=True)
        self._trees: OrderedDict[str, RadixTree] = OrderedDict()
        self._recent: Decayed[str] = Decayed(self.work_half_life_s)
        #: conversations started lately, per candidate (first turns)
        self._starts: Decayed[str] = Decayed(self.work_half_life_s)
        self.own_turns = float(own_turns)
        #: whether other routers place this one's conversations' turns (its tree then
        #: holds a fraction of each), judged early: one router never fails the count;
        #: and what then places chats on the workers without events
        self._turns = OwnTurns(self.own_turns, least=_DECIDE_AFTER) if own_turns else None
        self._shared = _ring_policy(ring_options) if own_turns else None

    @property
    def ring_placement(self) -> bool:
        """Whether this router found that others place its conversations' turns, and
        so places chats on workers without KV events as ``prefix_hash`` does."""
        return self._turns is not None and self._turns.fails()

    # -- placement ---------------------------------------------------------------

    def _text(self, view: RequestView) -> str:
        text = view.routing_text
        return text[: self.match_chars] if self.match_chars is not None else text

    def is_hot(self, load: int, mean: float) -> bool:
        """The per-candidate spill gate."""
        return load > self.balance_rel_threshold * mean and load > mean + self.balance_abs_threshold

    def select(self, ctx: PlacementContext) -> Candidate:
        cands = ctx.candidates
        if len(cands) == 1:
            return cands[0]
        text = self._text(ctx.view)
        head = conversation_head(text, self.spill_prefix_chars * 64)
        rates, by_text, covered = self._rates(ctx, cands, text)
        turns = self._turns
        if turns is not None and head is not None and not covered and self._shared is not None:
            # A chat: its turns may come through other routers, whose trees differ.
            if not head[1] and ctx.attempt == 0:
                own = _saw_turn_before(text, head[0], by_text)
                if own is not None:
                    turns.observe(own)
            if turns.fails():
                return self._shared.select(ctx)
        loads = [ctx.load_of(c) for c in cands]
        # The bound moves new conversations; a follow-up stays with its history
        # (only the in-flight gate moves it).
        over = self._over(cands, ctx.now, head is not None) if head is None or head[1] else None
        spread = _digest(text[: self.spill_prefix_chars])
        if rates is not None:
            best = max(rates)
            if best > self.cache_threshold:
                slack = self.match_slack_chars / max(1, len(text))
                picked = self._by_match(cands, loads, spread, rates, best - slack, over)
                if picked is not None:
                    return picked
        if over:
            # Spilling: the least loaded of the rest, ties by the prompt's head (so
            # routers that read the same loads agree). The head's own ranking
            # instead, the same next worker in every router, was better at start-up
            # and worse past it (MULTI_ROUTER_LONG.md, "Where every router spills a
            # tenant").
            rest = [(c, load) for c, load, o in zip(cands, loads, over, strict=True) if not o]
            if rest:
                low = min(load for _, load in rest)
                return min(
                    (c for c, load in rest if load == low), key=lambda c: _spread_key(spread, c)
                )
        # A miss: ties by the head, as the spill, so routers agree where it goes.
        return least_loaded(cands, loads, text[: self.spill_prefix_chars])

    def _over(self, cands: Sequence[Candidate], now: float, starts: bool) -> list[bool] | None:
        """Which candidates took more than ``load_factor`` times their share of the
        recent work or, for a new conversation (``starts``), of the conversations
        started lately (None: none did, or the bound is off). In-flight counts say
        little at 1-4 requests in flight; what was placed lately does. Counting
        conversations matters when they are long: the first turn decides where all
        the others go, and a worker that took its share of requests can still have
        started twice its share of the conversations still running."""
        if self.load_factor is None:
            return None
        keys = [c.key for c in cands]
        # A few requests over the share are noise, not a hot worker (a cold start,
        # an idle fleet): the same absolute slack as the in-flight gate.
        lf = self.load_factor
        over = _past_share(self._recent.values(keys, now), lf, self.balance_abs_threshold)
        if starts:
            started = self._starts.values(keys, now)
            over = [
                a or b
                for a, b in zip(
                    over, _past_share(started, lf, self.conversation_slack), strict=True
                )
            ]
        return over if any(over) else None

    def _rates(
        self, ctx: PlacementContext, cands: Sequence[Candidate], text: str
    ) -> tuple[list[float] | None, dict[str, int], bool]:
        """Per candidate, the share of the prompt it holds: from the KV index for
        workers whose events it has (in tokens), from this router's tree for the
        others (in characters); None: nothing to match. Also the tree's matches
        (characters per origin) and whether any candidate is on events."""
        ids, kv = ctx.view.prompt_ids, ctx.kv
        by_events: dict[str, int] = {}
        if ids and kv is not None:
            covered = [c.worker.id for c in cands if kv.covers(c.worker.id)]
            if covered:
                by_events = kv.match(ids, covered, ctx.view.kv_keys, ctx.view.model)
        tree = self._trees.get(ctx.view.model or "")
        by_text: dict[str, int] = {}
        if text and tree is not None and len(by_events) < len(cands):
            by_text = tree.match(text, {c.origin for c in cands})
        if not by_events and not by_text:
            return None, by_text, bool(by_events)
        n_ids, n_text = len(ids or ()) or 1, len(text) or 1
        rates = [
            by_events[c.worker.id] / n_ids
            if c.worker.id in by_events
            else by_text.get(c.origin, 0) / n_text
            for c in cands
        ]
        return rates, by_text, bool(by_events)

    def _by_match(
        self,
        cands: Sequence[Candidate],
        loads: Sequence[int],
        spread: bytes,
        rates: Sequence[float],
        near: float,
        over: Sequence[bool] | None,
    ) -> Candidate | None:
        floor = self.cache_threshold
        ranked = []
        for i, c in enumerate(cands):
            m = rates[i]
            if m > floor and (over is None or not over[i]):
                # Near-best matches rank by load alone; farther ones by match first.
                ranked.append(
                    (m < near, 0.0 if m >= near else -m, loads[i], _spread_key(spread, c), i)
                )
        ranked.sort()
        mean = sum(loads) / len(cands)
        for *_, i in ranked:
            if not self.is_hot(loads[i], mean):
                return cands[i]
        return None

    # -- learning ----------------------------------------------------------------

    def tree(self, model: str | None) -> RadixTree | None:
        """The tree of ``model`` (``None`` until something was placed for it)."""
        return self._trees.get(model or "")

    def on_placed(self, cand: Candidate, view: RequestView, now: float) -> None:
        self._recent.add(cand.key, 1.0, now)
        text = self._text(view)
        if not text:
            return
        head = conversation_head(text, self.spill_prefix_chars * 64)
        if head is not None and head[1]:
            self._starts.add(cand.key, 1.0, now)
        model = view.model or ""
        tree = self._trees.get(model)
        if tree is None:
            tree = self._trees[model] = RadixTree(self.max_tree_size)
            while len(self._trees) > self.max_models:
                self._trees.popitem(last=False)
        else:
            self._trees.move_to_end(model)
        tree.insert(text, cand.origin, now)

    def on_removed(self, worker: Worker) -> None:
        if self._shared is not None:
            self._shared.on_removed(worker)
        keys = [c.key for c in candidates_for(worker)]
        self._recent.forget(keys)
        self._starts.forget(keys)
        for model, tree in list(self._trees.items()):
            tree.remove_tenant(worker.origin)
            if not tree.node_count:
                del self._trees[model]

    def sweep(self, now: float) -> int:
        """Enforce every budget and expire idle tenancies (with ``ttl_s``).

        Meant for a periodic caller; inserts already keep each tree in budget.

        :returns: the number of characters freed.
        """
        freed = 0
        for model, tree in list(self._trees.items()):
            if self.ttl_s is not None:
                freed += tree.sweep(now - self.ttl_s)
            freed += tree.evict_to(self.max_tree_size)
            if not tree.node_count:
                del self._trees[model]
        return freed


def _ring_policy(options: Mapping[str, Any] | None) -> PrefixHash:
    key = "policies.cache_aware.ring_options"
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(key, "must be a table of prefix_hash options")
    try:
        return PrefixHash(**dict(options or {}))
    except ConfigError as exc:
        raise ConfigError(f"{key}.{exc.key.rsplit('.', 1)[-1]}", exc.message) from None
    except TypeError as exc:
        raise ConfigError(key, f"not a prefix_hash option: {exc}") from None


def _saw_turn_before(text: str, head_end: int, by_text: dict[str, int]) -> bool | None:
    """Whether this router placed the turn before this one (its tree holds the
    conversation up to the previous answer). None: the tree holds the whole text
    (a retry, or a text cut at ``match_chars``): nothing to judge."""
    matched = max(by_text.values(), default=0)
    if matched < head_end:
        return False  # never saw the conversation
    steps = answers_after(text, matched)
    return None if steps == 0 else steps == 1
