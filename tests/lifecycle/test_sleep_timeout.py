"""What ``Mesh.sleep`` / ``asleep`` and ``Mesh.wake`` do when their wait
(``timeout_s``) runs out: the operation goes on either way; a sleep raises the
built-in ``TimeoutError`` (sync and async alike: its False means the engine
refused), a wake answers False."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness import wait_until
from lifecycle.conftest import FAST, SLEEPY, state_of
from meshkit import Mesh, Worker
from meshkit.core.lifecycle import State


def test_a_sleep_whose_wait_runs_out_raises_timeout_error_and_goes_on(
    mock_factory: Any, mesh_factory: Any
) -> None:
    # The engine takes its time to sleep and wake, or a loaded machine could see a
    # call end before the zero wait is checked.
    mock = mock_factory(name="sleepy", sleep_mode=True, wake_ms=300, sleep_ms=300)
    mesh: Mesh = mesh_factory(workers=[Worker(mock.url, labels=SLEEPY)], lifecycle=FAST)
    wid = mesh.workers[0].id
    mesh.start_lifecycle()
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    stats = mock.worker.stats
    with pytest.raises(TimeoutError) as sync:
        mesh.sleep(wid, timeout_s=0)
    assert sync.type is TimeoutError  # not a type only concurrent.futures knows
    assert wait_until(lambda: stats.sleep_calls == 1 and state_of(mesh, wid) is State.SLEEPING)
    # A wake's wait running out is an answer (False); the wake goes on.
    assert mesh.wake(wid, timeout_s=0) is False
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)

    async def asleep() -> bool:
        return await mesh.asleep(wid, timeout_s=0)

    with pytest.raises(TimeoutError) as async_:
        asyncio.run(asleep())
    assert async_.type is TimeoutError
    assert wait_until(lambda: stats.sleep_calls == 2 and state_of(mesh, wid) is State.SLEEPING)


def test_sleep_and_wake_after_close_say_the_mesh_is_closed(
    mock_factory: Any, mesh_factory: Any
) -> None:
    mock = mock_factory(name="sleepy", sleep_mode=True)
    mesh = mesh_factory(workers=[Worker(mock.url, labels=SLEEPY)], lifecycle=FAST)
    wid = mesh.workers[0].id
    mesh.start_lifecycle()
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    mesh.close()
    # Not a cancelled future's CancelledError, and no wait for a wake never sent.
    with pytest.raises(RuntimeError, match="closed"):
        mesh.sleep(wid)
    with pytest.raises(RuntimeError, match="closed"):
        mesh.wake(wid, timeout_s=30)

    async def calls() -> None:
        with pytest.raises(RuntimeError, match="closed"):
            await mesh.asleep(wid)
        with pytest.raises(RuntimeError, match="closed"):
            await mesh.awake(wid, timeout_s=30)

    asyncio.run(calls())
    assert mock.worker.stats.sleep_calls == 0
    assert state_of(mesh, wid) is State.READY
