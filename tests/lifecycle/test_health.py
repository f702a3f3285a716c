"""Health probes and circuit breakers against real mock workers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from harness import TransportMode, wait_until
from lifecycle.conftest import CHAT, FAST, PATH, state_of
from meshkit import Worker
from meshkit.core.lifecycle import Breaker, State

BREAKER = {
    **FAST,
    "health_interval_s": 0.3,
    "failure_threshold": 3,
    "success_threshold": 1,
    "breaker_failures": 2,
    "breaker_open_s": 0.3,
}


class Load:
    """Requests in a loop on a thread, until stopped; records (status, worker)."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self.seen: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            r = self.mode.request("POST", PATH, json=CHAT)
            self.seen.append((r.status, r.headers.get("x-mock-worker")))

    def mark(self) -> int:
        return len(self.seen)

    def since(self, mark: int) -> list[tuple[int, str | None]]:
        return self.seen[mark:]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.not_in_extproc(
    "Envoy sends a request to the one endpoint picked; it cannot move to another worker"
)
def test_a_killed_worker_trips_its_breaker_and_rejoins_after_restart(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = [mock_factory(name=f"w{i}") for i in range(3)]
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks], lifecycle=BREAKER)
    lc = mesh.router.states
    dead = mesh.workers[1].id
    mode = run_mode(mesh)
    load = Load(mode)
    try:
        assert wait_until(lambda: all(m.state is State.READY for m in lc.machines.values()))
        assert wait_until(lambda: "w1" in {w for _, w in load.seen})
        before = load.mark()
        mocks[1].kill()
        # Failed requests (connect errors) trip the breaker before probes notice.
        assert wait_until(lambda: lc.trips.get(dead, 0) >= 1)
        assert wait_until(lambda: state_of(mesh, dead) is State.FAILED)
        moved = load.mark()
        assert wait_until(lambda: load.mark() > moved + 20)
        during = load.since(before)
        assert {s for s, _ in during} == {200}  # every request failed over in time
        assert {w for _, w in load.since(moved)} == {"w0", "w2"}
        mocks[1].restart()
        # Probes see it healthy again (it was probed all along), the breaker lets a
        # trial through, and it takes traffic again.
        back = load.mark()
        assert wait_until(lambda: "w1" in {w for _, w in load.since(back)})
        assert state_of(mesh, dead) is State.READY
        # The trial's verdict lands when its response has ended (after the client
        # may already have it).
        assert wait_until(lambda: lc.machines[dead].breaker is Breaker.CLOSED)
        assert {s for s, _ in load.since(before)} == {200}
    finally:
        load.stop()
    assert wait_until(lambda: mesh.total_load() == 0)


def test_a_new_worker_is_unverified_until_probed(mock_factory: Any, mesh_factory: Any) -> None:
    a = mock_factory(name="a")
    b = mock_factory(name="b")
    # A long interval: only the probe an addition triggers can verify b in time.
    mesh = mesh_factory(workers=[Worker(a.url)], lifecycle={**FAST, "health_interval_s": 60})
    mode = TransportMode(mesh)
    try:
        assert mode.request("POST", PATH, json=CHAT).status == 200  # unverified is routable
        assert wait_until(lambda: state_of(mesh, mesh.workers[0].id) is State.READY)
        w = mesh.add_worker(Worker(b.url))
        assert wait_until(lambda: state_of(mesh, w.id) is State.READY)
        served = {mode.request("POST", PATH, json=CHAT).headers["x-mock-worker"] for _ in range(4)}
        assert served == {"a", "b"}
    finally:
        mode.close()


def test_unverified_workers_are_not_preferred(mock_factory: Any, mesh_factory: Any) -> None:
    a = mock_factory(name="a")
    mesh = mesh_factory(workers=[Worker(a.url)], lifecycle={**FAST, "health_interval_s": 60})
    mode = TransportMode(mesh)
    try:
        mesh.start_lifecycle()
        assert wait_until(lambda: state_of(mesh, mesh.workers[0].id) is State.READY)
        # Added while probes cannot reach it yet: it stays unverified.
        mesh.router.add(Worker("http://127.0.0.1:9"))
        served = {mode.request("POST", PATH, json=CHAT).headers["x-mock-worker"] for _ in range(4)}
        assert served == {"a"}
    finally:
        mode.close()


def test_a_worker_down_at_start_fails_and_is_routed_around(
    mock_factory: Any, mesh_factory: Any
) -> None:
    a = mock_factory(name="a")
    mesh = mesh_factory(workers=[Worker(a.url), Worker("http://127.0.0.1:9")], lifecycle=FAST)
    mode = TransportMode(mesh)
    try:
        mesh.start_lifecycle()
        assert wait_until(lambda: state_of(mesh, "http://127.0.0.1:9") is State.FAILED)
        assert "http://127.0.0.1:9" in mesh.fleet.unhealthy
        replies = [mode.request("POST", PATH, json=CHAT) for _ in range(4)]
        assert {r.headers["x-mock-worker"] for r in replies} == {"a"}
    finally:
        mode.close()


