"""Helpers for the lifecycle tests: fast lifecycle settings and a sleeping worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness import wait_until
from meshkit import Mesh, Worker
from meshkit.core.lifecycle import State
from meshkit.mock import MockWorkerThread

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
PATH = "/v1/chat/completions"
SLEEPY = {"mesh.sleep_mode": "vllm"}
#: small intervals so the tests poll for conditions, never for wall time
FAST: dict[str, Any] = {
    "health_interval_s": 0.05,
    "health_timeout_s": 2.0,
    "wake_retry_after_s": 0.2,
    "wake_wait_s": 20.0,
}


def state_of(mesh: Mesh, worker_id: str) -> State:
    return mesh.router.states.machines[worker_id].state


def asleep_worker(
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
    *,
    wake_ms: float = 300.0,
    lifecycle: dict[str, Any] | None = None,
    **mock_kw: Any,
) -> tuple[MockWorkerThread, Mesh, str]:
    """A sleep-mode mock put to sleep through the mesh (probed ready first)."""
    mock = mock_factory(name="sleepy", sleep_mode=True, wake_ms=wake_ms, **mock_kw)
    mesh = mesh_factory(
        workers=[Worker(mock.url, labels=SLEEPY)], lifecycle={**FAST, **(lifecycle or {})}
    )
    wid = mesh.workers[0].id
    mesh.start_lifecycle()
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    assert mesh.sleep(wid)
    assert state_of(mesh, wid) is State.SLEEPING
    assert mock.worker.stats.sleep_calls == 1
    return mock, mesh, wid
