"""Tests for the forward and fan-out flows (:mod:`meshkit.core.forward`, ``fanout``).

The flows are driven by hand with a fake :class:`~meshkit.core.forward.Placer` over a
real :class:`~meshkit.core.workers.Fleet`, :func:`~meshkit.core.placement.place` and
round robin, and hand-made :class:`~meshkit.core.forward.AttemptResult` values. Every
lease counts its releases, so "released exactly once, or returned live" is checked
directly.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.core.endpoints import resolve
from meshkit.core.fanout import models_flow, resource_flow
from meshkit.core.forward import (
    RETRYABLE_STATUS,
    Attempt,
    AttemptResult,
    Failure,
    ForwardFlow,
    LocalResponse,
    RetryPolicy,
    forward_flow,
)
from meshkit.core.placement import configured_for, overloaded, place
from meshkit.core.policies.simple import RoundRobin
from meshkit.core.requests import RequestView, parse_request
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import (
    MeshError,
    ModelNotFound,
    NoAvailableWorkers,
    Overloaded,
    UnsupportedApi,
    UpstreamError,
    UpstreamTimeout,
)

P = pytest.param
OK = AttemptResult.response(200)
CONNECT = AttemptResult.failed(Failure.CONNECT)
TIMEOUT = AttemptResult.failed(Failure.TIMEOUT)
PROTOCOL = AttemptResult.failed(Failure.PROTOCOL)
POOL = AttemptResult.failed(Failure.POOL)
CLIENT_HEADERS = [
    (b"Authorization", b"Bearer sk-client"),
    (b"Content-Type", b"application/json"),
    (b"Content-Length", b"99"),
]

# --------------------------------------------------------------------------------------
# the fake placer
# --------------------------------------------------------------------------------------


@dataclass
class FakeLease:
    fleet: Fleet
    candidate: Candidate
    weight: int
    #: (ok, status) per release; (None, None) for a release without a verdict
    releases: list[tuple[bool | None, int | None]] = field(default_factory=list)
    started = 0.0  # Lease.started (not a field: a fake lease has no clock)

    def release(self, *, ok: bool, status: int | None = None) -> None:
        self._end((ok, status))

    def abandon(self) -> None:
        self._end((None, None))

    def _end(self, how: tuple[bool | None, int | None]) -> None:
        self.releases.append(how)
        if len(self.releases) == 1:
            self.fleet.release(self.candidate, self.weight)


NEUTRAL = (None, None)


class FakePlacer:
    """place/lease/targets over a real Fleet, placement.place and RoundRobin; the
    lease checks the admission limits again, as ``Mesh.lease`` does."""

    capture_limit = 1024 * 1024  # bounds.max_captured_body_bytes

    def __init__(
        self,
        workers: Iterable[Worker],
        *,
        unhealthy: Iterable[str] = (),
        max_in_flight: int = 0,
        max_in_flight_per_worker: int = 0,
    ) -> None:
        self.fleet = Fleet(
            workers, max_in_flight=max_in_flight, max_in_flight_per_worker=max_in_flight_per_worker
        )
        self.fleet.unhealthy.update(unhealthy)
        self.policy = RoundRobin()
        self.rng = random.Random(0)
        self.leases: list[FakeLease] = []
        self.placements: list[tuple[frozenset[str], int]] = []

    def place(self, view: RequestView, *, exclude: frozenset[str], attempt: int) -> Candidate:
        self.placements.append((exclude, attempt))
        return place(self.fleet, self.policy, view, self.rng, exclude=exclude, attempt=attempt)

    def lease(self, cand: Candidate, view: RequestView, *, admission: bool = True) -> FakeLease:
        if not self.fleet.admits(cand.worker):
            raise overloaded(self.fleet, 1, "full")
        self.fleet.acquire(cand, view.prompt_weight)
        lease = FakeLease(self.fleet, cand, view.prompt_weight)
        self.leases.append(lease)
        return lease

    def lookup_targets(self, view: RequestView) -> list[Candidate]:
        return []

    def remember_response(self, response_id: str, origin: str) -> None:
        pass

    def remember_missing(self, response_id: str) -> None:
        pass

    def targets(self, view: RequestView) -> list[Candidate]:
        by_origin: dict[str, Candidate] = {}
        workers = configured_for(self.fleet, view)
        for w in sorted(workers, key=lambda w: not self.fleet.healthy(w)):
            cands = self.fleet.candidates_of(w)
            if cands and w.origin not in by_origin:
                by_origin[w.origin] = cands[0]
        return list(by_origin.values())

    def release_counts(self) -> list[int]:
        return [len(le.releases) for le in self.leases]


@dataclass
class Run:
    attempts: list[Attempt]
    final: Attempt | LocalResponse | None = None
    error: MeshError | None = None
    #: release counts of every lease at the moment each attempt was yielded
    at_yield: list[list[int]] = field(default_factory=list)


def drive(flow: ForwardFlow, outcomes: Sequence[AttemptResult], placer: FakePlacer) -> Run:
    """Feed ``outcomes`` to ``flow`` in order until it returns or raises."""
    run = Run([])
    it = iter(outcomes)
    try:
        step = next(flow)
        while True:
            run.attempts.append(cast(Attempt, step))  # these flows never hold or pair
            run.at_yield.append(placer.release_counts())
            step = flow.send(next(it))
    except StopIteration as stop:
        run.final = stop.value
    except MeshError as exc:
        run.error = exc
    return run


def view_of(
    path: str = "/v1/chat/completions", body: Any = None, method: str = "POST"
) -> RequestView:
    m = resolve(method, path)
    assert m is not None
    if body is None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    raw = json.dumps(body).encode() if m.endpoint.has_body else b""
    return parse_request(m, raw)


def W(name: str, key: str | None = None, **labels: str) -> Worker:
    return Worker(
        f"http://{name}:8000", api_key=key, labels={f"mesh.{k}": v for k, v in labels.items()}
    )


def fwd(placer: FakePlacer, view: RequestView, max_attempts: int = 3, **kw: Any) -> ForwardFlow:
    return forward_flow(
        placer,
        view,
        CLIENT_HEADERS,
        method="POST",
        retry=RetryPolicy(max_attempts=max_attempts, **kw),
        rng=random.Random(1),
    )


def header(attempt: Attempt, name: bytes) -> list[bytes]:
    return [v for k, v in attempt.headers if k == name]


def _err(status: int, marker: str) -> AttemptResult:
    body = json.dumps({"error": {"message": marker}}).encode()
    return AttemptResult(
        status=status, headers=((b"content-type", b"application/json"),), body=body
    )


# --------------------------------------------------------------------------------------
# forward_flow
# --------------------------------------------------------------------------------------


def test_success_first_try_returns_live_lease() -> None:
    placer = FakePlacer([W("a"), W("b")])
    v = view_of()
    run = drive(fwd(placer, v), [OK], placer)
    assert run.error is None
    assert run.final is run.attempts[0]
    assert len(run.attempts) == 1
    a0 = run.attempts[0]
    assert a0.lease is placer.leases[0]
    assert placer.release_counts() == [0]
    assert placer.fleet.load[a0.candidate.key] == 1
    assert a0.url == "http://a:8000/v1/chat/completions"
    assert a0.method == "POST"
    assert a0.body is v.body
    assert a0.delay_s == 0.0
    assert a0.number == 0


@pytest.mark.parametrize("status", sorted(RETRYABLE_STATUS))
def test_retryable_status_moves_to_another_worker(status: int) -> None:
    assert status in {408, 429, 500, 502, 503, 504, 529}
    placer = FakePlacer([W("a"), W("b"), W("c")])
    v = view_of()
    run = drive(fwd(placer, v), [AttemptResult.response(status), OK], placer)
    a0, a1 = run.attempts
    assert run.final is a1
    assert a1.candidate.key != a0.candidate.key
    assert a0.body is v.body and a1.body is v.body  # the same original bytes
    # the failed lease was released (once) before the next attempt was handed out
    assert run.at_yield[1] == [1, 0]
    assert placer.leases[0].releases == [(False, status)]
    assert placer.release_counts() == [1, 0]
    assert placer.fleet.load[a0.candidate.key] == 0
    assert placer.fleet.load[a1.candidate.key] == 1
    assert placer.placements[1] == (frozenset({a0.candidate.key}), 1)
    assert a1.history == [
        (a0.candidate.key, AttemptResult.response(status)),
        (a1.candidate.key, OK),
    ]


@pytest.mark.parametrize(
    "status", [200, 201, 204, 301, 304, 400, 401, 403, 404, 409, 413, 415, 422, 501, 505]
)
def test_non_retryable_status_is_returned_as_is(status: int) -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(fwd(placer, view_of()), [AttemptResult.response(status)], placer)
    assert run.final is run.attempts[0]
    assert len(run.attempts) == 1
    assert placer.release_counts() == [0]


def test_last_attempts_retryable_response_is_returned() -> None:
    placer = FakePlacer([W("a"), W("b"), W("c"), W("d")])
    outcomes = [AttemptResult.response(s) for s in (503, 502, 429)]
    run = drive(fwd(placer, view_of(), max_attempts=3), outcomes, placer)
    assert len(run.attempts) == 3
    assert run.final is run.attempts[2]
    assert placer.release_counts() == [1, 1, 0]
    assert len({a.candidate.key for a in run.attempts}) == 3


@pytest.mark.parametrize("failure", [P(CONNECT, id="connect"), P(PROTOCOL, id="protocol")])
def test_connect_failure_moves_to_next_worker(failure: AttemptResult) -> None:
    placer = FakePlacer([W("a"), W("b"), W("c")])
    run = drive(fwd(placer, view_of()), [failure, failure, OK], placer)
    assert run.final is run.attempts[2]
    assert placer.release_counts() == [1, 1, 0]
    assert placer.leases[0].releases == [(False, None)]
    assert len({a.candidate.key for a in run.attempts}) == 3


@pytest.mark.parametrize("failure", [P(CONNECT, id="connect"), P(PROTOCOL, id="protocol")])
def test_connect_failure_on_last_attempt_is_502(failure: AttemptResult) -> None:
    placer = FakePlacer([W("a"), W("b"), W("c"), W("d")])
    run = drive(fwd(placer, view_of(), max_attempts=3), [failure] * 3, placer)
    assert isinstance(run.error, UpstreamError)
    assert (run.error.status, run.error.code) == (502, "upstream_error")
    assert len(run.attempts) == 3
    assert placer.release_counts() == [1, 1, 1]
    assert all(n == 0 for n in placer.fleet.load.values())


def test_connect_failures_exhausting_the_fleet_is_502_not_503() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(fwd(placer, view_of(), max_attempts=5), [CONNECT, CONNECT], placer)
    assert type(run.error) is UpstreamError
    assert placer.release_counts() == [1, 1]


def test_timeout_is_504_without_retry() -> None:
    placer = FakePlacer([W("a"), W("b"), W("c")])
    run = drive(fwd(placer, view_of()), [TIMEOUT, OK], placer)
    assert isinstance(run.error, UpstreamTimeout)
    assert (run.error.status, run.error.code) == (504, "upstream_timeout")
    assert len(run.attempts) == 1
    assert placer.release_counts() == [1]


def test_timeout_after_a_retryable_status() -> None:
    placer = FakePlacer([W("a"), W("b"), W("c")])
    run = drive(fwd(placer, view_of()), [AttemptResult.response(503), TIMEOUT], placer)
    assert isinstance(run.error, UpstreamTimeout)
    assert placer.release_counts() == [1, 1]


@pytest.mark.parametrize("status", [429, 503, 529])
def test_single_worker_retryable_response_is_relayed(status: int) -> None:
    # no other worker: relay the worker's own answer (its Retry-After and body),
    # not a 503 no_available_workers of meshkit's own
    placer = FakePlacer([W("a")])
    run = drive(fwd(placer, view_of()), [AttemptResult.response(status)], placer)
    assert run.error is None
    assert run.final is run.attempts[0]
    assert placer.release_counts() == [0]
    assert placer.fleet.load[run.attempts[0].candidate.key] == 1


def test_retryable_response_relayed_when_others_unhealthy() -> None:
    b = W("b")
    placer = FakePlacer([W("a"), b], unhealthy=[b.id])
    run = drive(fwd(placer, view_of()), [AttemptResult.response(503)], placer)
    assert run.final is run.attempts[0]
    assert placer.release_counts() == [0]


def test_connect_failure_then_retryable_response_relays_it() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(fwd(placer, view_of()), [CONNECT, AttemptResult.response(503)], placer)
    assert run.final is run.attempts[1]
    assert placer.release_counts() == [1, 0]


def test_retryable_then_connect_failure_with_fleet_exhausted_is_502() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(fwd(placer, view_of()), [AttemptResult.response(503), CONNECT], placer)
    assert type(run.error) is UpstreamError
    assert placer.release_counts() == [1, 1]


def test_no_worker_at_all_is_503() -> None:
    b = W("b")
    placer = FakePlacer([b], unhealthy=[b.id])
    run = drive(fwd(placer, view_of()), [], placer)
    assert isinstance(run.error, NoAvailableWorkers)
    assert run.attempts == []
    assert placer.leases == []


def test_dp_ranks_of_one_worker_are_other_candidates() -> None:
    placer = FakePlacer([W("a", dp_size="2")])
    v = view_of()
    run = drive(fwd(placer, v), [AttemptResult.response(503), OK], placer)
    a0, a1 = run.attempts
    assert run.final is a1
    assert (a0.candidate.rank, a1.candidate.rank) == (0, 1)
    assert json.loads(a0.body)["data_parallel_rank"] == 0
    assert json.loads(a1.body)["data_parallel_rank"] == 1


@pytest.mark.parametrize("max_attempts", [0, 1])
def test_single_attempt_policy(max_attempts: int) -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(fwd(placer, view_of(), max_attempts=max_attempts), [CONNECT], placer)
    assert isinstance(run.error, UpstreamError)
    assert len(run.attempts) == 1


def test_other_placement_error_on_retry_does_not_leak_the_pending_lease() -> None:
    class Shrinking(FakePlacer):
        def place(self, view: RequestView, *, exclude: frozenset[str], attempt: int) -> Candidate:
            if attempt > 0:  # the fleet changed while the first worker answered
                raise UnsupportedApi("no configured worker serves /v1/chat/completions")
            return super().place(view, exclude=exclude, attempt=attempt)

    placer = Shrinking([W("a"), W("b")])
    run = drive(fwd(placer, view_of()), [AttemptResult.response(503)], placer)
    if run.error is None:
        assert run.final is run.attempts[0]
        assert placer.release_counts() == [0]
    else:
        assert placer.release_counts() == [1]


# --------------------------------------------------------------------------------------
# credentials, rank and body of the new worker on a retry
# --------------------------------------------------------------------------------------


def test_retry_uses_the_new_workers_credentials_and_rank() -> None:
    a = W("a", key="sk-a")
    b = W("b", key="sk-b", dp_size="2")
    placer = FakePlacer([a, b])
    v = view_of()
    run = drive(fwd(placer, v), [AttemptResult.response(502), OK], placer)
    a0, a1 = run.attempts
    assert a0.candidate.worker is a and a1.candidate.worker is b
    assert header(a0, b"authorization") == [b"Bearer sk-a"]
    assert header(a0, b"x-data-parallel-rank") == []
    assert a0.body is v.body
    assert header(a1, b"authorization") == [b"Bearer sk-b"]
    assert header(a1, b"x-data-parallel-rank") == [str(a1.candidate.rank).encode()]
    assert json.loads(a1.body) == {**json.loads(v.body), "data_parallel_rank": a1.candidate.rank}
    assert a1.url.startswith("http://b:8000/")
    for att in run.attempts:
        assert b"sk-client" not in b"".join(val for _, val in att.headers)
        assert header(att, b"content-length") == []


def test_retry_from_dp_worker_to_plain_worker_drops_the_rank() -> None:
    b = W("b", dp_size="2")
    a = W("a")
    placer = FakePlacer([b, a])
    v = view_of()
    run = drive(fwd(placer, v), [CONNECT, CONNECT, OK], placer)
    plain = [att for att in run.attempts if att.candidate.worker is a]
    assert len(plain) == 1
    assert plain[0].body is v.body
    assert header(plain[0], b"x-data-parallel-rank") == []


def test_no_worker_key_keeps_client_credentials() -> None:
    placer = FakePlacer([W("a")])
    run = drive(fwd(placer, view_of()), [OK], placer)
    assert header(run.attempts[0], b"authorization") == [b"Bearer sk-client"]


@pytest.mark.parametrize(
    ("path", "body", "apis", "sends"),
    [
        P("/v1/chat/completions", None, None, True, id="chat-undeclared"),
        P("/v1/completions", {"prompt": "x"}, None, True, id="completions"),
        P("/generate", {"text": "x"}, None, True, id="generate"),
        P("/v1/messages", {"messages": []}, None, False, id="messages-undeclared"),
        P("/v1/messages", {"messages": []}, "messages", True, id="messages-declared"),
        P("/v1/responses", {"input": "x"}, None, False, id="responses-undeclared"),
        P("/v1/responses", {"input": "x"}, "chat,responses", True, id="responses-declared"),
        # a conversation is the server's, not a rank's: nothing to add to its body
        P("/v1/conversations", {}, "chat,responses", False, id="conversation-create"),
    ],
)
def test_rank_only_where_the_worker_takes_it(
    path: str, body: Any, apis: str | None, sends: bool
) -> None:
    labels = {"dp_size": "4"} | ({"apis": apis} if apis else {})
    placer = FakePlacer([W("a", **labels)])
    v = view_of(path, body)
    run = drive(fwd(placer, v), [OK], placer)
    att = run.attempts[0]
    if sends:
        assert json.loads(att.body)["data_parallel_rank"] == att.candidate.rank
        assert header(att, b"x-data-parallel-rank") == [str(att.candidate.rank).encode()]
    else:
        assert att.body is v.body
        assert header(att, b"x-data-parallel-rank") == []


def test_client_rank_is_replaced_by_the_chosen_one() -> None:
    placer = FakePlacer([W("a", dp_size="2")])
    v = view_of(body={"data_parallel_rank": 7, "model": "m", "messages": []})
    assert v.has_dp_rank
    run = drive(fwd(placer, v), [AttemptResult.response(500), OK], placer)
    for att in run.attempts:
        assert att.body.count(b"data_parallel_rank") == 1
        assert json.loads(att.body)["data_parallel_rank"] == att.candidate.rank


@pytest.mark.parametrize("path", ["/v1/tokenize", "/detokenize"])
def test_client_rank_not_duplicated_on_tokenize(path: str) -> None:
    placer = FakePlacer([W("a", dp_size="2")])
    v = view_of(path, {"prompt": "x", "data_parallel_rank": 1})
    run = drive(fwd(placer, v), [OK], placer)
    assert run.attempts[0].body.count(b"data_parallel_rank") <= 1


def test_query_string_is_forwarded() -> None:
    placer = FakePlacer([W("a")])
    v = view_of()
    v.query = "api-version=1&x=y"
    run = drive(fwd(placer, v), [OK], placer)
    assert run.attempts[0].url == "http://a:8000/v1/chat/completions?api-version=1&x=y"


def test_worker_base_path_prefixes_the_canonical_path() -> None:
    placer = FakePlacer([Worker("http://a:8000/engine/")])
    run = drive(fwd(placer, view_of()), [OK], placer)
    assert run.attempts[0].url == "http://a:8000/engine/v1/chat/completions"


# --------------------------------------------------------------------------------------
# backoff
# --------------------------------------------------------------------------------------


def test_backoff_delays_on_attempts() -> None:
    placer = FakePlacer([W(n) for n in "abcde"])
    outcomes = [CONNECT] * 4 + [OK]
    run = drive(
        fwd(placer, view_of(), max_attempts=5, backoff_base_s=0.1, backoff_max_s=0.3),
        outcomes,
        placer,
    )
    delays = [a.delay_s for a in run.attempts]
    assert delays[0] == 0.0  # the first try
    assert delays[1] == 0.0  # the first move: another worker, no reason to wait
    assert 0.05 <= delays[2] <= 0.1
    assert 0.1 <= delays[3] <= 0.2
    assert 0.15 <= delays[4] <= 0.3


@settings(max_examples=200, deadline=None)
@given(
    base=st.floats(0, 5),
    cap=st.floats(0, 5),
    retry=st.integers(0, 64),
    seed=st.integers(0, 2**32),
)
def test_backoff_within_bounds(base: float, cap: float, retry: int, seed: int) -> None:
    d = RetryPolicy(backoff_base_s=base, backoff_max_s=cap).delay(retry, random.Random(seed))
    assert 0.0 <= d <= cap
    if retry <= 1:
        assert d == 0.0


# --------------------------------------------------------------------------------------
# property: leases are released exactly once, or returned live
# --------------------------------------------------------------------------------------

_OUTCOMES = st.sampled_from(
    [AttemptResult.response(s) for s in (200, 201, 400, 404, 408, 429, 500, 502, 503, 504, 529)]
    + [CONNECT, TIMEOUT, PROTOCOL]
)


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    down=st.lists(st.booleans(), min_size=4, max_size=4),
    max_attempts=st.integers(1, 6),
    outcomes=st.lists(_OUTCOMES, min_size=12, max_size=12),
)
def test_every_lease_released_once_or_returned(
    sizes: list[int], down: list[bool], max_attempts: int, outcomes: list[AttemptResult]
) -> None:
    workers = [W(f"w{i}", key=f"sk-{i}", dp_size=str(n)) for i, n in enumerate(sizes)]
    placer = FakePlacer(workers, unhealthy=[w.id for w, d in zip(workers, down, strict=False) if d])
    v = view_of()
    run = drive(fwd(placer, v, max_attempts=max_attempts), outcomes, placer)
    eligible = [
        c for w in workers if placer.fleet.healthy(w) for c in placer.fleet.candidates_of(w)
    ]
    counts = placer.release_counts()
    assert len(counts) == len(run.attempts)
    assert all(n <= 1 for n in counts)
    keys = [a.candidate.key for a in run.attempts]
    assert len(set(keys)) == len(keys)  # never the same candidate twice
    assert len(run.attempts) <= min(max_attempts, len(eligible)) or not eligible
    for i, att in enumerate(run.attempts):
        assert att.lease is placer.leases[i]
        assert att.number == i
        assert att.candidate.worker.api_key is not None
        assert header(att, b"authorization") == [f"Bearer {att.candidate.worker.api_key}".encode()]
        assert json.loads(att.body) == {
            **json.loads(v.body),
            "data_parallel_rank": att.candidate.rank,
        } or (att.candidate.rank is None and att.body is v.body)
        if i <= 1:
            assert att.delay_s == 0.0
        assert 0.0 <= att.delay_s <= RetryPolicy().backoff_max_s
        # a lease handed out earlier was settled before the next attempt was yielded
        assert run.at_yield[i][:i] == [1] * i
    if run.error is None:
        assert isinstance(run.final, Attempt)
        last = run.attempts.index(run.final)
        assert last == len(run.attempts) - 1
        assert counts == [1] * last + [0]
        assert sum(placer.fleet.load.values()) == 1
        assert placer.fleet.load[run.final.candidate.key] == 1
        result = outcomes[last]
        assert result.failure is None
        if result.status in RETRYABLE_STATUS:
            # relayed only when no other attempt was possible
            assert len(run.attempts) == max_attempts or len(run.attempts) == len(eligible)
    else:
        assert counts == [1] * len(counts)
        assert sum(placer.fleet.load.values()) == 0
        if not eligible:
            assert isinstance(run.error, NoAvailableWorkers)
        elif isinstance(run.error, UpstreamTimeout):
            assert outcomes[len(run.attempts) - 1] is TIMEOUT
        else:
            assert type(run.error) is UpstreamError
            assert outcomes[len(run.attempts) - 1].failure in (Failure.CONNECT, Failure.PROTOCOL)


# --------------------------------------------------------------------------------------
# the lookup of a referenced response or conversation this process did not place
# --------------------------------------------------------------------------------------


class LookupPlacer(FakePlacer):
    """Knows no owner: asks every origin (as ``Router.lookup_targets`` does), and
    places on the owner it was told of."""

    def __init__(self, workers: Iterable[Worker]) -> None:
        super().__init__(workers)
        self.owners: dict[str, str] = {}
        self.missing: list[str] = []

    def lookup_targets(self, view: RequestView) -> list[Candidate]:
        sid = view.state_id
        if not sid or sid in self.owners or sid in self.missing:
            return []
        return self.targets(view)

    def remember_response(self, response_id: str, origin: str) -> None:
        self.owners[response_id] = origin

    def remember_missing(self, response_id: str) -> None:
        self.missing.append(response_id)

    def place(self, view: RequestView, *, exclude: frozenset[str], attempt: int) -> Candidate:
        owner = self.owners.get(view.state_id or "")
        return place(self.fleet, self.policy, view, self.rng, exclude=exclude, owner=owner)


STATE_REFS = [
    P({"previous_response_id": "resp_1"}, "/v1/responses/resp_1", id="response"),
    P({"conversation": "conv_1"}, "/v1/conversations/conv_1", id="conversation"),
    P({"conversation": {"id": "conv_1"}}, "/v1/conversations/conv_1", id="conversation-obj"),
]


@pytest.mark.parametrize(("ref", "lookup"), STATE_REFS)
def test_the_owner_is_asked_for_at_the_state_objects_path(ref: Any, lookup: str) -> None:
    placer = LookupPlacer([W("a", key="sk-a"), W("b", key="sk-b"), W("c")])
    v = view_of("/v1/responses", {"model": "m", "input": "x", **ref})
    run = drive(fwd(placer, v), [_err(404, "a"), OK, OK], placer)
    ask_a, ask_b, final = run.attempts
    for ask, host in ((ask_a, "a"), (ask_b, "b")):
        assert (ask.method, ask.url, ask.body) == ("GET", f"http://{host}:8000{lookup}", b"")
        assert ask.probe
        assert ask.read_body == "always"
        assert header(ask, b"authorization") == [f"Bearer sk-{host}".encode()]
    # stops at the owner, remembers it, and the request goes there
    assert placer.owners == {v.state_id: "http://b:8000"}
    assert final is run.final
    assert not final.probe
    assert (final.method, final.url) == ("POST", "http://b:8000/v1/responses")
    assert placer.release_counts() == [1, 1, 0]


@pytest.mark.parametrize(("ref", "lookup"), STATE_REFS)
def test_an_id_no_origin_holds_is_remembered_and_501(ref: Any, lookup: str) -> None:
    from meshkit.errors import StatefulRoutingUnsupported

    placer = LookupPlacer([W("a"), W("b")])
    v = view_of("/v1/responses", {"model": "m", "input": "x", **ref})
    run = drive(fwd(placer, v), [_err(404, "a"), _err(404, "b")], placer)
    assert [a.url for a in run.attempts] == [f"http://a:8000{lookup}", f"http://b:8000{lookup}"]
    assert type(run.error) is StatefulRoutingUnsupported
    assert placer.missing == [v.state_id]
    # asked once: the next request with it asks nobody
    again = drive(fwd(placer, v), [], placer)
    assert again.attempts == []
    assert type(again.error) is StatefulRoutingUnsupported
    assert placer.release_counts() == [1, 1]


@pytest.mark.parametrize(("ref", "lookup"), STATE_REFS)
@pytest.mark.parametrize("down", [CONNECT, TIMEOUT, _err(503, "down")])
def test_an_origin_that_cannot_be_asked_is_502_never_a_move(
    ref: Any, lookup: str, down: AttemptResult
) -> None:
    placer = LookupPlacer([W("a"), W("b"), W("c")])
    v = view_of("/v1/responses", {"model": "m", "input": "x", **ref})
    run = drive(fwd(placer, v), [_err(404, "a"), down, _err(404, "c")], placer)
    assert all(a.probe and a.url.endswith(lookup) for a in run.attempts)
    assert type(run.error) is UpstreamError
    assert (placer.owners, placer.missing) == ({}, [])  # asked again next time
    assert placer.release_counts() == [1, 1, 1]
    assert placer.leases[1].releases == [(False, down.status)]


# --------------------------------------------------------------------------------------
# resource_flow
# --------------------------------------------------------------------------------------


def res(placer: FakePlacer, method: str = "GET", path: str = "/v1/responses/resp_1") -> ForwardFlow:
    v = view_of(path, method=method)
    return resource_flow(placer, v, CLIENT_HEADERS, method=method)


def test_resource_first_success_is_returned() -> None:
    placer = FakePlacer([W("a", key="sk-a"), W("b", key="sk-b"), W("c")])
    run = drive(res(placer), [_err(404, "a"), OK], placer)
    a0, a1 = run.attempts
    assert run.final is a1
    assert placer.release_counts() == [1, 0]
    assert placer.leases[0].releases == [(False, 404)]
    assert a0.url == "http://a:8000/v1/responses/resp_1"
    assert a1.url == "http://b:8000/v1/responses/resp_1"
    assert header(a0, b"authorization") == [b"Bearer sk-a"]
    assert header(a1, b"authorization") == [b"Bearer sk-b"]
    assert all(a.read_body == "errors" and a.method == "GET" for a in run.attempts)


@pytest.mark.parametrize(
    ("outcomes", "status", "marker"),
    [
        P([_err(500, "a"), _err(404, "b"), CONNECT], 404, "b", id="404-over-5xx"),
        P([CONNECT, _err(503, "b"), _err(500, "c")], 503, "b", id="5xx-over-connect-first-kept"),
        P([_err(502, "a"), _err(401, "b"), _err(404, "c")], 404, "c", id="404-over-4xx"),
        P([_err(500, "a"), _err(401, "b"), CONNECT], 401, "b", id="4xx-over-5xx"),
        P([TIMEOUT, CONNECT, _err(504, "c")], 504, "c", id="any-status-over-failures"),
        P([_err(404, "a"), _err(404, "b"), _err(404, "c")], 404, "a", id="first-404"),
    ],
)
def test_resource_error_preference(outcomes: list[AttemptResult], status: int, marker: str) -> None:
    placer = FakePlacer([W("a"), W("b"), W("c")])
    run = drive(res(placer, "DELETE"), outcomes, placer)
    assert isinstance(run.final, LocalResponse)
    assert run.final.status == status
    assert json.loads(run.final.body)["error"]["message"] == marker
    assert run.final.headers == ((b"content-type", b"application/json"),)
    assert len(run.attempts) == 3
    assert placer.release_counts() == [1, 1, 1]
    assert all(n == 0 for n in placer.fleet.load.values())


def test_resource_all_unreachable_is_502() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(res(placer), [CONNECT, TIMEOUT], placer)
    assert type(run.error) is UpstreamError
    assert placer.release_counts() == [1, 1]


def test_resource_cancel_posts_to_the_canonical_path() -> None:
    placer = FakePlacer([W("a")])
    run = drive(res(placer, "POST", "/v1/responses/r%5F9/cancel"), [OK], placer)
    assert run.attempts[0].url == "http://a:8000/v1/responses/r_9/cancel"
    assert run.attempts[0].method == "POST"


@pytest.mark.parametrize(
    ("method", "path", "canonical"),
    [
        P("GET", "/v1/conversations/c%5F1", "/v1/conversations/c_1", id="retrieve"),
        P("POST", "/v1/conversations/c_1/items", "/v1/conversations/c_1/items", id="add-items"),
        P(
            "DELETE",
            "/v1/conversations/c_1/items/m%5F2",
            "/v1/conversations/c_1/items/m_2",
            id="delete-item",
        ),
    ],
)
def test_resource_conversation_paths_are_canonical(method: str, path: str, canonical: str) -> None:
    placer = FakePlacer([W("a"), W("b")])
    m = resolve(method, path)
    assert m is not None
    v = parse_request(m, b'{"items": []}' if m.endpoint.has_body else b"")
    flow = resource_flow(placer, v, CLIENT_HEADERS, method=method)
    run = drive(flow, [_err(404, "a"), OK], placer)
    assert [a.url for a in run.attempts] == [
        f"http://a:8000{canonical}",
        f"http://b:8000{canonical}",
    ]
    assert all(a.method == method for a in run.attempts)
    assert run.final is run.attempts[1]


def test_resource_asks_each_origin_once() -> None:
    placer = FakePlacer([W("a", dp_size="4"), W("b", dp_size="2"), W("c")])
    run = drive(res(placer), [_err(404, "x")] * 10, placer)
    origins = [a.candidate.origin for a in run.attempts]
    assert origins == ["http://a:8000", "http://b:8000", "http://c:8000"]


def test_resource_with_real_mesh_targets_asks_each_origin_once() -> None:
    from meshkit.mesh import Mesh

    b = Worker("http://b:8000", labels={"mesh.dp_size": "2"})
    mesh = Mesh(
        workers=[Worker("http://a:8000", labels={"mesh.dp_size": "4"}), b, "http://c:8000"],
        prepare={"workers": 1},
    )
    try:
        mesh.fleet.unhealthy.add(b.id)
        v = view_of("/v1/responses/resp_1", method="GET")
        flow = resource_flow(mesh.router, v, [], method="GET")
        attempts = [next(flow)]
        try:
            while True:
                attempts.append(flow.send(_err(404, "x")))
        except StopIteration as stop:
            final = stop.value
        origins = [cast(Attempt, a).candidate.origin for a in attempts]
        # one candidate per origin (DP ranks share one), healthy origins first
        assert origins == ["http://a:8000", "http://c:8000", "http://b:8000"]
        assert isinstance(final, LocalResponse)
        assert final.status == 404
        assert all(n == 0 for n in mesh.fleet.load.values())
    finally:
        mesh.close()


def test_resource_without_targets_raises_before_any_attempt() -> None:
    flow = resource_flow(FakePlacer([]), view_of("/v1/responses/r", method="GET"), [], method="GET")
    with pytest.raises(MeshError):
        next(flow)


def test_resource_with_no_responses_worker_is_501() -> None:
    placer = FakePlacer([W("a", apis="chat")])
    flow = resource_flow(placer, view_of("/v1/responses/r", method="GET"), [], method="GET")
    with pytest.raises(UnsupportedApi):
        next(flow)


# --------------------------------------------------------------------------------------
# models_flow
# --------------------------------------------------------------------------------------


def _listing(*ids: Any) -> AttemptResult:
    data = [{"id": i, "object": "model"} if isinstance(i, str) else i for i in ids]
    return AttemptResult(status=200, body=json.dumps({"object": "list", "data": data}).encode())


def models(placer: FakePlacer) -> ForwardFlow:
    return models_flow(placer, view_of("/v1/models", method="GET"), CLIENT_HEADERS)


def test_models_merged_and_deduplicated() -> None:
    placer = FakePlacer([W("a", key="sk-a"), W("b", dp_size="2"), W("c")])
    outcomes = [_listing("m1", "m2"), _listing("m2", "m3"), _listing("m1")]
    run = drive(models(placer), outcomes, placer)
    assert isinstance(run.final, LocalResponse)
    assert run.final.status == 200
    listing = json.loads(run.final.body)
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["m1", "m2", "m3"]
    assert len(run.attempts) == 3  # one per origin
    assert all(a.read_body == "always" and a.method == "GET" for a in run.attempts)
    assert run.attempts[0].url == "http://a:8000/v1/models"
    assert header(run.attempts[0], b"authorization") == [b"Bearer sk-a"]
    assert [le.releases for le in placer.leases] == [[(True, 200)]] * 3


@pytest.mark.parametrize(
    "bad",
    [
        P(AttemptResult(status=200, body=b"not json"), id="not-json"),
        P(AttemptResult(status=200, body=b"[]"), id="array"),
        P(AttemptResult(status=200, body=b'{"data": "x"}'), id="data-not-list"),
        P(AttemptResult(status=200, body=b""), id="empty"),
        P(AttemptResult(status=200), id="no-body"),
        P(_err(500, "x"), id="500"),
        P(CONNECT, id="connect"),
        P(TIMEOUT, id="timeout"),
    ],
)
def test_models_skips_bad_answers(bad: AttemptResult) -> None:
    placer = FakePlacer([W("a"), W("b")])
    odd = _listing("ok", 5, {"id": 7}, {"no": "id"})
    run = drive(models(placer), [bad, odd], placer)
    assert isinstance(run.final, LocalResponse)
    assert [m["id"] for m in json.loads(run.final.body)["data"]] == ["ok"]
    assert placer.release_counts() == [1, 1]


def test_models_none_answered_is_502() -> None:
    placer = FakePlacer([W("a"), W("b"), W("c")])
    outcomes = [CONNECT, TIMEOUT, AttemptResult(status=200, body=b"{}")]
    run = drive(models(placer), outcomes, placer)
    assert type(run.error) is UpstreamError
    assert run.error.status == 502
    assert placer.release_counts() == [1, 1, 1]
    assert all(n == 0 for n in placer.fleet.load.values())


@pytest.mark.parametrize(
    ("outcomes", "status", "marker"),
    [
        P([_err(401, "a"), _err(401, "b")], 401, "a", id="all-401-first"),
        P([CONNECT, _err(401, "b")], 401, "b", id="connect-and-401"),
        P([_err(500, "a"), _err(403, "b")], 403, "b", id="4xx-over-5xx"),
        P([_err(500, "a"), _err(503, "b")], 500, "a", id="first-5xx"),
        P([CONNECT, _err(503, "b")], 503, "b", id="a-5xx-answer-over-failures"),
        P([_err(404, "a"), AttemptResult(status=200, body=b"{}")], 404, "a", id="404-and-junk"),
    ],
)
def test_models_relays_the_workers_own_refusal(
    outcomes: list[AttemptResult], status: int, marker: str
) -> None:
    """Proposal F: when no worker listed its models and some answered with an error,
    that answer is the client's (a 401 for a key the workers refuse), not a 502."""
    placer = FakePlacer([W("a"), W("b")])
    run = drive(models(placer), outcomes, placer)
    assert run.error is None
    assert isinstance(run.final, LocalResponse)
    assert run.final.status == status
    assert json.loads(run.final.body)["error"]["message"] == marker
    assert placer.release_counts() == [1, 1]


