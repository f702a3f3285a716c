"""Drain and remove: no new placements, wait for leases, bounded by a timeout."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from harness import TransportMode, wait_until
from lifecycle.conftest import CHAT, PATH, state_of
from meshkit import Mesh, Worker
from meshkit.core.lifecycle import State

SLOW = {"output_tokens": 10, "per_token_ms": 20}


def _two(mock_factory: Any, mesh_factory: Any) -> tuple[Mesh, TransportMode, str]:
    a = mock_factory(name="a", **SLOW)
    b = mock_factory(name="b")
    mesh = mesh_factory(workers=[Worker(a.url), Worker(b.url)], lifecycle={"probe": False})
    return mesh, TransportMode(mesh), mesh.workers[0].id


def test_drain_waits_for_a_stream_then_reports_drained(
    mock_factory: Any, mesh_factory: Any
) -> None:
    mesh, mode, a = _two(mock_factory, mesh_factory)
    try:
        result: dict[str, bool] = {}
        with mode.stream("POST", PATH, json={**CHAT, "stream": True}) as chunks:
            it = iter(chunks)
            next(it)  # round robin: on a, and its lease lives until the body is read
            t = threading.Thread(target=lambda: result.update(d=mesh.drain(a, timeout_s=30)))
            t.start()
            assert wait_until(lambda: state_of(mesh, a) is State.DRAINING)
            for _ in range(3):
                r = mode.request("POST", PATH, json=CHAT)
                assert r.headers["x-mock-worker"] == "b"  # no new placement on a
            assert t.is_alive()  # the stream still holds its lease
            b"".join(it)
        t.join(10)
        assert result == {"d": True}
        assert state_of(mesh, a) is State.DRAINING  # one-way until removed
    finally:
        mode.close()


def test_drain_gives_up_after_its_timeout(mock_factory: Any, mesh_factory: Any) -> None:
    mesh, mode, a = _two(mock_factory, mesh_factory)
    try:
        with mode.stream("POST", PATH, json={**CHAT, "stream": True}) as chunks:
            it = iter(chunks)
            next(it)
            assert mesh.drain(a, timeout_s=0.1) is False
            b"".join(it)
    finally:
        mode.close()


def test_remove_worker_waits_for_the_drain(mock_factory: Any, mesh_factory: Any) -> None:
    mesh, mode, a = _two(mock_factory, mesh_factory)
    try:
        removed: list[Any] = []
        with mode.stream("POST", PATH, json={**CHAT, "stream": True}) as chunks:
            it = iter(chunks)
            next(it)
            t = threading.Thread(target=lambda: removed.append(mesh.remove_worker(a)))
            t.start()
            assert wait_until(lambda: state_of(mesh, a) is State.DRAINING)
            assert a in {w.id for w in mesh.workers}  # still there while the stream runs
            b"".join(it)
        t.join(10)
        assert [w.id for w in removed] == [a]
        assert a not in {w.id for w in mesh.workers}
        assert a not in mesh.router.states.machines
        assert wait_until(lambda: mesh.total_load() == 0)
    finally:
        mode.close()


def test_async_drain_and_remove(mock_factory: Any, mesh_factory: Any) -> None:
    mesh, mode, a = _two(mock_factory, mesh_factory)
    try:
        with mode.stream("POST", PATH, json={**CHAT, "stream": True}) as chunks:
            it = iter(chunks)
            next(it)

            async def drain_briefly() -> bool:
                return await mesh.adrain(a, timeout_s=0.1)

            assert asyncio.run(drain_briefly()) is False
            b"".join(it)

        async def remove() -> Any:
            return await mesh.aremove_worker(a, timeout_s=10)

        assert asyncio.run(remove()).id == a
    finally:
        mode.close()


def test_an_idle_worker_drains_at_once(mock_factory: Any, mesh_factory: Any) -> None:
    mesh, mode, a = _two(mock_factory, mesh_factory)
    mode.close()
    assert mesh.drain(a, timeout_s=5) is True