def test_probing_off_starts_ready_and_never_probes(mock_factory: Any, mesh_factory: Any) -> None:
    a = mock_factory(name="a")
    mesh = mesh_factory(workers=[Worker(a.url)], lifecycle={"probe": False})
    assert state_of(mesh, mesh.workers[0].id) is State.READY
    mode = TransportMode(mesh)
    try:
        assert mode.request("POST", PATH, json=CHAT).status == 200
        assert a.worker.stats.requests_total.get("/health", 0) == 0
    finally:
        mode.close()


def test_untracked_workers_are_not_probed_and_can_be_required(
    mock_factory: Any, mesh_factory: Any
) -> None:
    a = mock_factory(name="a")
    labels = {"mesh.tracking": "bypassable"}
    mesh = mesh_factory(workers=[Worker(a.url, labels=labels)], lifecycle=FAST)
    wid = mesh.workers[0].id
    assert state_of(mesh, wid) is State.UNTRACKED
    mode = TransportMode(mesh)
    try:
        assert mode.request("POST", PATH, json=CHAT).status == 200
        assert a.worker.stats.requests_total.get("/health", 0) == 0
    finally:
        mode.close()
    strict = mesh_factory(
        workers=[Worker(a.url, labels=labels)], lifecycle={**FAST, "require_tracking": True}
    )
    mode = TransportMode(strict)
    try:
        r = mode.request("POST", PATH, json=CHAT)
        assert r.status == 503
        assert r.json()["error"]["code"] == "no_available_workers"
    finally:
        mode.close()


def test_set_healthy_is_kept_apart_from_probes(mock_factory: Any, mesh_factory: Any) -> None:
    a = mock_factory(name="a")
    mesh = mesh_factory(workers=[Worker(a.url)], lifecycle=FAST)
    w = mesh.workers[0]
    mesh.set_healthy(w, False)
    mesh.start_lifecycle()
    assert wait_until(lambda: state_of(mesh, w.id) is State.READY)
    assert wait_until(lambda: a.worker.stats.requests_total.get("/health", 0) >= 3)
    assert w.id in mesh.fleet.unhealthy  # the probes do not overrule the operator
    mesh.set_healthy(w, True)
    assert w.id not in mesh.fleet.unhealthy


def test_hung_workers_do_not_starve_the_probes_of_healthy_ones(
    mock_factory: Any, mesh_factory: Any
) -> None:
    """80 workers that take connections and never answer (a zone gone dark), one
    that answers: every probe round asks all of them at once, each bounded by its
    own timeout. No shared connection cap may queue the healthy worker's probe
    behind the hung ones until it times out (a cap of 64 did)."""
    import socket

    hole = socket.socket()
    hole.bind(("0.0.0.0", 0))
    hole.listen(1024)  # connections complete in the backlog; nothing is ever read
    port = hole.getsockname()[1]
    good = mock_factory(name="good")
    hung = [f"http://127.0.0.{i}:{port}" for i in range(2, 82)]
    mesh = mesh_factory(
        workers=[*hung, good.url],
        lifecycle={**FAST, "health_timeout_s": 1.0, "engine_metrics_path": ""},
    )
    try:
        mesh.start_lifecycle()
        good_id = mesh.workers[-1].id
        probes: Callable[[], int] = lambda: good.worker.stats.requests_total.get("/health", 0)  # noqa: E731
        # three rounds, each as long as the hung workers' timeout
        assert wait_until(lambda: probes() >= 3, 20)
        assert state_of(mesh, good_id) is State.READY
        assert all(state_of(mesh, w.id) is not State.READY for w in mesh.workers[:-1])
    finally:
        hole.close()


def test_a_worker_started_after_its_router_is_ready_at_its_first_good_probe(
    mesh_factory: Any,
) -> None:
    # A gateway and its engines started together: the engine's first probes fail.
    # It was never ready, so there is no flapping for success_threshold (2) to
    # guard against; it used to wait a second probe interval.
    import socket

    from meshkit.mock import MockConfig, MockWorkerThread

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # Probes a second apart: a second probe within this test's polling is impossible.
    mesh = mesh_factory(workers=[url], lifecycle={**FAST, "health_interval_s": 1.0})
    mesh.start_lifecycle()
    wid = Worker(url).id
    assert wait_until(lambda: state_of(mesh, wid) is State.FAILED)
    engine = MockWorkerThread(MockConfig(name="late"), port=port)
    engine.start()
    try:
        assert wait_until(lambda: state_of(mesh, wid) is State.READY, timeout=30)
        assert engine.worker.stats.requests_total.get("/health") == 1
    finally:
        engine.stop()
