"""
The Mesh side of prefill/decode disaggregation
==============================================

:class:`PdRouter` places (prefill, decode) pairs for :func:`meshkit.core.pd.pd_flow`:
each side has its own policy (``[pd] prefill_policy``, default ``cache_aware``;
``decode_policy``, default ``power_of_two``), eligibility is the same as for
regular workers (API, model, health, lifecycle, admission limits), and both
placements happen under the Mesh lock. A pair takes two of the fleet's
``upstream.max_in_flight`` slots; it is admitted when placed, and its legs' leases
are not checked again (a refused second leg would strand the first). A fleet is
disaggregated for an API when it has prefill and decode workers and no regular
worker serves that API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram

from meshkit.core.endpoints import Api
from meshkit.core.forward import Lease
from meshkit.core.pd import PdPlacer
from meshkit.core.placement import eligible, overloaded
from meshkit.core.policies.base import PlacementContext, Policy
from meshkit.core.policies.registry import create_policy
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate
from meshkit.errors import ConfigError

if TYPE_CHECKING:
    from meshkit.mesh import Mesh

__all__ = ["PdRouter"]

_PROTOCOLS = ("sglang", "vllm")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PdRouter(PdPlacer):
    def __init__(self, mesh: Mesh) -> None:
        cfg = mesh.config.pd
        if cfg.protocol not in _PROTOCOLS:
            raise ConfigError("pd.protocol", f"must be one of {', '.join(_PROTOCOLS)}")
        self.mesh = mesh
        self.protocol = cfg.protocol
        self.prefill_policy: Policy = create_policy(
            cfg.prefill_policy, mesh.config.policies.get(cfg.prefill_policy, {})
        )
        self.decode_policy: Policy = create_policy(
            cfg.decode_policy, mesh.config.policies.get(cfg.decode_policy, {})
        )
        r = mesh.metrics.registry
        self.requests = Counter("mesh_pd_requests", "Disaggregated requests", registry=r)
        self.bootstrap_failures = Counter(
            "mesh_pd_bootstrap_failures", "Prefill legs that failed the KV handover", registry=r
        )
        self.ttft = Histogram(
            "mesh_pd_ttft_seconds", "TTFT of disaggregated requests", buckets=_LATENCY, registry=r
        )
        self._stamp = -1
        self._roles: frozenset[str] = frozenset()

    def applies(self, view: RequestView) -> bool:
        """Whether ``view`` runs disaggregated on the current fleet."""
        if view.api in (Api.MODELS, Api.TOKENIZE):
            return False
        fleet = self.mesh.fleet
        if fleet.version != self._stamp:
            self._roles = frozenset(w.role for w in fleet.workers)
            self._stamp = fleet.version
        if "prefill" not in self._roles or "decode" not in self._roles:
            return False
        return not any(w.role == "regular" and w.serves(view.api) for w in fleet.workers)

    def _pick(
        self, policy: Policy, cands: list[Candidate], view: RequestView, now: float
    ) -> Candidate:
        fleet = self.mesh.fleet
        ctx = PlacementContext(
            candidates=cands,
            view=view,
            load=fleet.load,
            weight=fleet.weight,
            rng=self.mesh.rng,
            fleet=[c for c in fleet.candidates if c.worker.role == cands[0].worker.role],
            fleet_version=fleet.version,
            now=now,
        )
        chosen = policy.select(ctx)
        policy.on_placed(chosen, view, now)
        return chosen

    def place_pair(self, view: RequestView) -> tuple[Candidate, Candidate]:
        mesh = self.mesh
        now = mesh.clock()
        with mesh._lock:
            admit = mesh.admit
            prefills = eligible(mesh.fleet, view, admit=admit, role="prefill")
            decodes = eligible(mesh.fleet, view, admit=admit, role="decode")
            fleet = mesh.fleet
            cap = fleet.max_in_flight
            if cap and fleet.in_flight + 2 > cap:
                taken = f"the fleet has {fleet.in_flight} of {cap} slots taken"
                raise overloaded(fleet, cap, taken)
            return (
                self._pick(self.prefill_policy, prefills, view, now),
                self._pick(self.decode_policy, decodes, view, now),
            )

    def lease(self, cand: Candidate, view: RequestView) -> Lease:
        return self.mesh.lease(cand, view, admission=False)

    def pd_event(self, kind: str) -> None:
        if kind == "request":
            self.requests.inc()
        elif kind == "bootstrap_failure":
            self.bootstrap_failures.inc()