def test_models_a_listing_beats_refusals() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(models(placer), [_err(401, "a"), _listing("m1")], placer)
    assert isinstance(run.final, LocalResponse)
    assert run.final.status == 200
    assert [m["id"] for m in json.loads(run.final.body)["data"]] == ["m1"]


def retrieve(placer: FakePlacer, model: str) -> ForwardFlow:
    return models_flow(placer, view_of(f"/v1/models/{model}", method="GET"), CLIENT_HEADERS)


def test_model_retrieve_answers_its_entry_of_the_union() -> None:
    placer = FakePlacer([W("a"), W("b")])
    entry = {"id": "org/m2", "object": "model", "created": 1, "owned_by": "b"}
    outcomes = [_listing("m1"), _listing(entry)]
    run = drive(retrieve(placer, "org%2Fm2"), outcomes, placer)
    assert isinstance(run.final, LocalResponse)
    assert run.final.status == 200
    assert json.loads(run.final.body) == entry
    # the listing is what was asked, never the id
    assert [a.url for a in run.attempts] == ["http://a:8000/v1/models", "http://b:8000/v1/models"]
    assert placer.release_counts() == [1, 1]


def test_model_retrieve_of_an_unserved_model_is_404() -> None:
    placer = FakePlacer([W("a")])
    run = drive(retrieve(placer, "nope"), [_listing("m1")], placer)
    assert isinstance(run.error, ModelNotFound)
    assert (run.error.status, run.error.code, run.error.param) == (404, "model_not_found", "model")
    assert "`nope`" in run.error.message
    assert placer.release_counts() == [1]


