"""The worker and breaker transition tables, pair by pair (no I/O, no clock)."""

from __future__ import annotations

import itertools
from typing import cast

import pytest

from meshkit.core.lifecycle import (
    BREAKER_TRANSITIONS,
    INVALID,
    TRANSITIONS,
    Breaker,
    BreakerEvent,
    Disposition,
    Event,
    Forward,
    Invalid,
    LifecycleError,
    Refused,
    Retry,
    State,
    Thresholds,
    Verdict,
    WakeThenRetry,
    WorkerMachine,
    disposition,
    route,
)

#: thresholds no single event reaches, so each pair is seen on its own
UNREACHABLE = Thresholds(failure=99, success=99, breaker_failures=99, breaker_open_s=1.0)

# The behaviour that matters most, restated independently of the table's source.
EXPECTED = {
    (State.UNTRACKED, Event.ADDED): State.UNVERIFIED,
    (State.UNVERIFIED, Event.ASSUMED_READY): State.READY,
    (State.UNVERIFIED, Event.PROBE_OK): State.READY,
    (State.UNVERIFIED, Event.PROBE_FAILED): State.FAILED,
    (State.UNVERIFIED, Event.REPORTED_SLEEPING): State.SLEEPING,
    (State.READY, Event.HEALTH_LOST): State.FAILED,
    (State.READY, Event.REPORTED_SLEEPING): State.SLEEPING,
    (State.READY, Event.SLEEP_STARTED): State.SLEEPING,
    (State.READY, Event.DRAIN_REQUESTED): State.DRAINING,
    (State.SLEEPING, Event.WAKE_STARTED): State.WAKING,
    (State.SLEEPING, Event.REPORTED_AWAKE): State.READY,
    (State.SLEEPING, Event.SLEEP_FAILED): State.READY,
    (State.WAKING, Event.WAKE_SUCCEEDED): State.READY,
    (State.WAKING, Event.WAKE_FAILED): State.SLEEPING,
    (State.WAKING, Event.HEALTH_LOST): State.FAILED,
    (State.FAILED, Event.HEALTH_RESTORED): State.READY,
    (State.FAILED, Event.PROBE_FAILED): State.FAILED,
    (State.DRAINING, Event.DRAINED): State.DRAINING,
    (State.UNTRACKED, Event.DRAIN_REQUESTED): State.DRAINING,
}
MUST_BE_INVALID = {
    (State.READY, Event.WAKE_STARTED),
    (State.WAKING, Event.WAKE_STARTED),  # one wake at a time
    (State.SLEEPING, Event.SLEEP_STARTED),
    (State.WAKING, Event.SLEEP_STARTED),
    (State.DRAINING, Event.SLEEP_STARTED),
    (State.FAILED, Event.SLEEP_STARTED),
    (State.UNVERIFIED, Event.SLEEP_STARTED),
    (State.UNTRACKED, Event.PROBE_OK),
    (State.UNTRACKED, Event.SLEEP_STARTED),
    (State.READY, Event.DRAINED),
}


def test_every_pair_is_in_the_table() -> None:
    assert set(TRANSITIONS) == set(itertools.product(State, Event))
    assert set(BREAKER_TRANSITIONS) == set(itertools.product(Breaker, BreakerEvent))


@pytest.mark.parametrize(
    ("state", "event"),
    list(itertools.product(State, Event)),
    ids=lambda x: x.value,
)
def test_worker_pair(state: State, event: Event) -> None:
    target = TRANSITIONS[(state, event)]
    m = WorkerMachine(UNREACHABLE, state)
    if (state, event) in MUST_BE_INVALID:
        assert target is INVALID
    if (state, event) in EXPECTED:
        assert target is EXPECTED[(state, event)]
    if isinstance(target, Invalid):
        with pytest.raises(LifecycleError) as info:
            m.handle(event)
        assert info.value.status_hint == 409
        assert info.value.state is state
        assert m.state is state  # an invalid event changes nothing
    else:
        assert m.handle(event) is target
        assert m.state is target


