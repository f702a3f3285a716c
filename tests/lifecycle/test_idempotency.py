"""Idempotency-Key: a running twin is joined (one lease), a finished one replayed."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from harness import wait_until
from lifecycle.conftest import CHAT, PATH
from meshkit import Worker


def test_join_and_replay_are_counted_once(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    # Slow enough that the twin surely arrives while the first still runs.
    a = mock_factory(name="a", first_token_ms=1500)
    b = mock_factory(name="b", first_token_ms=1500)
    mesh = mesh_factory(workers=[Worker(a.url), Worker(b.url)], lifecycle={"probe": False})
    lc = mesh.router.states
    mode = run_mode(mesh)
    key = {"idempotency-key": "order-42"}
    in_flight: Callable[[], int] = lambda: a.worker.stats.in_flight + b.worker.stats.in_flight  # noqa: E731
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(mode.request, "POST", PATH, json=CHAT, headers=key)
        assert wait_until(lambda: in_flight() == 1)
        second = pool.submit(mode.request, "POST", PATH, json=CHAT, headers=key)
        assert wait_until(lambda: in_flight() == 2)  # proxied again...
        assert mesh.total_load() == 1  # ...but one lease, on one worker
        assert lc.leases.total == 1
        r1, r2 = first.result(), second.result()
    assert (r1.status, r2.status) == (200, 200)
    assert r1.headers["x-mock-worker"] == r2.headers["x-mock-worker"]  # joined its twin
    assert lc.leases.joined_total == 1
    assert wait_until(lambda: mesh.total_load() == 0 and lc.leases.total == 0)
    for mock in (a, b):  # what follows needs no twin in flight: 1.5 s less a mode
        mock.worker.config.first_token_ms = 0
    again = mode.request("POST", PATH, json=CHAT, headers=key)
    assert again.status == 200
    assert lc.leases.replayed_total == 1
    other = mode.request("POST", PATH, json=CHAT, headers={"idempotency-key": "order-43"})
    assert other.status == 200
    assert lc.leases.replayed_total == 1
    text = mesh.metrics.render().decode()
    assert 'mesh_idempotent_requests_total{outcome="joined"} 1.0' in text
    assert 'mesh_idempotent_requests_total{outcome="replayed"} 1.0' in text
    assert wait_until(lambda: mesh.total_load() == 0)


def test_the_same_key_on_another_endpoint_is_another_request(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    a = mock_factory(name="a")
    mesh = mesh_factory(workers=[Worker(a.url)], lifecycle={"probe": False})
    mode = run_mode(mesh)
    key = {"idempotency-key": "k"}
    assert mode.request("POST", PATH, json=CHAT, headers=key).status == 200
    comp = {"model": "m", "prompt": "hi"}
    assert mode.request("POST", "/v1/completions", json=comp, headers=key).status == 200
    assert mesh.router.states.leases.replayed_total == 0