def test_model_retrieve_relays_the_workers_refusal() -> None:
    placer = FakePlacer([W("a")])
    run = drive(retrieve(placer, "m1"), [_err(401, "a")], placer)
    assert isinstance(run.final, LocalResponse)
    assert run.final.status == 401


def test_models_pool_timeout_is_503_without_blaming_the_worker() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(models(placer), [_listing("m1"), POOL], placer)
    assert isinstance(run.error, Overloaded)
    assert [le.releases for le in placer.leases] == [[(True, 200)], [NEUTRAL]]


def test_models_with_a_full_worker_is_503_not_an_incomplete_list() -> None:
    a, b = W("a"), W("b")
    placer = FakePlacer([a, b], max_in_flight_per_worker=1)
    placer.fleet.acquire(placer.fleet.candidates_of(b)[0])  # b is busy
    run = drive(models(placer), [_listing("m1")], placer)
    assert isinstance(run.error, Overloaded)
    assert placer.release_counts() == [1]  # a's lease was released before b's refusal
    assert placer.fleet.load[a.id] == 0


def test_models_empty_list_is_an_answer() -> None:
    placer = FakePlacer([W("a")])
    run = drive(models(placer), [_listing()], placer)
    assert isinstance(run.final, LocalResponse)
    assert json.loads(run.final.body) == {"object": "list", "data": []}


