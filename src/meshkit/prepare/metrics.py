"""
Preparation metrics
===================

The Prometheus series the preparation pool exports. Each :class:`PrepareMetrics`
registers its collectors in the :class:`~prometheus_client.CollectorRegistry` it is
given; when none is given it makes a fresh one, so two Meshes (or two tests) in one
process never collide on a series name.

==================================== ========= ==================================
series                               type      meaning
==================================== ========= ==================================
``mesh_prepare_queued_jobs``         gauge     jobs waiting for a worker
``mesh_prepare_dispatched_jobs``     gauge     jobs inside the pool (queued or
                                               still executing, abandoned or not)
``mesh_prepare_busy_workers``        gauge     worker threads executing a job
``mesh_prepare_live_workers``        gauge     worker threads alive
``mesh_prepare_queue_seconds``       histogram wait from submit to start
``mesh_prepare_run_seconds``         histogram execution time of a job
``mesh_prepare_stage_seconds``       histogram time per stage (``stage`` label:
                                               ``parse``, ``template``,
                                               ``tokenize``, ``detokenize``, ...)
``mesh_prepare_errors_total``        counter   refusals and failed jobs by
                                               ``reason``
==================================== ========= ==================================

Reasons of ``mesh_prepare_errors_total``: ``queue_full``, ``timeout``,
``cancelled``, ``failed``, ``unavailable``, ``too_large`` (all exported from the
start at 0), plus the ``code`` of any other :class:`~meshkit.errors.MeshError` a job
raised (``invalid_request`` for instance).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ERROR_REASONS", "PrepareMetrics"]

#: The reasons exported at 0 before anything happened (dashboards see the series).
ERROR_REASONS: Final = ("queue_full", "timeout", "cancelled", "failed", "unavailable", "too_large")

# Preparation spans ~50 µs (a small JSON parse) to seconds (a MiB prompt tokenized).
_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class PrepareMetrics:
    """The preparation pool's collectors, registered in one registry."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._clock = clock
        r = self.registry
        self.queued_jobs = Gauge(
            "mesh_prepare_queued_jobs", "Preparation jobs waiting for a worker.", registry=r
        )
        self.dispatched_jobs = Gauge(
            "mesh_prepare_dispatched_jobs",
            "Preparation jobs inside the pool (queued or executing).",
            registry=r,
        )
        self.busy_workers = Gauge(
            "mesh_prepare_busy_workers", "Preparation threads executing a job.", registry=r
        )
        self.live_workers = Gauge(
            "mesh_prepare_live_workers", "Preparation threads alive.", registry=r
        )
        self.queue_seconds = Histogram(
            "mesh_prepare_queue_seconds",
            "Time a preparation job waited for a worker.",
            buckets=_BUCKETS,
            registry=r,
        )
        self.run_seconds = Histogram(
            "mesh_prepare_run_seconds",
            "Time a worker spent executing a preparation job.",
            buckets=_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "mesh_prepare_stage_seconds",
            "Time spent in one preparation stage.",
            ["stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.errors_total = Counter(
            "mesh_prepare_errors_total",
            "Preparation refusals and failures by reason.",
            ["reason"],
            registry=r,
        )
        for reason in ERROR_REASONS:
            self.errors_total.labels(reason=reason)

    def error(self, reason: str) -> None:
        """Count one refusal or failure."""
        self.errors_total.labels(reason=reason).inc()

    def error_count(self, reason: str) -> float:
        """The current value of ``mesh_prepare_errors_total{reason}`` (tests, health)."""
        value = self.registry.get_sample_value("mesh_prepare_errors_total", {"reason": reason})
        return 0.0 if value is None else value

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block into ``mesh_prepare_stage_seconds{stage=name}``.

        The time is recorded whether the block succeeds or raises: a template that
        fails after a second of work still cost that second.
        """
        start = self._clock()
        try:
            yield
        finally:
            self.stage_seconds.labels(stage=name).observe(max(0.0, self._clock() - start))
