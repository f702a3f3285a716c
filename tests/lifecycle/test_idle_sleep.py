"""Idle sleep: never while a lease (a stream) is live, however long; right after."""

from __future__ import annotations

from typing import Any

from harness import wait_until
from lifecycle.conftest import CHAT, FAST, PATH, SLEEPY, state_of
from meshkit import Worker
from meshkit.core.lifecycle import State


def test_no_idle_sleep_while_a_stream_is_in_flight(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    # A stream of ~1 s against an idle timeout of 50 ms.
    mock = mock_factory(name="s", sleep_mode=True, output_tokens=30, per_token_ms=30)
    mesh = mesh_factory(
        workers=[Worker(mock.url, labels=SLEEPY)],
        lifecycle={**FAST, "idle_sleep_s": 0.05, "sleep_level": 2},
    )
    wid = mesh.workers[0].id
    stats = mock.worker.stats
    mode = run_mode(mesh)
    chunks_seen = 0
    slept = 0
    with mode.stream("POST", PATH, json={**CHAT, "stream": True}) as chunks:
        for _ in chunks:
            chunks_seen += 1
            if chunks_seen == 1:
                # The gateway probes (and idles) from its start: the worker may have
                # slept, and been woken for this stream, before its first chunk.
                slept = stats.sleep_calls
            assert stats.sleep_calls == slept
            assert state_of(mesh, wid) in (State.UNVERIFIED, State.READY)
    assert chunks_seen > 5
    assert wait_until(lambda: stats.sleep_calls == slept + 1)
    assert (stats.last_sleep_level, stats.last_sleep_mode) == (2, "wait")
    assert wait_until(lambda: state_of(mesh, wid) is State.SLEEPING)
    # The next request wakes it, holding until it is ready.
    woken = stats.wake_calls
    assert mode.request("POST", PATH, json=CHAT).status == 200
    assert stats.wake_calls == woken + 1


def test_admin_sleep_refuses_a_worker_with_a_lease(mock_factory: Any, mesh_factory: Any) -> None:
    import pytest

    from harness import TransportMode
    from meshkit.core.lifecycle import LifecycleError

    mock = mock_factory(name="s", sleep_mode=True, output_tokens=20, per_token_ms=50)
    mesh = mesh_factory(workers=[Worker(mock.url, labels=SLEEPY)], lifecycle=FAST)
    wid = mesh.workers[0].id
    mode = TransportMode(mesh)
    try:
        with mode.stream("POST", PATH, json={**CHAT, "stream": True}) as chunks:
            it = iter(chunks)
            next(it)
            assert wait_until(lambda: state_of(mesh, wid) is State.READY)
            with pytest.raises(LifecycleError, match="lease"):
                mesh.sleep(wid)
            assert mock.worker.stats.sleep_calls == 0
            b"".join(it)
        assert wait_until(lambda: mesh.total_load() == 0)
        assert wait_until(lambda: _sleeps(mesh, wid))
        assert mock.worker.stats.sleep_calls == 1
    finally:
        mode.close()


def _sleeps(mesh: Any, wid: str) -> bool:
    from meshkit.core.lifecycle import LifecycleError

    try:
        return bool(mesh.sleep(wid))
    except LifecycleError:  # still within the placement grace
        return False


def test_a_sleeping_fleet_still_counts_as_healthy_for_readiness(
    mock_factory: Any, mesh_factory: Any
) -> None:
    from lifecycle.conftest import asleep_worker

    _, mesh, _ = asleep_worker(mock_factory, mesh_factory)
    assert mesh.health()["healthy_workers"] == 1