def test_models_without_targets_raises_before_any_attempt() -> None:
    flow = models_flow(FakePlacer([]), view_of("/v1/models", method="GET"), [])
    with pytest.raises(MeshError):
        next(flow)


def test_models_listed_by_workers_labelled_as_in_design() -> None:
    placer = FakePlacer([W("a", apis="chat,completions,responses"), W("b", apis="messages")])
    run = drive(models(placer), [_listing("m1"), _listing("m2")], placer)
    assert isinstance(run.final, LocalResponse)
    assert [m["id"] for m in json.loads(run.final.body)["data"]] == ["m1", "m2"]


# --------------------------------------------------------------------------------------
# admission limits and pool timeouts in the flows
# --------------------------------------------------------------------------------------


def _busy(placer: FakePlacer, worker: Worker, n: int = 1) -> None:
    """``n`` requests in flight on ``worker`` (other requests than the one tested)."""
    for _ in range(n):
        placer.fleet.acquire(placer.fleet.candidates_of(worker)[0])


def test_retry_never_goes_to_a_worker_at_its_cap() -> None:
    a, b, c = W("a"), W("b"), W("c")
    placer = FakePlacer([a, b, c], max_in_flight_per_worker=1)
    _busy(placer, b)
    run = drive(fwd(placer, view_of()), [CONNECT, OK], placer)
    assert [x.candidate.worker for x in run.attempts] == [a, c]
    assert run.final is run.attempts[1]


