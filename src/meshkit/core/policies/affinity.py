"""
Affinity
========

Two ways to keep a conversation on the worker that already holds its state.

:class:`SessionAffinity` (policy name ``session``) hashes the request's
:attr:`~meshkit.core.requests.RequestView.routing_key` onto the same consistent-hash
ring as ``prefix_hash``. The ``Mesh`` fills that key from a configured header
(such as ``X-Session-ID``) or from the body's ``prompt_cache_key``,
``safety_identifier`` or ``user``. A request without a key is placed by an inner
policy (``power_of_two`` by default, built through the registry).

:class:`ResponsesAffinity` is not a policy: it is a bounded map from a Responses
API state id (a response or a conversation) to the origin that produced it, which
placement consults for ``previous_response_id`` and ``conversation``. Entries
expire after ``ttl_s``, measured on the caller's clock: the map only ever sees the
``now`` it is given, so the core stays free of clocks and tests can drive time.

Security: a routing key comes from the client. It only chooses among eligible
workers, and it is hashed (never logged or echoed), so a client can at most pin
its own requests to one worker. Bound the damage with ``load_factor``.

.. autoclass:: SessionAffinity
.. autoclass:: ResponsesAffinity
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachetools import TTLCache

from meshkit.core.policies.base import BasePolicy, Completion, PlacementContext, Policy
from meshkit.core.policies.prefix_hash import RingCache
from meshkit.core.policies.ring import DEFAULT_VIRTUAL_NODES, bounded_load_pick, hash_bytes
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker
from meshkit.errors import ConfigError

__all__ = ["ResponsesAffinity", "SessionAffinity"]


class SessionAffinity(BasePolicy):
    """Sticky placement by routing key, with a fallback policy for keyless requests.

    :param inner: the policy name (or instance) for requests without a key.
    :param inner_options: options of ``inner`` when it is a name.
    :param virtual_nodes: ring points per candidate.
    :param load_factor: ``None`` (the default) keeps a session on its worker
        whatever the load; a number ``>= 1`` bounds the load as ``prefix_hash``
        does, at the price of moving a session off an overloaded worker.
    """

    name = "session"

    def __init__(
        self,
        inner: str | Policy = "power_of_two",
        inner_options: Mapping[str, Any] | None = None,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
        load_factor: float | None = None,
    ) -> None:
        # Imported here: the registry imports this module by name, lazily.
        from meshkit.core.policies.registry import create_policy

        if virtual_nodes < 1:
            raise ConfigError("policies.session.virtual_nodes", "must be >= 1")
        if load_factor is not None and not load_factor >= 1.0:
            raise ConfigError("policies.session.load_factor", "must be >= 1.0 or unset")
        if inner == self.name:
            raise ConfigError("policies.session.inner", "session cannot fall back to itself")
        self.inner: Policy = create_policy(inner, inner_options)
        self.needs = self.inner.needs
        self.load_factor = load_factor
        self._rings = RingCache(virtual_nodes)

    def select(self, ctx: PlacementContext) -> Candidate:
        key = ctx.view.routing_key
        if not key:
            return self.inner.select(ctx)
        if len(ctx.candidates) == 1:
            return ctx.candidates[0]
        point = hash_bytes(b"s:" + key.encode("utf-8", "surrogatepass"))
        return bounded_load_pick(
            self._rings.get(ctx), point, ctx.candidates, ctx.load, self.load_factor
        )

    # The inner policy learns from every request, keyed or not, so its state
    # (EWMAs, trees) is current when a keyless request needs it.
    def on_placed(self, cand: Candidate, view: RequestView, now: float) -> None:
        self.inner.on_placed(cand, view, now)

    def on_complete(self, cand: Candidate, view: RequestView, done: Completion, now: float) -> None:
        self.inner.on_complete(cand, view, done, now)

    def on_removed(self, worker: Worker) -> None:
        self.inner.on_removed(worker)


class ResponsesAffinity:
    """A bounded, expiring map from a response id to the origin that produced it.

    :param max_entries: at most this many ids are kept (least recently used go first).
    :param ttl_s: an id is forgotten this many seconds (caller's clock) after it
        was remembered.

    .. code-block:: python

        owners = ResponsesAffinity(ttl_s=3600)
        owners.remember("resp_abc", "http://10.0.0.5:8000", now=100.0)
        owners.owner("resp_abc", now=200.0)    # "http://10.0.0.5:8000"
        owners.owner("resp_abc", now=3701.0)   # None
    """

    def __init__(self, max_entries: int = 100_000, ttl_s: float = 3600.0) -> None:
        if max_entries < 1:
            raise ConfigError("responses_affinity.max_entries", "must be >= 1")
        if not ttl_s > 0:
            raise ConfigError("responses_affinity.ttl_s", "must be > 0")
        self.max_entries = max_entries
        self.ttl_s = float(ttl_s)
        self._now = float("-inf")
        self._map: TTLCache[str, str] = TTLCache(
            maxsize=max_entries, ttl=self.ttl_s, timer=self._timer
        )

    def _timer(self) -> float:
        return self._now

    def _advance(self, now: float) -> None:
        # TTLCache assumes a clock that never goes back; a caller's clock that
        # does (two threads' readings applied out of order) must not resurrect
        # expired entries or expire fresh ones early.
        if now > self._now:
            self._now = now

    def remember(self, response_id: str, origin: str, now: float) -> None:
        self._advance(now)
        self._map[response_id] = origin

    def owner(self, response_id: str, now: float) -> str | None:
        self._advance(now)
        return self._map.get(response_id)

    def forget(self, response_id: str) -> None:
        self._map.pop(response_id, None)

    def forget_origin(self, origin: str) -> int:
        """Forget every id owned by ``origin`` (a worker left); returns how many."""
        ids = [rid for rid, o in self._map.items() if o == origin]
        for rid in ids:
            self._map.pop(rid, None)
        return len(ids)

    def expire(self, now: float) -> None:
        """Drop expired entries now (they are otherwise dropped lazily)."""
        self._advance(now)
        self._map.expire()

    def __len__(self) -> int:
        return len(self._map)