@pytest.mark.parametrize(
    ("breaker", "event"),
    list(itertools.product(Breaker, BreakerEvent)),
    ids=lambda x: x.value,
)
def test_breaker_pair(breaker: Breaker, event: BreakerEvent) -> None:
    target = BREAKER_TRANSITIONS[(breaker, event)]
    m = WorkerMachine(UNREACHABLE, State.READY)
    m.breaker = breaker
    if isinstance(target, Invalid):
        with pytest.raises(LifecycleError):
            m._breaker(event, 5.0)
        assert m.breaker is breaker
    else:
        assert m._breaker(event, 5.0) is target
        if target is Breaker.OPEN and breaker is not Breaker.OPEN:
            assert m.opened_at == 5.0


def test_failure_threshold_fires_health_lost_once() -> None:
    m = WorkerMachine(Thresholds(failure=3, success=2), State.READY)
    assert m.handle(Event.PROBE_FAILED) is State.READY
    assert m.handle(Event.PROBE_FAILED) is State.READY
    assert m.handle(Event.PROBE_FAILED) is State.FAILED  # the third in a row
    assert m.handle(Event.PROBE_FAILED) is State.FAILED


def test_a_success_resets_the_failure_streak() -> None:
    m = WorkerMachine(Thresholds(failure=2, success=2), State.READY)
    m.handle(Event.PROBE_FAILED)
    m.handle(Event.PROBE_OK)
    assert m.handle(Event.PROBE_FAILED) is State.READY
    assert m.handle(Event.PROBE_FAILED) is State.FAILED


def test_failed_needs_success_threshold_probes_to_rejoin() -> None:
    m = WorkerMachine(Thresholds(failure=1, success=2), State.READY)
    assert m.handle(Event.PROBE_FAILED) is State.FAILED
    assert m.handle(Event.PROBE_OK) is State.FAILED
    assert m.handle(Event.PROBE_FAILED) is State.FAILED  # the streak restarts
    assert m.handle(Event.PROBE_OK) is State.FAILED
    assert m.handle(Event.PROBE_OK) is State.READY


def test_a_worker_never_ready_rejoins_at_its_first_good_probe() -> None:
    # Started before its engine: its first probe failed. success_threshold guards
    # against flapping, which a worker never ready has not done.
    m = WorkerMachine(Thresholds(failure=3, success=2))
    m.handle(Event.ADDED)
    assert m.handle(Event.PROBE_FAILED) is State.FAILED
    assert m.handle(Event.PROBE_FAILED) is State.FAILED
    assert m.handle(Event.PROBE_OK) is State.READY
    # Ready once, it needs success_threshold good probes again.
    for _ in range(3):
        m.handle(Event.PROBE_FAILED)
    assert m.state is State.FAILED
    assert m.handle(Event.PROBE_OK) is State.FAILED
    assert m.handle(Event.PROBE_OK) is State.READY


def test_thresholds_of_one_settle_at_a_fixed_point() -> None:
    m = WorkerMachine(Thresholds(failure=1, success=1))
    m.handle(Event.ADDED)
    assert m.handle(Event.PROBE_FAILED) is State.FAILED  # direct, then health_lost stays
    assert m.handle(Event.PROBE_OK) is State.READY  # health_restored


def test_probe_ok_then_sleep_report_is_one_step_for_a_recovering_sleeper() -> None:
    m = WorkerMachine(Thresholds(failure=1, success=1), State.FAILED)
    m.handle(Event.PROBE_OK)
    assert m.handle(Event.REPORTED_SLEEPING) is State.SLEEPING


def test_breaker_trips_after_consecutive_failures_only() -> None:
    m = WorkerMachine(Thresholds(breaker_failures=3, breaker_open_s=10.0), State.READY)
    m.record(Verdict.FAILURE, 1.0)
    m.record(Verdict.FAILURE, 1.0)
    m.record(Verdict.SUCCESS, 1.0)  # resets
    m.record(Verdict.FAILURE, 2.0)
    m.record(Verdict.FAILURE, 2.0)
    assert m.breaker is Breaker.CLOSED
    assert m.record(Verdict.FAILURE, 3.0) is Breaker.OPEN
    assert m.opened_at == 3.0