@pytest.mark.parametrize(
    ("first", "expect"),
    [
        P(CONNECT, Overloaded, id="failure-then-others-full-is-503"),
        P(AttemptResult.response(503), "relayed", id="worker-answer-beats-overloaded"),
    ],
)
def test_retry_when_every_other_worker_is_full(first: AttemptResult, expect: Any) -> None:
    a, b = W("a"), W("b")
    placer = FakePlacer([a, b], max_in_flight_per_worker=1)
    _busy(placer, b)
    run = drive(fwd(placer, view_of()), [first], placer)
    assert len(run.attempts) == 1
    if expect == "relayed":
        assert run.final is run.attempts[0]
        assert placer.release_counts() == [0]  # the adapter owns the lease now
    else:
        assert isinstance(run.error, expect)
        assert placer.release_counts() == [1]


def test_a_retry_counts_its_own_pending_attempt_against_the_global_cap() -> None:
    """The first worker's retryable answer is still open (its connection too) while
    the flow looks for another worker: at the global cap, that answer is relayed."""
    a, b = W("a"), W("b")
    placer = FakePlacer([a, b], max_in_flight=2)
    _busy(placer, b)  # 1 elsewhere + this request's attempt = the cap
    run = drive(fwd(placer, view_of()), [AttemptResult.response(429)], placer)
    assert run.final is run.attempts[0]
    assert placer.fleet.in_flight == 2


