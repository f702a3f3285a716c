"""Bounded memory of the lifecycle's per-worker tables: a worker
that is removed leaves nothing behind, also when it was removed while it held a
lease, after it was slept and woken, and after its breaker tripped. Workers come
and go (discovery, autoscaling): anything keyed by a removed worker's id is a
leak that grows with every scale-down."""

from __future__ import annotations

from typing import Any

import httpx2

from harness import UvicornThread, wait_until
from lifecycle.conftest import CHAT, FAST, PATH, SLEEPY, state_of
from meshkit import Mesh, MeshMiddleware, Worker
from meshkit.core.lifecycle import State
from meshkit.lifecycle.admin import lifespan


async def _empty(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)


def _tables(mesh: Mesh) -> dict[str, Any]:
    states = mesh.router.states
    leases = states.leases
    return {
        "idle_since": leases._idle_since,
        "placed_at": leases.placed_at,
        "active": leases._active,
        "machines": states.machines,
        "ops": states.ops,
        "op_epoch": states.op_epoch,
        "trips": states.trips,
        "op_locks": mesh.lifecycle._op_locks,
    }


def test_a_removed_worker_leaves_no_entry_in_any_per_worker_table(
    mock_factory: Any, mesh_factory: Any
) -> None:
    sleepy = mock_factory(name="sleepy", sleep_mode=True, output_tokens=4000, per_token_ms=5.0)
    other = mock_factory(name="other")
    mesh = mesh_factory(
        workers=[Worker(sleepy.url, labels=SLEEPY)],
        lifecycle=FAST,
    )
    wid = mesh.workers[0].id
    mesh.start_lifecycle()
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    assert mesh.sleep(wid) and mesh.wake(wid)  # a sleep and a wake: ops, op locks
    with UvicornThread(MeshMiddleware(_empty, mesh=mesh)) as base:
        with (
            httpx2.Client(base_url=base, timeout=30) as client,
            client.stream("POST", PATH, json={**CHAT, "stream": True}) as s,
        ):
            chunks = s.iter_raw()  # kept: dropped, it would close the response
            next(chunks)
            assert mesh.router.states.leases.count(wid) == 1
            mesh.add_worker(Worker(other.url))
            mesh.remove_worker(wid, timeout_s=0)  # removed while the stream runs
        assert wait_until(lambda: mesh.total_load() == 0)
    left = {name: wid for name, table in _tables(mesh).items() if wid in table}
    assert left == {}, f"the removed worker is still in: {sorted(left)}"
