"""
Prefix hash
===========

``prefix_hash`` sends requests that start the same way to the same worker, so the
worker's prefix (KV) cache stays warm.

The key is the first ``prefix_token_count`` token ids when the prepare stage has
a tokenizer (it fills :attr:`~meshkit.core.requests.RequestView.token_ids`), and
otherwise the first ``prefix_chars`` characters of the routing text. Without a
tokenizer the character prefix is an approximation: two prompts that share 1,024
characters usually share their first ~250 tokens too. A chat whose first user
message ends within the first ``prefix_chars`` characters is keyed by its text up
to there instead: a longer key takes in the first answers, and each turn of it
would have another owner. Such a chat shares nothing to spread, so it goes to its
ring owner whatever the traffic-share plan says (below).

The key is hashed onto a :class:`~meshkit.core.policies.ring.HashRing` built over
the *whole* fleet (healthy or not) and rebuilt only when the fleet's version
changes, so a worker that fails a health check and comes back gets its keys back,
and a join or leave moves about ``1/N`` of the keys. The first eligible owner
clockwise from the key is the prefix's *owner*.

Hot prefixes are bounded: a candidate takes a request only while its in-flight
load after it stays within ``ceil(load_factor * (total + 1) / n)`` (consistent
hashing with bounded loads), so one popular system prompt spills over several
workers instead of pinning all traffic to one (production-stack#957).

Conversations keep their worker through a spill
-----------------------------------------------

A 256-token key covers a tenant's system prompt, not the conversation: every
conversation of a hot tenant has the same key and the same owner, and the bound
spills part of them. A spill decided per request sends a conversation's turns
wherever load allows at that moment, and each move re-computes the whole
history on a cold worker. So, for chat-shaped requests:

- A request's *conversation* is its routing text up to the end of its first user
  message (the routing text is ``role\\ncontent`` per message, joined by
  newlines, see :mod:`meshkit.core.requests`), looked for in the first
  ``conversation_chars`` characters. Its hash (the prefix key plus the last 512
  characters of that head) is the same for every turn of the conversation.
- A spilled request walks the ring from its *conversation's* point, not from the
  prefix's, so the spill of one hot prefix spreads over the fleet and a given
  conversation spills to the same worker in every process. A new conversation
  (no assistant message yet) takes the less loaded of the first two acceptable
  workers on that walk.
- Every conversation this router places is remembered (a bounded LRU map of
  ``spill_memory`` conversation hashes to the candidate and how far into the
  routing text this router saw it), and its next turn goes back there while that
  worker is within the bound. When the new turn holds more than one answer past
  what this router saw, other routers took the turns between; they followed the
  ring (or the plan), and so does this one.
- A new conversation goes to the prefix's owner only while the owner's load,
  after it, stays within ``ceil(first_turn_load_factor * (total + 1) / n)``
  (``1.0``: the mean). Moving a new conversation costs a system prompt; moving a
  running one costs its history, so the owner's headroom is kept for the turns
  of conversations it already holds.

Requests without that shape (plain completions, token ids only) are placed as
before: the owner, then the ring clockwise from the prefix.

Placement is deterministic: the same fleet, loads and history of spills give the
same choice in every process (hashes are blake2b, never :func:`hash`). With no
load the choice depends on the prefix only. The memory is per process: a
second mesh that did not see a spill sends the conversation's next turn to the
owner when the owner has room, else to the same spill target.

One router, or a router behind a balancer that keeps conversations together
----------------------------------------------------------------------------

A hash places each conversation by a draw: 64 conversations over 4 workers land
up to 1.4 times the mean on one of them. Only a placement by load balances
better, and only the router that made it can find it again. So each router
counts, over its running conversations' last ~64 turns, how often it saw the
turn before (the memory above). When that is at least ``own_turns`` (and it has
counted 16), no other router takes its conversations' turns: a new conversation
of a hot prefix then takes the one of two draws from the plan's pool that started
fewer conversations lately, and its next turns follow it there. Behind a
balancer that spreads turns over K routers a router sees the turn before about
1/K of the time and places by the plan's first draw alone, which every router
makes alike.

Traffic shares
--------------

With ``owner_share`` set (the default), a prefix's worker comes from a plan made
of each prefix's share of recent traffic (:mod:`meshkit.core.policies.shares`):
the one thing K independent routers see alike. A prefix's ring owner keeps up to
``owner_share`` of a worker's fair share of it; the rest of a hot prefix fills the
workers the owners left under theirs, a conversation picking its worker by hash
within the prefix's own stretch of that pool (so a tenant is cached on its owner
and the few workers its stretch spans, not on all).
The in-flight bound becomes a guard against bursts (``burst_factor``).

Choose ``prefix_token_count`` deeper than prompts' shared part (a common system
prompt plus tools) when requests are single-turn: a key that covers only the
shared part sends every request to the same place and leaves the load bound to
do all the balancing.

.. code-block:: toml

    policy = "prefix_hash"
    [policies.prefix_hash]
    prefix_token_count = 256
    load_factor = 1.25
    first_turn_load_factor = 1.0
    spill_memory = 16384
    owner_share = 0.25
    own_turns = 0.75

.. autoclass:: PrefixHash
.. autofunction:: conversation_head
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Final

from mypy_extensions import mypyc_attr

from meshkit.core.policies.base import BasePolicy, Needs, PlacementContext
from meshkit.core.policies.ring import (
    DEFAULT_VIRTUAL_NODES,
    HashRing,
    bounded_load_pick,
    hash_bytes,
    hash_token_ids,
)
from meshkit.core.policies.shares import Decayed, OwnTurns, Plan, TrafficShares
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker, candidates_for
from meshkit.errors import ConfigError

__all__ = ["PrefixHash", "RingCache", "answers_after", "conversation_head"]

#: characters at the end of a conversation's head hashed into its key
_HEAD_TAIL: Final = 512
_USER: Final = "\nuser\n"
_ASSISTANT: Final = "\nassistant\n"


def answers_after(text: str, seen: int) -> int:
    """How many answers a chat routing text holds past its first ``seen``
    characters: the turns placed since a router saw it that far (1: only the
    turn before this one). A match may end inside an answer's marker."""
    return text.count(_ASSISTANT, max(0, seen - len(_ASSISTANT) + 1))