@pytest.mark.parametrize(
    ("busy", "refused"),
    [P(0, False, id="cap-1"), P(1, True, id="cap"), P(2, True, id="cap+1")],
)
def test_placement_at_the_per_worker_bound(busy: int, refused: bool) -> None:
    a = W("a")
    placer = FakePlacer([a], max_in_flight_per_worker=2)
    _busy(placer, a, 1 + busy)  # 1, 2 or 3 in flight against a cap of 2
    run = drive(fwd(placer, view_of()), [OK], placer)
    if refused:
        assert isinstance(run.error, Overloaded)
        assert run.error.retry_after_s is not None
        assert run.attempts == []
    else:
        assert run.final is run.attempts[0]
        assert placer.fleet.worker_load[a.id] == 2


def test_pool_timeout_moves_on_without_blaming_the_worker() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(fwd(placer, view_of()), [POOL, OK], placer)
    assert run.final is run.attempts[1]
    assert placer.leases[0].releases == [NEUTRAL]


def test_pool_timeout_with_no_other_worker_is_503() -> None:
    placer = FakePlacer([W("a")])
    run = drive(fwd(placer, view_of()), [POOL], placer)
    assert isinstance(run.error, Overloaded)
    assert run.error.status == 503
    assert placer.leases[0].releases == [NEUTRAL]


