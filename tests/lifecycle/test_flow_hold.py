"""The forward flow's Hold step, driven by hand (pure), and the drivers' abandon."""

from __future__ import annotations

import json
import random
import socket
from typing import Any

import pytest

from harness import AsgiMode, wait_until
from lifecycle.conftest import CHAT, PATH
from meshkit import Worker
from meshkit.core.endpoints import resolve
from meshkit.core.forward import (
    Attempt,
    AttemptResult,
    Hold,
    RetryPolicy,
    WakePending,
    forward_flow,
)
from meshkit.core.requests import RequestView, parse_request
from meshkit.core.workers import Candidate
from meshkit.errors import WorkerWaking


class _Waiter:
    def wait_sync(self, deadline_s: float) -> bool:  # pragma: no cover - not driven here
        return True

    async def wait_async(self, deadline_s: float) -> bool:  # pragma: no cover
        return True


class _Lease:
    def __init__(self, cand: Candidate) -> None:
        self.candidate = cand
        self.started = 0.0
        self.releases: list[tuple[bool, int | None]] = []

    def release(self, *, ok: bool, status: int | None = None) -> None:
        self.releases.append((ok, status))

    def abandon(self) -> None:
        self.releases.append((False, None))


class Placer:
    """Raises WakePending for the first ``holds`` placements, then places on ``w``."""

    def __init__(self, holds: int) -> None:
        self.holds = holds
        self.cand = Candidate(Worker("http://w:1"))
        self.placements = 0
        self.leases: list[_Lease] = []

    def place(self, view: RequestView, *, exclude: frozenset[str], attempt: int) -> Candidate:
        self.placements += 1
        if self.holds:
            self.holds -= 1
            raise WakePending("http://w:1", 12.5, _Waiter(), 0.3)
        return self.cand

    capture_limit = 1024 * 1024  # bounds.max_captured_body_bytes

    def lease(self, cand: Candidate, view: RequestView, *, admission: bool = True) -> _Lease:
        lease = _Lease(cand)
        self.leases.append(lease)
        return lease

    def targets(self, view: RequestView) -> list[Candidate]:  # pragma: no cover
        return [self.cand]

    def lookup_targets(self, view: RequestView) -> list[Candidate]:  # pragma: no cover
        return []

    def remember_response(self, response_id: str, origin: str) -> None:  # pragma: no cover
        pass

    def remember_missing(self, response_id: str) -> None:  # pragma: no cover
        pass


def _flow(placer: Placer) -> Any:
    m = resolve("POST", PATH)
    assert m is not None
    view = parse_request(m, json.dumps(CHAT).encode())
    return forward_flow(
        placer, view, [], method="POST", retry=RetryPolicy(max_attempts=2), rng=random.Random(0)
    )


def test_hold_then_ready_places_again_without_using_an_attempt() -> None:
    placer = Placer(holds=1)
    flow = _flow(placer)
    hold = next(flow)
    assert isinstance(hold, Hold)
    assert (hold.worker_id, hold.deadline_s) == ("http://w:1", 12.5)
    assert placer.leases == []  # nothing is leased while held
    attempt = flow.send(AttemptResult.held(True))
    assert isinstance(attempt, Attempt) and attempt.number == 0
    with pytest.raises(StopIteration) as stop:
        flow.send(AttemptResult.response(200))
    assert stop.value.value is attempt


def test_hold_not_ready_is_worker_waking_with_the_hint() -> None:
    flow = _flow(Placer(holds=1))
    next(flow)
    with pytest.raises(WorkerWaking) as info:
        flow.send(AttemptResult.held(False))
    assert info.value.status == 503 and info.value.retry_after_s == 0.3


def test_a_request_holds_at_most_once() -> None:
    flow = _flow(Placer(holds=2))
    next(flow)
    with pytest.raises(WorkerWaking):
        flow.send(AttemptResult.held(True))


def test_a_pending_retryable_answer_is_relayed_rather_than_held() -> None:
    placer = Placer(holds=0)
    flow = _flow(placer)
    first = next(flow)
    placer.holds = 1  # the only other worker is asleep
    with pytest.raises(StopIteration) as stop:
        flow.send(AttemptResult.response(503))
    assert stop.value.value is first
    assert first.lease.releases == []  # the adapter relays it and releases it


def test_a_client_leaving_before_the_head_abandons_its_lease(
    mock_factory: Any, mesh_factory: Any
) -> None:
    """The lease is released at once, and the worker is not blamed (no breaker count)."""
    slow = mock_factory(name="slow", first_token_ms=5000)
    mesh = mesh_factory(workers=[Worker(slow.url)], lifecycle={"probe": False})
    lc = mesh.router.states
    wid = mesh.workers[0].id
    mode = AsgiMode(mesh)
    try:
        body = json.dumps(CHAT).encode()
        sock = socket.create_connection(("127.0.0.1", mode.server.port))
        sock.sendall(
            b"POST " + PATH.encode() + b" HTTP/1.1\r\nhost: m\r\ncontent-type: application/json"
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        assert wait_until(lambda: mesh.total_load() == 1)
        sock.close()
        assert wait_until(lambda: mesh.total_load() == 0)
        assert lc.leases.total == 0
        assert lc.machines[wid].breaker_failures == 0
        assert wid not in lc.breaker_dirty
    finally:
        mode.close()