def conversation_head(text: str, limit: int) -> tuple[int, bool] | None:
    """Where a chat routing text's first user message ends, and whether it is a new chat.

    Returns ``(end, first)``: ``text[:end]`` runs to the end of the first user
    message (or to ``limit`` when that message ends later), the same for every
    turn of the conversation; ``first`` is true when the text has no assistant
    message yet. ``None`` when there is no user message in the first ``limit``
    characters (not a chat, or a very long system prompt).
    """
    if text.startswith("user\n"):
        start = 0
    else:
        start = text.find(_USER, 0, limit) + 1
        if start == 0:
            return None
    end = text.find(_ASSISTANT, start + 4, limit)
    if end >= 0:
        return end, False
    if len(text) <= limit:
        return len(text), True
    # The head runs past the window: every turn has the same first ``limit``
    # characters, and whether this one is the first is not known.
    return limit, False


class RingCache:
    """A ring over ``ctx.fleet``, rebuilt only when ``ctx.fleet_version`` changes.

    When a caller passes no fleet, the eligible candidates stand in and the ring
    is keyed by their keys instead (tests, embedded use).
    """

    __slots__ = ("_ring", "_stamp", "virtual_nodes")

    def __init__(self, virtual_nodes: int) -> None:
        self.virtual_nodes = virtual_nodes
        self._ring: HashRing | None = None
        self._stamp: object = None

    def get(self, ctx: PlacementContext) -> HashRing:
        members: Sequence[Candidate] = ctx.fleet or ctx.candidates
        stamp: object
        if ctx.fleet:
            # The length guards against a caller that reuses a version number.
            stamp = (ctx.fleet_version, len(ctx.fleet))
        else:
            stamp = tuple(c.key for c in ctx.candidates)
        if self._ring is None or stamp != self._stamp:
            self._ring = HashRing([c.key for c in members], self.virtual_nodes)
            self._stamp = stamp
        return self._ring