def test_pool_timeout_on_the_last_attempt_is_503() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(fwd(placer, view_of(), max_attempts=2), [CONNECT, POOL], placer)
    assert isinstance(run.error, Overloaded)
    assert placer.leases[0].releases == [(False, None)]
    assert placer.leases[1].releases == [NEUTRAL]


class _Racing(FakePlacer):
    """Another thread takes the chosen worker's last slot between placement and lease,
    ``races`` times."""

    def __init__(self, workers: Iterable[Worker], races: int, **kw: Any) -> None:
        super().__init__(workers, max_in_flight_per_worker=1, **kw)
        self.races = races

    def lease(self, cand: Candidate, view: RequestView, *, admission: bool = True) -> FakeLease:
        if self.races:
            self.races -= 1
            self.fleet.acquire(cand)  # the other thread's request
        return super().lease(cand, view)


def test_a_lost_race_for_the_last_slot_places_again() -> None:
    a, b = W("a"), W("b")
    placer = _Racing([a, b], races=1)
    run = drive(fwd(placer, view_of()), [OK], placer)
    assert run.final is run.attempts[0]
    assert run.attempts[0].candidate.worker is b  # a filled up meanwhile
    assert placer.fleet.worker_load == {a.id: 1, b.id: 1}


def test_two_lost_races_are_503_and_leak_nothing() -> None:
    a, b = W("a"), W("b")
    placer = _Racing([a, b, W("c")], races=2)
    run = drive(fwd(placer, view_of()), [OK], placer)
    assert isinstance(run.error, Overloaded)
    assert run.attempts == []
    assert placer.leases == []  # no lease was taken, none to leak


