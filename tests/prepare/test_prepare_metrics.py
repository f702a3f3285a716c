"""The preparation metrics: one registry per pool (per Mesh), every series exported."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest

from meshkit.metrics import ERROR_REASONS, PrepareMetrics
from meshkit.prepare.pool import PoolConfig, PreparePool

SERIES = (
    "mesh_prepare_queued_jobs",
    "mesh_prepare_dispatched_jobs",
    "mesh_prepare_busy_workers",
    "mesh_prepare_live_workers",
    "mesh_prepare_queue_seconds",
    "mesh_prepare_run_seconds",
    "mesh_prepare_stage_seconds",
    "mesh_prepare_errors_total",
)


def test_two_pools_do_not_collide(make_pool: Callable[..., PreparePool]) -> None:
    a, b = make_pool(workers=1), make_pool(workers=1)
    assert a.metrics.registry is not b.metrics.registry
    a.run(lambda: None)
    assert a.metrics.registry.get_sample_value("mesh_prepare_run_seconds_count") == 1
    assert b.metrics.registry.get_sample_value("mesh_prepare_run_seconds_count") == 0


def test_a_given_registry_is_used() -> None:
    registry = CollectorRegistry()
    pool = PreparePool(PoolConfig(workers=1), registry=registry)
    try:
        assert pool.metrics.registry is registry
        assert registry.get_sample_value("mesh_prepare_live_workers") == 1
    finally:
        pool.shutdown()


def test_every_series_and_reason_is_exported_from_the_start() -> None:
    metrics = PrepareMetrics()
    text = generate_latest(metrics.registry).decode()
    for name in SERIES:
        assert f"# TYPE {name}" in text or f"# TYPE {name.removesuffix('_total')}" in text
    for reason in ERROR_REASONS:
        assert metrics.error_count(reason) == 0
        assert f'mesh_prepare_errors_total{{reason="{reason}"}} 0.0' in text


def test_stage_timing_uses_the_clock() -> None:
    now = [10.0]
    metrics = PrepareMetrics(clock=lambda: now[0])
    with metrics.stage("parse"):
        now[0] += 0.25
    registry = metrics.registry
    assert registry.get_sample_value("mesh_prepare_stage_seconds_sum", {"stage": "parse"}) == 0.25
