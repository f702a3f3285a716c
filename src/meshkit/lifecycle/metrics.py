"""
Lifecycle metrics
=================

A Prometheus collector on the Mesh's own registry (``mesh.metrics.registry``),
read at scrape time from the lifecycle state, so the request path updates no
metric for it:

=================================  ==========================================
``mesh_worker_state``              1 for the worker's state, 0 for the others
                                   (labels ``worker``, ``state``)
``mesh_worker_health``             1 when probes say healthy (``worker``)
``mesh_worker_cb_state``           breaker: 0 closed, 1 open, 2 half-open
``mesh_leases_active``             live leases (a join shares one)
``mesh_wakes_total``               wakes started
``mesh_sleeps_total``              sleeps started
``mesh_idempotent_requests_total`` requests with an Idempotency-Key, by
                                   ``outcome``: started, joined, replayed
=================================  ==========================================

Labels are worker URLs only: never a credential.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshkit.core.lifecycle import Breaker, State

if TYPE_CHECKING:
    from meshkit.lifecycle.controller import Lifecycle

__all__ = ["LifecycleCollector"]

_CB = {Breaker.CLOSED: 0.0, Breaker.OPEN: 1.0, Breaker.HALF_OPEN: 2.0}


class LifecycleCollector(Collector):
    """Reads one :class:`~meshkit.lifecycle.controller.Lifecycle` per scrape."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lc = lifecycle

    def describe(self) -> Iterator[Metric]:
        # Nothing up front: registering must not read a half-built lifecycle.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        lc = self.lc
        state = GaugeMetricFamily(
            "mesh_worker_state", "Worker lifecycle state (1 = current)", labels=["worker", "state"]
        )
        health = GaugeMetricFamily(
            "mesh_worker_health", "1 when health probes say healthy", labels=["worker"]
        )
        cb = GaugeMetricFamily(
            "mesh_worker_cb_state",
            "Circuit breaker: 0 closed, 1 open, 2 half-open",
            labels=["worker"],
        )
        with lc.mesh._lock:
            rows = [
                (w.url, m.state, m.breaker, lc.health_of(w.id))
                for w in lc.mesh.fleet.workers
                if (m := lc.machines.get(w.id)) is not None
            ]
            leases = lc.leases.total
            wakes, sleeps = lc.wakes_total, lc.sleeps_total
            started = lc.leases.started_total
            joined, replayed = lc.leases.joined_total, lc.leases.replayed_total
        for url, st, br, healthy in rows:
            for s in State:
                state.add_metric([url, s.value], 1.0 if s is st else 0.0)
            health.add_metric([url], 1.0 if healthy else 0.0)
            cb.add_metric([url], _CB[br])
        yield state
        yield health
        yield cb
        yield GaugeMetricFamily("mesh_leases_active", "Live request leases", value=leases)
        yield CounterMetricFamily("mesh_wakes", "Worker wakes started", value=wakes)
        yield CounterMetricFamily("mesh_sleeps", "Worker sleeps started", value=sleeps)
        idem = CounterMetricFamily(
            "mesh_idempotent_requests",
            "Leases by idempotency outcome (joins and replays are counted once)",
            labels=["outcome"],
        )
        idem.add_metric(["started"], started)
        idem.add_metric(["joined"], joined)
        idem.add_metric(["replayed"], replayed)
        yield idem
