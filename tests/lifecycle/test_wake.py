"""Requests to a sleeping vLLM worker: one wake, held requests, disconnects."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from harness import AsgiMode, wait_until
from lifecycle.conftest import CHAT, PATH, asleep_worker, state_of
from meshkit.core.lifecycle import State


def test_fifty_held_requests_share_one_wake(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock, mesh, wid = asleep_worker(mock_factory, mesh_factory, wake_ms=300)
    mode = run_mode(mesh)
    with ThreadPoolExecutor(50) as pool:
        replies = list(pool.map(lambda _: mode.request("POST", PATH, json=CHAT), range(50)))
    assert [r.status for r in replies] == [200] * 50
    stats = mock.worker.stats
    assert stats.wake_calls == 1
    assert stats.requests_total[PATH] == 50
    assert state_of(mesh, wid) is State.READY
    assert wait_until(lambda: mesh.total_load() == 0 and mesh.router.states.leases.total == 0)
    assert "mesh_wakes_total 1.0" in mesh.metrics.render().decode()


def test_no_wait_header_answers_503_with_retry_hints_and_still_starts_the_wake(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock, mesh, wid = asleep_worker(mock_factory, mesh_factory, wake_ms=1000)
    mode = run_mode(mesh)
    r = mode.request("POST", PATH, json=CHAT, headers={"x-mesh-wait": "false"})
    assert r.status == 503
    assert r.json()["error"]["code"] == "worker_waking"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert int(r.headers["retry-after-ms"]) == 200
    assert state_of(mesh, wid) is State.WAKING
    again = mode.request("POST", PATH, json=CHAT, headers={"x-mesh-wait": "false"})
    assert again.status == 503
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    assert mock.worker.stats.wake_calls == 1
    assert mock.worker.stats.requests_total.get(PATH, 0) == 0
    assert mode.request("POST", PATH, json=CHAT, headers={"x-mesh-wait": "false"}).status == 200


def test_a_wake_longer_than_wake_wait_is_503(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock, mesh, wid = asleep_worker(
        mock_factory, mesh_factory, wake_ms=1200, lifecycle={"wake_wait_s": 0.1}
    )
    mode = run_mode(mesh)
    r = mode.request("POST", PATH, json=CHAT)
    assert r.status == 503
    assert r.json()["error"]["code"] == "worker_waking"
    assert mesh.total_load() == 0
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    assert mode.request("POST", PATH, json=CHAT).status == 200
    assert mock.worker.stats.wake_calls == 1


def _raw_request(port: int) -> socket.socket:
    body = json.dumps({**CHAT, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST " + PATH.encode() + b" HTTP/1.1\r\nhost: mesh\r\n"
        b"content-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    return sock


def test_a_client_that_leaves_while_held_is_never_forwarded(
    mock_factory: Any, mesh_factory: Any
) -> None:
    mock, mesh, wid = asleep_worker(mock_factory, mesh_factory, wake_ms=1500)
    lc = mesh.router.states
    mode = AsgiMode(mesh)
    try:
        sock = _raw_request(mode.server.port)
        # Held: the wake started, the request waits on a future, and holds no lease.
        assert wait_until(lambda: mesh.router.waiting(wid))
        assert state_of(mesh, wid) is State.WAKING
        assert mesh.total_load() == 0 and lc.leases.total == 0
        sock.close()
        # The wait ends as soon as the disconnect is seen, not when the wake ends.
        assert wait_until(lambda: not mesh.router.waiting(wid))
        assert wait_until(lambda: state_of(mesh, wid) is State.READY)
        # A request after the wake is the only one the worker ever sees.
        assert mode.request("POST", PATH, json=CHAT).status == 200
        assert wait_until(lambda: mesh.total_load() == 0)
        stats = mock.worker.stats
        assert stats.requests_total[PATH] == 1
        assert stats.disconnects == 0
        assert lc.leases.total == 0
        assert stats.wake_calls == 1
    finally:
        mode.close()