def test_a_lost_race_on_a_retry_relays_the_pending_answer() -> None:
    a, b = W("a"), W("b")
    placer = _Racing([a, b], races=0)
    flow = fwd(placer, view_of())
    first = next(flow)
    placer.races = 1
    with pytest.raises(StopIteration) as stop:
        flow.send(AttemptResult.response(503))
    assert stop.value.value is first
    assert placer.release_counts() == [0]


def test_resource_skips_a_full_origin_and_relays_a_success() -> None:
    a, b = W("a"), W("b")
    placer = FakePlacer([a, b], max_in_flight_per_worker=1)
    _busy(placer, a)
    run = drive(res(placer), [OK], placer)
    assert [x.candidate.worker for x in run.attempts] == [b]
    assert run.final is run.attempts[0]


def test_resource_with_a_full_origin_and_no_success_is_503() -> None:
    """The full worker may hold the Response: a 404 from the others would be a lie."""
    a, b = W("a"), W("b")
    placer = FakePlacer([a, b], max_in_flight_per_worker=1)
    _busy(placer, a)
    run = drive(res(placer), [_err(404, "b")], placer)
    assert isinstance(run.error, Overloaded)
    assert placer.release_counts() == [1]


def test_resource_pool_timeout_is_neutral_and_503() -> None:
    placer = FakePlacer([W("a"), W("b")])
    run = drive(res(placer), [POOL, _err(404, "b")], placer)
    assert isinstance(run.error, Overloaded)
    assert placer.leases[0].releases == [NEUTRAL]
    assert placer.leases[1].releases == [(False, 404)]
