"""
The placement context
=====================

What a policy reads to pick a candidate (:class:`PlacementContext`, exported by
:mod:`meshkit.core.policies.base` and :mod:`meshkit.policies`). Its own module
because it is compiled in a wheel (``hatch_build.py``) while the policies are not:
one is built per placement, and a compiled build runs an interpreted class's (or a
dataclass's generated) ``__init__`` in the interpreter.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from meshkit.core.kv_index import KvIndex
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate

__all__ = ["PlacementContext"]


class PlacementContext:
    """Everything a policy may read to pick a candidate.

    :param candidates: the eligible candidates (never empty).
    :param view: the request.
    :param load: requests in flight per candidate key.
    :param weight: the candidates' weights, by key.
    :param rng: the only source of randomness a policy may use.
    :param fleet: the whole fleet's candidates (healthy or not), for stable rings.
    :param fleet_version: changes whenever ``fleet`` does.
    :param now: the mesh's clock.
    :param attempt: 0 for the first placement of a request, then 1, 2, ... on retries.
    :param kv: the blocks workers with KV events hold (None: no worker publishes them).
    """

    __slots__ = (
        "attempt",
        "candidates",
        "fleet",
        "fleet_version",
        "kv",
        "load",
        "now",
        "rng",
        "view",
        "weight",
    )

    def __init__(
        self,
        candidates: Sequence[Candidate],
        view: RequestView,
        load: Mapping[str, int],
        weight: Mapping[str, int],
        rng: random.Random,
        fleet: Sequence[Candidate] = (),
        fleet_version: int = 0,
        now: float = 0.0,
        attempt: int = 0,
        kv: KvIndex | None = None,
    ) -> None:
        self.candidates = candidates
        self.view = view
        self.load = load
        self.weight = weight
        self.rng = rng
        self.fleet = fleet
        self.fleet_version = fleet_version
        self.now = now
        self.attempt = attempt
        self.kv = kv

    def load_of(self, cand: Candidate) -> int:
        return self.load.get(cand.key, 0)

    def __repr__(self) -> str:
        return (
            f"PlacementContext({len(self.candidates)} candidates, attempt={self.attempt}, "
            f"now={self.now})"
        )
