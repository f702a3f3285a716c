"""
Prefix hash
===========

``prefix_hash`` sends requests that start the same way to the same worker, so the
worker's prefix (KV) cache stays warm, without keeping any per-request state.

The key is the first ``prefix_token_count`` token ids when the prepare stage has
a tokenizer (it fills :attr:`~meshkit.core.requests.RequestView.token_ids`), and
otherwise the first ``prefix_chars`` characters of the routing text. Without a
tokenizer the character prefix is an approximation: two prompts that share 1,024
characters usually share their first ~250 tokens too.

The key is hashed onto a :class:`~meshkit.core.policies.ring.HashRing` built over
the *whole* fleet (healthy or not) and rebuilt only when the fleet's version
changes, so a worker that fails a health check and comes back gets its keys back,
and a join or leave moves about ``1/N`` of the keys.

Hot prefixes are bounded: the walk clockwise skips a candidate whose in-flight
load would exceed ``ceil(load_factor * (total + 1) / n)`` (consistent hashing
with bounded loads), so one popular system prompt spills to the next worker on
the ring instead of pinning all traffic to one (production-stack#957).

Choose ``prefix_token_count`` deeper than prompts' shared part (a common system
prompt plus tools): a key that covers only the shared part sends every request
to the same place and leaves the load bound to do all the balancing.

.. code-block:: toml

    policy = "prefix_hash"
    [policies.prefix_hash]
    prefix_token_count = 256
    load_factor = 1.25

.. autoclass:: PrefixHash
"""

from __future__ import annotations

from collections.abc import Sequence

from meshkit.core.policies.base import BasePolicy, Needs, PlacementContext
from meshkit.core.policies.ring import HashRing, bounded_load_pick, hash_bytes, hash_token_ids
from meshkit.core.workers import Candidate
from meshkit.errors import ConfigError

__all__ = ["PrefixHash", "RingCache"]


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


class PrefixHash(BasePolicy):
    """Bounded-load consistent hashing of the prompt prefix.

    :param prefix_token_count: how many leading token ids form the key.
    :param virtual_nodes: ring points per candidate.
    :param load_factor: a candidate takes the request while its in-flight load
        after it stays within ``ceil(load_factor * (total + 1) / n)``; ``>= 1``.
    :param prefix_chars: how many leading characters of the routing text form the
        key when there are no token ids (no tokenizer configured).
    """

    name = "prefix_hash"

    def __init__(
        self,
        prefix_token_count: int = 256,
        virtual_nodes: int = 150,
        load_factor: float = 1.25,
        prefix_chars: int = 1024,
    ) -> None:
        if prefix_token_count < 1:
            raise ConfigError("policies.prefix_hash.prefix_token_count", "must be >= 1")
        if virtual_nodes < 1:
            raise ConfigError("policies.prefix_hash.virtual_nodes", "must be >= 1")
        if not load_factor >= 1.0:
            raise ConfigError("policies.prefix_hash.load_factor", "must be >= 1.0")
        if prefix_chars < 1:
            raise ConfigError("policies.prefix_hash.prefix_chars", "must be >= 1")

        self.prefix_token_count = prefix_token_count
        self.virtual_nodes = virtual_nodes
        self.load_factor = float(load_factor)
        self.prefix_chars = prefix_chars
        self.needs = Needs(text=True, prefix_tokens=prefix_token_count, prefix_chars=prefix_chars)
        self._rings = RingCache(virtual_nodes)

    def key_point(self, ctx: PlacementContext) -> int | None:
        """The request's point on the ring, or ``None`` when it has no prefix."""
        ids = ctx.view.token_ids
        if ids:
            return hash_token_ids(ids[: self.prefix_token_count])
        text = ctx.view.routing_text[: self.prefix_chars]
        if text:
            return hash_bytes(b"c:" + text.encode("utf-8", "surrogatepass"))
        return None

    def select(self, ctx: PlacementContext) -> Candidate:
        cands = ctx.candidates
        if len(cands) == 1:
            return cands[0]
        point = self.key_point(ctx)
        if point is None:
            # Nothing to keep warm: start the walk anywhere, the bound balances.
            point = ctx.rng.getrandbits(64)
        return bounded_load_pick(self._rings.get(ctx), point, cands, ctx.load, self.load_factor)
