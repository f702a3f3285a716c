"""A sleep or wake another process of the gateway made: the state follows, no engine call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lifecycle.conftest import SLEEPY, state_of
from meshkit import Mesh, Worker
from meshkit.core.lifecycle import LifecycleError, State
from meshkit.core.states import WorkerStates

URL = "http://127.0.0.1:9"  # never called: nothing here reaches the engine


@pytest.fixture
def mesh() -> Iterator[Mesh]:
    # Probing off: the worker is ready at once, and no thread runs.
    m = Mesh(workers=[Worker(URL, labels=SLEEPY), Worker(URL + "1")], lifecycle={"probe": False})
    yield m
    m.close()


def follow(mesh: Mesh, asleep: bool, worker: int = 0) -> bool:
    return mesh.router.do(WorkerStates.follow_sleep, mesh.workers[worker].id, asleep)


def test_asleep_then_awake_follow_without_counting_an_engine_call(mesh: Mesh) -> None:
    wid = mesh.workers[0].id
    states = mesh.router.states
    assert follow(mesh, True) is True
    assert state_of(mesh, wid) is State.SLEEPING
    assert wid in mesh.fleet.unhealthy  # no placement while the engine sleeps
    assert follow(mesh, True) is False  # already asleep: accepted, unchanged
    assert follow(mesh, False) is True
    assert state_of(mesh, wid) is State.READY
    assert wid not in mesh.fleet.unhealthy
    assert follow(mesh, False) is False
    # Only the process that called the engine counts it (summed metrics stay exact).
    assert (states.sleeps_total, states.wakes_total) == (0, 0)
    assert wid not in states.ops


def test_a_lease_here_vetoes_the_sleep(mesh: Mesh) -> None:
    wid = mesh.workers[0].id
    leases = mesh.router.states.leases
    entry, _ = leases.start(wid, wid, mesh.clock())
    with pytest.raises(LifecycleError, match="lease"):
        follow(mesh, True)
    with pytest.raises(LifecycleError, match="lease"):
        mesh.router.do(WorkerStates.check_sleep, wid)
    assert state_of(mesh, wid) is State.READY
    leases.end(entry, mesh.clock())
    mesh.router.do(WorkerStates.check_sleep, wid)  # idle: allowed, and nothing changed
    assert state_of(mesh, wid) is State.READY


def test_a_worker_without_sleep_mode_refuses_both(mesh: Mesh) -> None:
    for asleep in (True, False):
        with pytest.raises(LifecycleError, match="no sleep mode"):
            follow(mesh, asleep, worker=1)
    assert state_of(mesh, mesh.workers[1].id) is State.READY


def test_a_draining_worker_cannot_be_put_to_sleep_and_stays_draining(mesh: Mesh) -> None:
    wid = mesh.workers[0].id
    mesh.drain(wid, timeout_s=0)
    with pytest.raises(LifecycleError, match="draining"):
        follow(mesh, True)
    assert follow(mesh, False) is False
    assert state_of(mesh, wid) is State.DRAINING


def test_a_probe_report_that_raced_with_it_is_dropped(mesh: Mesh) -> None:
    wid = mesh.workers[0].id
    router = mesh.router
    ((worker, epoch),) = [t for t in router.do(WorkerStates.probe_targets) if t[0].id == wid]
    follow(mesh, True)
    # The probe ran before the other process slept the engine: it saw it awake.
    router.do(WorkerStates.probed, [(worker, epoch, True, False)])
    assert state_of(mesh, wid) is State.SLEEPING
    ((_, fresh),) = [t for t in router.do(WorkerStates.probe_targets) if t[0].id == wid]
    router.do(WorkerStates.probed, [(worker, fresh, True, False)])
    assert state_of(mesh, wid) is State.READY  # a probe after it is believed