# Compiled in a wheel (hatch_build.py); a plugin may still subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class PrefixHash(BasePolicy):
    """Bounded-load consistent hashing of the prompt prefix.

    :param prefix_token_count: how many leading token ids form the key.
    :param virtual_nodes: ring points per candidate.
    :param load_factor: a candidate takes the request while its in-flight load
        after it stays within ``ceil(load_factor * (total + 1) / n)``; ``>= 1``.
    :param prefix_chars: how many leading characters of the routing text form the
        key when there are no token ids (no tokenizer configured).
    :param first_turn_load_factor: the same bound for a new conversation on its
        prefix's owner; ``> 0`` and at most ``load_factor``.
    :param spill_memory: conversations this router remembers, each with its worker
        (least recently used forgotten first); ``0`` remembers none, and the router
        then places every turn afresh.
    :param conversation_chars: how far into the routing text the end of the first
        user message is looked for.
    :param owner_share: with the traffic-share plan, the part of a worker's fair
        share (``1 / n``) each prefix keeps on its ring owner; ``0`` turns the
        plan off.
    :param share_half_life_s: the decay of the shares.
    :param share_memory: prefixes whose share is tracked.
    :param burst_factor: with the plan, a request moves only when its worker's
        in-flight load would pass ``ceil(burst_factor * (total + n) / n)``.
    :param own_turns: with the plan, a router that itself saw the turn before at
        least this share of its running conversations' turns places a new pooled
        conversation on the less started of two draws (``1``: only when it saw
        every one).
    """

    name = "prefix_hash"

    def __init__(
        self,
        prefix_token_count: int = 256,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
        load_factor: float = 1.25,
        prefix_chars: int = 1024,
        first_turn_load_factor: float = 1.0,
        spill_memory: int = 16384,
        conversation_chars: int = 32768,
        owner_share: float = 0.25,
        share_half_life_s: float = 300.0,
        share_memory: int = 4096,
        burst_factor: float = 2.0,
        own_turns: float = 0.75,
    ) -> None:
        if prefix_token_count < 1:
            raise ConfigError("policies.prefix_hash.prefix_token_count", "must be >= 1")
        if virtual_nodes < 1:
            raise ConfigError("policies.prefix_hash.virtual_nodes", "must be >= 1")
        if not load_factor >= 1.0:
            raise ConfigError("policies.prefix_hash.load_factor", "must be >= 1.0")
        if prefix_chars < 1:
            raise ConfigError("policies.prefix_hash.prefix_chars", "must be >= 1")
        if not 0.0 < first_turn_load_factor <= load_factor:
            raise ConfigError(
                "policies.prefix_hash.first_turn_load_factor", "must be > 0 and <= load_factor"
            )
        if spill_memory < 0:
            raise ConfigError("policies.prefix_hash.spill_memory", "must be >= 0")
        if conversation_chars < 1:
            raise ConfigError("policies.prefix_hash.conversation_chars", "must be >= 1")
        if not 0.0 <= owner_share <= 1.0:
            raise ConfigError("policies.prefix_hash.owner_share", "must be 0 (off) to 1")
        if not share_half_life_s > 0:
            raise ConfigError("policies.prefix_hash.share_half_life_s", "must be > 0")
        if share_memory < 1:
            raise ConfigError("policies.prefix_hash.share_memory", "must be >= 1")
        if not burst_factor >= load_factor:
            raise ConfigError("policies.prefix_hash.burst_factor", "must be >= load_factor")
        if not 0.0 < own_turns <= 1.0:
            raise ConfigError("policies.prefix_hash.own_turns", "must be > 0 and <= 1")

        self.prefix_token_count = prefix_token_count
        self.virtual_nodes = virtual_nodes
        self.load_factor = float(load_factor)
        self.prefix_chars = prefix_chars
        self.first_turn_load_factor = float(first_turn_load_factor)
        self.spill_memory = spill_memory
        self.conversation_chars = conversation_chars
        self.needs = Needs(
            text=True,
            prefix_tokens=prefix_token_count,
            prefix_chars=max(prefix_chars, conversation_chars),
        )
        self.owner_share = float(owner_share)
        self.share_half_life_s = float(share_half_life_s)
        self.share_memory = share_memory
        self.burst_factor = float(burst_factor)
        self.own_turns = float(own_turns)
        self._shares = (
            TrafficShares(
                owner_share=owner_share, half_life_s=share_half_life_s, max_prefixes=share_memory
            )
            if owner_share
            else None
        )
        self._rings = RingCache(virtual_nodes)
        #: conversation point -> (candidate key, length of the routing text placed there)
        self._memory: OrderedDict[int, tuple[str, int]] = OrderedDict()
        #: conversations started lately, per candidate key
        self._starts: Decayed[str] = Decayed(self.share_half_life_s)
        #: whether this router saw the turn before of its conversations' turns
        self._turns = OwnTurns(self.own_turns)

    def key_point(self, ctx: PlacementContext) -> int | None:
        """The request's point on the ring, or ``None`` when it has no prefix."""
        return self._key(ctx.view, self._head(ctx.view))[0]

    def _head(self, view: RequestView) -> tuple[int, bool] | None:
        """:func:`conversation_head` within ``conversation_chars``: read once per
        request, for the key and for the conversation's point."""
        return conversation_head(view.routing_text, self.conversation_chars)

    def _key(self, view: RequestView, head: tuple[int, bool] | None) -> tuple[int | None, bool]:
        """The request's point, and whether the key is its conversation's own (a
        chat keyed up to the end of its first user message)."""
        text = view.routing_text
        # A chat whose first user message ends within the key's reach is keyed up
        # to there: a longer key would take in its answers, and each turn of it
        # would have another owner (the routers that did not place the turn
        # before follow the ring). An end at conversation_chars is the window's,
        # not the message's.
        if head is not None and head[0] < min(self.prefix_chars, self.conversation_chars):
            key = text[: head[0]]
            return hash_bytes(b"c:" + key.encode("utf-8", "surrogatepass")), True
        ids = view.token_ids
        if ids:
            return hash_token_ids(ids[: self.prefix_token_count]), False
        key = text[: self.prefix_chars]
        if key:
            return hash_bytes(b"c:" + key.encode("utf-8", "surrogatepass")), False
        return None, False

    def conversation_point(self, view: RequestView, point: int) -> tuple[int, bool] | None:
        """The conversation's point and whether it is new, or ``None`` (not a chat).

        ``point`` is the request's prefix point: two tenants whose users open
        with the same words are still two conversations.
        """
        return self._conversation_point(view, point, self._head(view))

    def _conversation_point(
        self, view: RequestView, point: int, head: tuple[int, bool] | None
    ) -> tuple[int, bool] | None:
        if head is None:
            return None
        end, first = head
        tail = view.routing_text[max(0, end - _HEAD_TAIL) : end].encode("utf-8", "surrogatepass")
        return hash_bytes(b"h:%d:" % point + tail), first

    def select(self, ctx: PlacementContext) -> Candidate:
        cands = ctx.candidates
        if len(cands) == 1:
            return cands[0]
        ring = self._rings.get(ctx)
        load = ctx.load
        head = self._head(ctx.view)
        point, own_key = self._key(ctx.view, head)
        if point is None:
            # Nothing to keep warm: start the walk anywhere, the bound balances.
            return bounded_load_pick(ring, ctx.rng.getrandbits(64), cands, load, self.load_factor)
        by_key: dict[str, Candidate] = {}
        total = 0
        for c in cands:
            by_key[c.key] = c
            total += load.get(c.key, 0)
        n = len(by_key)
        shares = self._shares
        conv_first: tuple[int, bool] | None = None
        conv_known = False
        walk_from = spread = point
        plan: Plan | None = None
        pooled: str | None = None
        if shares is None:
            share = (total + 1) / n
            owner = ring.owner(point)
            bound = math.ceil(self.load_factor * share)
            first_limit = math.ceil(self.first_turn_load_factor * share)
        else:
            # The in-flight bound is only a guard against a burst here, so it is
            # smoothed by one request per worker: at 1-4 requests in flight the
            # counts are noise that K routers would each read differently.
            share = (total + n) / n
            if ctx.attempt == 0:
                shares.observe(point, ctx.now)
            plan = shares.plan(ring, ring.keys, ctx.now)
            # A conversation keyed by its own head shares nothing to spread: its
            # owner is the ring's, which routers with different estimates agree on.
            kept = None if own_key else plan.kept.get(point)
            if kept is not None:
                conv_first = self._conversation_point(ctx.view, point, head)
                conv_known = True
                spread = self._spread_point(ctx.view, point, conv_first)
                pooled = plan.pooled(point, kept, spread)
                if pooled is not None:
                    # If its pool worker is not a candidate, the walk from the
                    # conversation spreads the pool's share; the prefix's walk would
                    # pile it onto the owner's neighbour.
                    walk_from = spread
            if pooled is not None:
                owner = pooled
            else:
                owner = ring.owner(point) if own_key else plan.owner(point, ring)
            # The plan balances the expected load; in flight, only a burst past
            # ``burst_factor`` times the mean moves a request.
            bound = first_limit = math.ceil(self.burst_factor * share)
        if owner not in by_key:
            owner = next((k for k in ring.walk(walk_from) if k in by_key), None)
            if owner is None:  # no eligible candidate is on the ring (no fleet given)
                return bounded_load_pick(ring, point, cands, load, self.load_factor)
        owner_load = load.get(owner, 0)
        if not self.spill_memory and owner_load + 1 <= first_limit:
            return by_key[owner]  # room for any request, and no memory to consult

        if not conv_known:
            conv_first = self._conversation_point(ctx.view, point, head)
        if conv_first is None:
            # Not a chat: the owner, else clockwise from the prefix.
            if owner_load + 1 <= bound:
                return by_key[owner]
            return bounded_load_pick(ring, point, cands, load, self.load_factor)
        conv, first = conv_first
        text = ctx.view.routing_text
        seen = len(text)
        counted = ctx.attempt == 0

        # 1. A conversation this router placed goes back where its history is,
        #    unless turns went through another router since (they followed the
        #    plan, which step 2 follows too).
        memory = self._memory
        entry = memory.get(conv)
        if entry is not None:
            there, upto = entry
            steps = answers_after(text, upto) if seen > upto else 0
            if steps and counted:
                self._turns.observe(steps == 1)
            if steps <= 1 and there in by_key and load.get(there, 0) + 1 <= bound:
                self._remember(conv, there, seen)
                return by_key[there]
        elif not first and counted:
            self._turns.observe(False)  # a running conversation whose last turn went elsewhere

        # 2. The prefix's owner; a new conversation leaves it some headroom.
        chosen: str | None = None
        if owner_load + 1 <= (first_limit if first else bound):
            chosen = owner
            if first and plan is not None and self._turns.holds():
                second: str | None = None
                if pooled is not None and point not in plan.heirs:
                    second = plan.second(spread)
                elif own_key:
                    second = next((k for k in ring.walk(point) if k != owner and k in by_key), None)
                chosen = self._less_started(owner, second, by_key, load, first_limit, ctx.now)
        else:
            # 3. Spill along the conversation's own walk, so that the same
            #    conversation spills to the same worker in every process.
            for key in ring.walk(conv):
                if key == owner or key not in by_key or load.get(key, 0) + 1 > bound:
                    continue
                if chosen is None:
                    chosen = key
                    if not first:
                        break
                else:
                    # A new conversation takes the less loaded of two acceptable workers.
                    if load.get(key, 0) < load.get(chosen, 0):
                        chosen = key
                    break
            if chosen is None:
                # Everyone else is at the bound: the owner, if it fits, else the
                # plain walk (the least loaded candidate always fits the bound).
                if owner_load + 1 <= bound:
                    chosen = owner
                else:
                    chosen = bounded_load_pick(ring, point, cands, load, self.load_factor).key
        if first and counted and plan is not None:  # read only with the plan
            self._starts.add(chosen, 1.0, ctx.now)
        self._remember(conv, chosen, seen)
        return by_key[chosen]

    def _remember(self, conv: int, key: str, seen: int) -> None:
        if not self.spill_memory:
            return
        memory = self._memory
        memory[conv] = (key, seen)
        memory.move_to_end(conv)
        if len(memory) > self.spill_memory:
            memory.popitem(last=False)

    def _less_started(
        self,
        first: str,
        second: str | None,
        by_key: dict[str, Candidate],
        load: Mapping[str, int],
        limit: int,
        now: float,
    ) -> str:
        """Of a new conversation's two pool draws, the one that started fewer
        conversations lately (ties: the first, the draw every router makes)."""
        if second is None or second == first or second not in by_key:
            return first
        if load.get(second, 0) + 1 > limit:
            return first
        started = self._starts.values((first, second), now)
        return second if started[1] < started[0] else first

    def _spread_point(
        self, view: RequestView, point: int, conv_first: tuple[int, bool] | None
    ) -> int:
        """What splits a hot prefix: the conversation, else the longer text."""
        if conv_first is not None:
            return conv_first[0]
        text = view.routing_text[: self.conversation_chars]
        if text:
            return hash_bytes(b"s:%d:" % point + text.encode("utf-8", "surrogatepass"))
        return point

    def on_removed(self, worker: Worker) -> None:
        """Forget the conversations placed on a worker that left the fleet."""
        keys = {c.key for c in candidates_for(worker)}
        self._starts.forget(keys)
        gone = [conv for conv, (key, _) in self._memory.items() if key in keys]
        for conv in gone:
            del self._memory[conv]
