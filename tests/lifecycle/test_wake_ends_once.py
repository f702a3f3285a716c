"""A wake ends exactly once: a wake whose call raised (the wake gate's ask was
cancelled because the server's loop went away, or a bug) must not end a second
time from the future's callback, where it would end the next wake instead."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness import wait_until
from lifecycle.conftest import asleep_worker, state_of
from meshkit import Worker
from meshkit.core.lifecycle import State


class FailsOnce:
    """A :class:`~meshkit.lifecycle.controller.WakeGate` whose first ask raises
    ``exc``, right after a new wake was asked for (it runs on the lifecycle's loop
    before the failed wake's callbacks do); later asks say "wake it here"."""

    def __init__(self, exc: type[BaseException], then: Any) -> None:
        self.exc = exc
        self.then = then
        self.calls = 0

    async def wake(self, worker: Worker) -> bool | None:
        self.calls += 1
        if self.calls == 1:
            asyncio.get_running_loop().call_soon(self.then)
            raise self.exc
        return None


@pytest.mark.parametrize("exc", [asyncio.CancelledError, LookupError])
def test_a_wake_asked_as_a_failed_one_ends_is_sent(
    mock_factory: Any, mesh_factory: Any, exc: type[BaseException]
) -> None:
    mock, mesh, wid = asleep_worker(mock_factory, mesh_factory, wake_ms=0)
    gate = FailsOnce(exc, lambda: mesh.router.ask_wake(wid))
    mesh.lifecycle.wake_gate = gate
    mesh.router.ask_wake(wid)
    # The second wake was asked while the worker was asleep again (the first
    # failed): it must be sent, not ended by the first one's late "failed".
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    assert gate.calls == 2
    assert mock.worker.stats.wake_calls == 1
    assert mesh.router.states.ops == {}