def test_breaker_cools_to_half_open_and_one_trial_decides() -> None:
    m = WorkerMachine(Thresholds(breaker_failures=1, breaker_open_s=10.0), State.READY)
    m.record(Verdict.FAILURE, 0.0)
    assert m.breaker is Breaker.OPEN
    assert not m.cool(9.9)
    assert m.cool(10.0)
    # (the cast drops what mypy keeps from the assert above: cool changed it)
    assert cast(Breaker, m.breaker) is Breaker.HALF_OPEN
    m.start_trial(10.0)
    assert m.trial
    assert m.record(Verdict.FAILURE, 11.0) is Breaker.OPEN  # back to open, clock restarts
    assert m.opened_at == 11.0 and not m.trial
    assert m.cool(21.0)
    m.start_trial(21.0)
    assert m.record(Verdict.SUCCESS, 21.5) is Breaker.CLOSED


def test_an_abandoned_trial_lets_another_one_go() -> None:
    m = WorkerMachine(Thresholds(breaker_failures=1, breaker_open_s=1.0), State.READY)
    m.record(Verdict.FAILURE, 0.0)
    m.cool(1.0)
    m.start_trial(1.0)
    m.record(Verdict.NEUTRAL, 1.1)
    assert m.breaker is Breaker.HALF_OPEN and not m.trial


def test_neutral_verdicts_do_not_count() -> None:
    m = WorkerMachine(Thresholds(breaker_failures=2), State.READY)
    m.record(Verdict.FAILURE, 0.0)
    m.record(Verdict.NEUTRAL, 0.0)
    assert m.record(Verdict.FAILURE, 0.0) is Breaker.OPEN


def test_breaker_disabled_with_zero() -> None:
    m = WorkerMachine(Thresholds(breaker_failures=0), State.READY)
    for _ in range(10):
        m.record(Verdict.FAILURE, 0.0)
    assert m.breaker is Breaker.CLOSED


@pytest.mark.parametrize(
    ("state", "breaker", "trial", "required", "expected"),
    [
        (State.READY, Breaker.CLOSED, False, False, Disposition.ROUTE),
        (State.READY, Breaker.OPEN, False, False, Disposition.REFUSE),
        (State.READY, Breaker.HALF_OPEN, False, False, Disposition.ROUTE),
        (State.READY, Breaker.HALF_OPEN, True, False, Disposition.REFUSE),
        (State.UNVERIFIED, Breaker.CLOSED, False, False, Disposition.FALLBACK),
        (State.SLEEPING, Breaker.CLOSED, False, False, Disposition.WAKE),
        (State.WAKING, Breaker.CLOSED, False, False, Disposition.WAIT),
        (State.DRAINING, Breaker.CLOSED, False, False, Disposition.RETRY),
        (State.FAILED, Breaker.CLOSED, False, False, Disposition.REFUSE),
        (State.UNTRACKED, Breaker.CLOSED, False, False, Disposition.ROUTE),
        (State.UNTRACKED, Breaker.CLOSED, False, True, Disposition.REFUSE),
    ],
)
def test_disposition(
    state: State, breaker: Breaker, trial: bool, required: bool, expected: Disposition
) -> None:
    assert disposition(state, breaker, trial, require_tracking=required) is expected


D = Disposition


@pytest.mark.parametrize(
    ("cands", "expected"),
    [
        ([("a", D.ROUTE), ("b", D.WAKE)], Forward(("a",))),
        ([("a", D.FALLBACK), ("b", D.WAKE)], Forward(("a",))),
        ([("a", D.ROUTE), ("b", D.FALLBACK)], Forward(("a",))),
        ([("a", D.WAKE), ("b", D.WAIT)], Retry(5.0, State.WAKING, "b")),  # share the wake
        ([("a", D.WAKE), ("b", D.WAKE)], WakeThenRetry("a", 5.0)),
        ([("a", D.RETRY), ("b", D.REFUSE)], Retry(1.0, State.DRAINING)),
        ([("a", D.REFUSE)], Refused("no worker is healthy")),
        ([], Refused("no worker is configured")),
    ],
)
def test_route(cands: list[tuple[str, Disposition]], expected: object) -> None:
    assert route(cands, retry_after_s=1.0, wake_retry_after_s=5.0) == expected
