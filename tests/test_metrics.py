"""The per-request series kept in plain numbers (metrics.RequestSeries)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from meshkit import Mesh, Worker
from meshkit.metrics import RequestSeries


def _registry(series: RequestSeries) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(series)
    return r


def test_a_value_on_a_bucket_bound_counts_in_that_bucket() -> None:
    s = RequestSeries()
    r = _registry(s)
    s.finished("chat", "200", 0.1, 0.005, None)
    s.finished("chat", "200", 0.1000001, None, None)
    dur = "mesh_router_request_duration_seconds_bucket"
    assert r.get_sample_value(dur, {"api": "chat", "le": "0.05"}) == 0
    assert r.get_sample_value(dur, {"api": "chat", "le": "0.1"}) == 1
    assert r.get_sample_value(dur, {"api": "chat", "le": "0.25"}) == 2
    assert r.get_sample_value(dur, {"api": "chat", "le": "+Inf"}) == 2
    assert r.get_sample_value("mesh_router_request_duration_seconds_count", {"api": "chat"}) == 2
    ttft = "mesh_router_ttft_seconds_bucket"
    assert r.get_sample_value(ttft, {"api": "chat", "le": "0.005"}) == 1
    assert r.get_sample_value("mesh_router_ttft_seconds_count", {"api": "chat"}) == 1


def test_values_over_the_last_bound_land_in_inf() -> None:
    s = RequestSeries()
    r = _registry(s)
    s.finished("messages", "cancelled", 600.0, 120.0, None)
    dur = "mesh_router_request_duration_seconds_bucket"
    assert r.get_sample_value(dur, {"api": "messages", "le": "60.0"}) == 0
    assert r.get_sample_value(dur, {"api": "messages", "le": "+Inf"}) == 1
    assert (
        r.get_sample_value("mesh_router_requests_total", {"api": "messages", "status": "cancelled"})
        == 1
    )


def test_counts_are_exact_under_threads() -> None:
    s = RequestSeries()
    r = _registry(s)
    n, per = 8, 2000

    def work() -> None:
        for _ in range(per):
            s.finished("chat", "200", 0.01, 0.001, (3, 2, 1))

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = n * per
    assert (
        r.get_sample_value("mesh_router_requests_total", {"api": "chat", "status": "200"}) == total
    )
    assert r.get_sample_value("mesh_router_tokens_total", {"kind": "input"}) == 3 * total
    assert r.get_sample_value("mesh_router_tokens_total", {"kind": "output"}) == 2 * total
    assert r.get_sample_value("mesh_router_tokens_total", {"kind": "cached"}) == total
    assert r.get_sample_value("mesh_router_ttft_seconds_count", {"api": "chat"}) == total


def test_active_requests_are_read_from_the_fleet_when_scraped() -> None:
    mesh = Mesh(workers=[Worker("http://127.0.0.1:9"), Worker("http://127.0.0.1:10")])
    try:
        reg = mesh.metrics.registry
        name = "mesh_worker_requests_active"
        assert reg.get_sample_value(name, {"worker": "http://127.0.0.1:9"}) == 0
        cand = mesh.fleet.candidates[0]
        mesh.fleet.acquire(cand)
        assert reg.get_sample_value(name, {"worker": cand.key}) == 1
        mesh.remove_worker(cand.worker.id)
        # removed while a request runs: it is still shown until that request ends
        assert reg.get_sample_value(name, {"worker": cand.key}) == 1
        mesh.fleet.release(cand)
        assert reg.get_sample_value(name, {"worker": cand.key}) is None
    finally:
        mesh.close()
