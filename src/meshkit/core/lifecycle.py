"""
Worker lifecycle: states, breakers, leases and routing outcomes
===============================================================

The pure half of worker lifecycle management (``docs/lifecycle.md``), in the
h11 ``_state.py`` style: *everything that decides a state transition lives here*,
as data, and nothing here does I/O, keeps time or takes a lock. Callers pass
``now`` in; :mod:`meshkit.core.states` keeps one machine per worker, the
:class:`~meshkit.router.Router` serialises calls under its lock and the lifecycle
controller (:mod:`meshkit.lifecycle.controller`) turns probes, wakes and sleeps into
events.

Worker states
-------------

=============  ==============================================================
``ready``      probed healthy (or probing is off): takes requests
``unverified`` not probed yet: takes requests only when no ready worker can
``sleeping``   vLLM sleep mode, asleep: a request starts a wake
``waking``     a ``POST /wake_up`` is in flight: requests wait for it
``draining``   takes no new requests; its leases run to their end
``failed``     ``failure_threshold`` probes in a row failed (still probed)
``untracked``  meshkit does not manage it (label ``mesh.tracking`` other than
               ``complete``): never probed, slept or woken, never idle
=============  ==============================================================

:data:`TRANSITIONS` maps *every* ``(State, Event)`` pair to the next state or to
:data:`INVALID`; :class:`WorkerMachine` applies it and raises
:class:`LifecycleError` on an invalid pair. Thresholds are counters in the
machine that emit the derived events ``health_lost`` / ``health_restored``, which
go through the same table (h11's state-triggered transitions, run to a fixed
point).

The circuit breaker is a second, smaller table (:data:`BREAKER_TRANSITIONS`) fed by
request outcomes: ``closed`` → ``open`` after ``breaker_failures`` failures in a
row, → ``half_open`` after ``breaker_open_s`` (one trial request), → ``closed`` on
success or back to ``open`` on failure.

Leases
------

:class:`LeaseTable` counts live leases per worker and keys them by
``Idempotency-Key``: a request whose key is still running *joins* its lease (no
second lease, counted once); one whose key finished within the TTL is a *replay*.
A worker's leases are its :data:`Activity` evidence: a live lease is
:class:`Active`, an untracked worker is :class:`Unknown`, never :class:`Idle`.

Routing outcomes
----------------

:func:`route` maps the dispositions of a request's candidate workers to one of
:class:`Forward`, :class:`WakeThenRetry`, :class:`Retry` or :class:`Refused`.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Final, TypeVar

__all__ = [
    "BREAKER_TRANSITIONS",
    "INVALID",
    "PLACE_GRACE_S",
    "TRANSITIONS",
    "Active",
    "Activity",
    "Breaker",
    "BreakerEvent",
    "Disposition",
    "Event",
    "Forward",
    "Idle",
    "Invalid",
    "LeaseEntry",
    "LeaseKind",
    "LeaseTable",
    "LifecycleError",
    "Outcome",
    "Refused",
    "Retry",
    "State",
    "Thresholds",
    "Unknown",
    "Verdict",
    "WakeThenRetry",
    "WorkerMachine",
    "disposition",
    "route",
    "transition_table_markdown",
]

#: A placement and the lease it leads to are two steps (two lock acquisitions,
#: microseconds apart in one thread). A worker placed this recently counts as
#: active, so no sleep and no drain can slip in between the two.
PLACE_GRACE_S: Final = 0.25


class LifecycleError(Exception):
    """An event that is not valid in the worker's current state (h11's
    ``LocalProtocolError``: the caller misused the machine).

    ``status_hint`` is what an HTTP surface should answer (409 Conflict).
    """

    status_hint: ClassVar[int] = 409

    def __init__(self, message: str, *, state: State | None = None) -> None:
        super().__init__(message)
        self.state = state


class State(enum.Enum):
    READY = "ready"
    SLEEPING = "sleeping"
    WAKING = "waking"
    DRAINING = "draining"
    UNVERIFIED = "unverified"
    FAILED = "failed"
    UNTRACKED = "untracked"


class Event(enum.Enum):
    #: meshkit starts tracking the worker (added with tracking complete)
    ADDED = "added"
    #: probing is off: a tracked worker is taken as ready without a probe
    ASSUMED_READY = "assumed_ready"
    PROBE_OK = "probe_ok"
    PROBE_FAILED = "probe_failed"
    #: derived: ``failure_threshold`` probes in a row failed
    HEALTH_LOST = "health_lost"
    #: derived: ``success_threshold`` probes in a row succeeded
    HEALTH_RESTORED = "health_restored"
    #: ``GET /is_sleeping`` said true / false
    REPORTED_SLEEPING = "reported_sleeping"
    REPORTED_AWAKE = "reported_awake"
    WAKE_STARTED = "wake_started"
    WAKE_SUCCEEDED = "wake_succeeded"
    WAKE_FAILED = "wake_failed"
    SLEEP_STARTED = "sleep_started"
    SLEEP_SUCCEEDED = "sleep_succeeded"
    SLEEP_FAILED = "sleep_failed"
    DRAIN_REQUESTED = "drain_requested"
    #: the last lease of a draining worker ended
    DRAINED = "drained"


class Invalid(enum.Enum):
    """The marker of a pair that raises :class:`LifecycleError`."""

    INVALID = "invalid"


INVALID: Final = Invalid.INVALID


class _Stays(enum.Enum):
    STAYS = "stays"


# Written row by row so each state's whole behaviour reads in one place; every
# event appears in every row (the flattening below refuses a missing pair).
_STAYS: Final = _Stays.STAYS
_S = State
_E = Event
_ROWS: dict[State, dict[Event, State | Invalid | _Stays]] = {
    _S.READY: {
        _E.ADDED: INVALID,
        _E.ASSUMED_READY: INVALID,
        _E.PROBE_OK: _STAYS,
        _E.PROBE_FAILED: _STAYS,  # counted: one failed probe is not an outage
        _E.HEALTH_LOST: _S.FAILED,
        _E.HEALTH_RESTORED: _STAYS,
        _E.REPORTED_SLEEPING: _S.SLEEPING,  # slept by someone else
        _E.REPORTED_AWAKE: _STAYS,
        _E.WAKE_STARTED: INVALID,  # nothing to wake
        _E.WAKE_SUCCEEDED: _STAYS,  # a late result: already ready
        _E.WAKE_FAILED: _STAYS,
        _E.SLEEP_STARTED: _S.SLEEPING,  # no new placements from here on
        _E.SLEEP_SUCCEEDED: _S.SLEEPING,  # a late result: it *is* asleep
        _E.SLEEP_FAILED: _STAYS,
        _E.DRAIN_REQUESTED: _S.DRAINING,
        _E.DRAINED: INVALID,
    },
    _S.SLEEPING: {
        _E.ADDED: INVALID,
        _E.ASSUMED_READY: INVALID,
        _E.PROBE_OK: _STAYS,  # vLLM answers /health while asleep
        _E.PROBE_FAILED: _STAYS,
        _E.HEALTH_LOST: _S.FAILED,
        _E.HEALTH_RESTORED: _STAYS,
        _E.REPORTED_SLEEPING: _STAYS,
        _E.REPORTED_AWAKE: _S.READY,  # woken by someone else
        _E.WAKE_STARTED: _S.WAKING,
        _E.WAKE_SUCCEEDED: _STAYS,  # stale: let the next probe tell
        _E.WAKE_FAILED: _STAYS,
        _E.SLEEP_STARTED: INVALID,  # already asleep
        _E.SLEEP_SUCCEEDED: _STAYS,
        _E.SLEEP_FAILED: _S.READY,  # it did not go to sleep after all
        _E.DRAIN_REQUESTED: _S.DRAINING,
        _E.DRAINED: INVALID,
    },
    _S.WAKING: {
        _E.ADDED: INVALID,
        _E.ASSUMED_READY: INVALID,
        _E.PROBE_OK: _STAYS,
        _E.PROBE_FAILED: _STAYS,
        _E.HEALTH_LOST: _S.FAILED,
        _E.HEALTH_RESTORED: _STAYS,
        _E.REPORTED_SLEEPING: _STAYS,  # the wake is still running
        _E.REPORTED_AWAKE: _S.READY,
        _E.WAKE_STARTED: INVALID,  # one wake at a time: others wait for it
        _E.WAKE_SUCCEEDED: _S.READY,
        _E.WAKE_FAILED: _S.SLEEPING,
        _E.SLEEP_STARTED: INVALID,
        _E.SLEEP_SUCCEEDED: _STAYS,  # a sleep that ran before this wake
        _E.SLEEP_FAILED: _STAYS,
        _E.DRAIN_REQUESTED: _S.DRAINING,
        _E.DRAINED: INVALID,
    },
    _S.DRAINING: {
        # Draining is one-way (towards removal): nothing but removal ends it.
        _E.ADDED: INVALID,
        _E.ASSUMED_READY: INVALID,
        _E.PROBE_OK: _STAYS,
        _E.PROBE_FAILED: _STAYS,
        _E.HEALTH_LOST: _STAYS,
        _E.HEALTH_RESTORED: _STAYS,
        _E.REPORTED_SLEEPING: _STAYS,
        _E.REPORTED_AWAKE: _STAYS,
        _E.WAKE_STARTED: INVALID,
        _E.WAKE_SUCCEEDED: _STAYS,
        _E.WAKE_FAILED: _STAYS,
        _E.SLEEP_STARTED: INVALID,
        _E.SLEEP_SUCCEEDED: _STAYS,
        _E.SLEEP_FAILED: _STAYS,
        _E.DRAIN_REQUESTED: _STAYS,
        _E.DRAINED: _STAYS,  # reported to the caller; still takes no requests
    },
    _S.UNVERIFIED: {
        _E.ADDED: INVALID,
        _E.ASSUMED_READY: _S.READY,
        _E.PROBE_OK: _S.READY,  # the first look is enough
        _E.PROBE_FAILED: _S.FAILED,  # never seen healthy: no benefit of doubt
        _E.HEALTH_LOST: _S.FAILED,
        _E.HEALTH_RESTORED: _S.READY,
        _E.REPORTED_SLEEPING: _S.SLEEPING,
        _E.REPORTED_AWAKE: _S.READY,
        _E.WAKE_STARTED: INVALID,
        _E.WAKE_SUCCEEDED: _STAYS,
        _E.WAKE_FAILED: _STAYS,
        _E.SLEEP_STARTED: INVALID,  # only a ready worker is put to sleep
        _E.SLEEP_SUCCEEDED: _S.SLEEPING,
        _E.SLEEP_FAILED: _STAYS,
        _E.DRAIN_REQUESTED: _S.DRAINING,
        _E.DRAINED: INVALID,
    },
    _S.FAILED: {
        _E.ADDED: INVALID,
        _E.ASSUMED_READY: INVALID,
        _E.PROBE_OK: _STAYS,  # counted towards success_threshold
        _E.PROBE_FAILED: _STAYS,  # still probed: a restart rejoins (smg #2468)
        _E.HEALTH_LOST: _STAYS,
        _E.HEALTH_RESTORED: _S.READY,
        _E.REPORTED_SLEEPING: _STAYS,  # health first; reported again next probe
        _E.REPORTED_AWAKE: _STAYS,
        _E.WAKE_STARTED: INVALID,
        _E.WAKE_SUCCEEDED: _STAYS,
        _E.WAKE_FAILED: _STAYS,
        _E.SLEEP_STARTED: INVALID,
        _E.SLEEP_SUCCEEDED: _STAYS,
        _E.SLEEP_FAILED: _STAYS,
        _E.DRAIN_REQUESTED: _S.DRAINING,
        _E.DRAINED: INVALID,
    },
    _S.UNTRACKED: {
        # Not managed: probe, sleep and wake events would be a caller bug.
        _E.ADDED: _S.UNVERIFIED,
        _E.ASSUMED_READY: INVALID,
        _E.PROBE_OK: INVALID,
        _E.PROBE_FAILED: INVALID,
        _E.HEALTH_LOST: INVALID,
        _E.HEALTH_RESTORED: INVALID,
        _E.REPORTED_SLEEPING: INVALID,
        _E.REPORTED_AWAKE: INVALID,
        _E.WAKE_STARTED: INVALID,
        _E.WAKE_SUCCEEDED: INVALID,
        _E.WAKE_FAILED: INVALID,
        _E.SLEEP_STARTED: INVALID,
        _E.SLEEP_SUCCEEDED: INVALID,
        _E.SLEEP_FAILED: INVALID,
        _E.DRAIN_REQUESTED: _S.DRAINING,  # its leases are still meshkit's to wait for
        _E.DRAINED: INVALID,
    },
}


class Breaker(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    #: derived: ``breaker_failures`` failures in a row
    TRIPPED = "tripped"
    #: ``breaker_open_s`` passed since it opened
    COOLED = "cooled"
    #: the one trial request of a half-open breaker was placed
    TRIAL = "trial"
    #: a request ended with no verdict (the client left first)
    ABANDONED = "abandoned"


_B = Breaker
_BE = BreakerEvent
_BREAKER_ROWS: dict[Breaker, dict[BreakerEvent, Breaker | Invalid | _Stays]] = {
    _B.CLOSED: {
        _BE.SUCCESS: _STAYS,
        _BE.FAILURE: _STAYS,  # counted
        _BE.TRIPPED: _B.OPEN,
        _BE.COOLED: INVALID,
        _BE.TRIAL: INVALID,
        _BE.ABANDONED: _STAYS,
    },
    _B.OPEN: {
        _BE.SUCCESS: _STAYS,  # a late answer to a request placed before it opened
        _BE.FAILURE: _STAYS,
        _BE.TRIPPED: _STAYS,
        _BE.COOLED: _B.HALF_OPEN,
        _BE.TRIAL: INVALID,  # an open breaker takes no request
        _BE.ABANDONED: _STAYS,
    },
    _B.HALF_OPEN: {
        _BE.SUCCESS: _B.CLOSED,
        _BE.FAILURE: _B.OPEN,
        _BE.TRIPPED: _B.OPEN,
        _BE.COOLED: INVALID,
        _BE.TRIAL: _STAYS,  # marks the trial in flight
        _BE.ABANDONED: _STAYS,  # clears the trial: another one may go
    },
}


_St = TypeVar("_St", bound=enum.Enum)
_Ev = TypeVar("_Ev", bound=enum.Enum)


def _flatten(
    rows: Mapping[_St, Mapping[_Ev, _St | Invalid | _Stays]],
    states: type[_St],
    events: type[_Ev],
) -> dict[tuple[_St, _Ev], _St | Invalid]:
    out: dict[tuple[_St, _Ev], _St | Invalid] = {}
    for s in states:
        row = rows[s]
        for e in events:
            if e not in row:  # pragma: no cover - caught by the import itself
                raise RuntimeError(f"transition table: no entry for ({s.value}, {e.value})")
            target = row[e]
            out[(s, e)] = s if isinstance(target, _Stays) else target
    return out


#: Every ``(State, Event)`` pair: the next state (the same one when it stays) or
#: :data:`INVALID`.
TRANSITIONS: Final[Mapping[tuple[State, Event], State | Invalid]] = _flatten(_ROWS, State, Event)
#: Every ``(Breaker, BreakerEvent)`` pair, in the same form.
BREAKER_TRANSITIONS: Final[Mapping[tuple[Breaker, BreakerEvent], Breaker | Invalid]] = _flatten(
    _BREAKER_ROWS, Breaker, BreakerEvent
)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The counts and times the machines use (``[lifecycle]`` keys)."""

    failure: int = 3
    success: int = 2
    breaker_failures: int = 5  # 0 disables the breaker
    breaker_open_s: float = 10.0


class Verdict(enum.Enum):
    """What one request's end says about its worker."""

    SUCCESS = "success"  # an answer below 500
    FAILURE = "failure"  # a connect/protocol error, a timeout or a 5xx
    NEUTRAL = "neutral"  # the client left before an answer


class WorkerMachine:
    """One worker's lifecycle state, probe counters and breaker (no locking)."""

    __slots__ = (
        "breaker",
        "breaker_failures",
        "failures",
        "opened_at",
        "seen_ready",
        "state",
        "successes",
        "thresholds",
        "trial",
    )

    def __init__(self, thresholds: Thresholds, state: State = State.UNTRACKED) -> None:
        self.thresholds = thresholds
        self.state = state
        self.failures = 0  # probes failed in a row
        self.successes = 0  # probes succeeded in a row
        self.breaker = Breaker.CLOSED
        self.breaker_failures = 0  # request failures in a row
        self.opened_at = 0.0
        self.trial = False
        #: whether it was ever ready (a failed worker that never was rejoins at
        #: once); a machine made in a later state (a copied fleet) may have been
        self.seen_ready = state not in (State.UNTRACKED, State.UNVERIFIED)

    def __repr__(self) -> str:
        return f"WorkerMachine({self.state.value}, breaker={self.breaker.value})"

    def handle(self, event: Event) -> State:
        """Apply ``event`` (and the events its counters trigger); the new state."""
        target = TRANSITIONS[(self.state, event)]
        if isinstance(target, Invalid):
            raise LifecycleError(
                f"event {event.value!r} is not valid in state {self.state.value!r}",
                state=self.state,
            )
        if event is Event.PROBE_OK:
            self.successes += 1
            self.failures = 0
        elif event is Event.PROBE_FAILED:
            self.failures += 1
            self.successes = 0
        self.state = target
        if target is State.READY:
            self.seen_ready = True
        # Counter-triggered events, fired once when a streak reaches its
        # threshold; a second pass settles at a fixed point (h11 _state.py).
        # success_threshold guards against a worker that flaps; one that was never
        # ready (it failed its first probe: started before its engine) has no
        # flapping to guard against, and each probe interval it waited for a second
        # good probe was time its engine served nothing.
        th = self.thresholds
        if event is Event.PROBE_FAILED and self.failures == max(1, th.failure):
            self.handle(Event.HEALTH_LOST)
        elif event is Event.PROBE_OK and (
            self.successes == max(1, th.success) or (target is State.FAILED and not self.seen_ready)
        ):
            self.handle(Event.HEALTH_RESTORED)
        return self.state

    # -- the breaker ------------------------------------------------------------

    def _breaker(self, event: BreakerEvent, now: float) -> Breaker:
        target = BREAKER_TRANSITIONS[(self.breaker, event)]
        if isinstance(target, Invalid):
            raise LifecycleError(
                f"breaker event {event.value!r} is not valid when {self.breaker.value!r}"
            )
        if target is not self.breaker:
            self.trial = False
            self.breaker_failures = 0
            if target is Breaker.OPEN:
                self.opened_at = now
        self.breaker = target
        return target

    def record(self, verdict: Verdict, now: float) -> Breaker:
        """Feed one request outcome to the breaker."""
        th = self.thresholds
        if th.breaker_failures <= 0:
            return self.breaker
        if verdict is Verdict.NEUTRAL:
            # Only a trial's abandonment matters: it lets another trial go.
            self.trial = False
            return self._breaker(BreakerEvent.ABANDONED, now)
        if verdict is Verdict.SUCCESS:
            self.breaker_failures = 0
            return self._breaker(BreakerEvent.SUCCESS, now)
        was = self.breaker
        self.breaker_failures += 1
        count = self.breaker_failures
        state = self._breaker(BreakerEvent.FAILURE, now)
        if was is Breaker.CLOSED and count == th.breaker_failures:
            state = self._breaker(BreakerEvent.TRIPPED, now)
        return state

    def cool(self, now: float) -> bool:
        """Half-open an open breaker whose ``breaker_open_s`` has passed."""
        if self.breaker is Breaker.OPEN and now - self.opened_at >= self.thresholds.breaker_open_s:
            self._breaker(BreakerEvent.COOLED, now)
            return True
        return False

    def start_trial(self, now: float) -> None:
        """The half-open breaker's one trial request was placed."""
        self._breaker(BreakerEvent.TRIAL, now)
        self.trial = True


# -- routing outcomes ---------------------------------------------------------------


class Disposition(enum.Enum):
    """What one worker can do for a new request."""

    ROUTE = "route"  # place on it
    FALLBACK = "fallback"  # place on it when no ROUTE worker can (unverified)
    WAKE = "wake"  # asleep: a wake must start
    WAIT = "wait"  # waking: wait for it
    RETRY = "retry"  # draining: come back later (elsewhere)
    REFUSE = "refuse"  # failed, breaker open, or untracked when tracking is required


def disposition(
    state: State, breaker: Breaker, trial: bool, *, require_tracking: bool = False
) -> Disposition:
    """The disposition of a worker in ``state`` with its breaker."""
    if state is State.SLEEPING:
        return Disposition.WAKE
    if state is State.WAKING:
        return Disposition.WAIT
    if state is State.DRAINING:
        return Disposition.RETRY
    if state is State.FAILED or (state is State.UNTRACKED and require_tracking):
        return Disposition.REFUSE
    if breaker is Breaker.OPEN or (breaker is Breaker.HALF_OPEN and trial):
        return Disposition.REFUSE
    return Disposition.FALLBACK if state is State.UNVERIFIED else Disposition.ROUTE


@dataclass(frozen=True, slots=True)
class Forward:
    """Place on one of these workers (the lease is taken when it is forwarded)."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WakeThenRetry:
    """Start waking ``worker_id``; the request waits for it or retries later."""

    worker_id: str
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Retry:
    """Nothing can take it now; ``worker_id`` is the waking worker to wait for, if any."""

    retry_after_s: float
    reason: State
    worker_id: str | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """No worker can serve it (failed, breaker open, or untracked when required)."""

    reason: str


Outcome = Forward | WakeThenRetry | Retry | Refused


def route(
    candidates: Iterable[tuple[str, Disposition]],
    *,
    retry_after_s: float = 1.0,
    wake_retry_after_s: float = 5.0,
) -> Outcome:
    """The outcome for a request whose eligible workers have these dispositions.

    Preference: ready workers, then unverified ones, then a worker already waking
    (so concurrent requests share one wake), then starting a wake, then a draining
    worker's retry hint; otherwise refused.
    """
    by: dict[Disposition, list[str]] = {}
    for wid, disp in candidates:
        by.setdefault(disp, []).append(wid)
    if Disposition.ROUTE in by:
        return Forward(tuple(by[Disposition.ROUTE]))
    if Disposition.FALLBACK in by:
        return Forward(tuple(by[Disposition.FALLBACK]))
    if Disposition.WAIT in by:
        return Retry(wake_retry_after_s, State.WAKING, by[Disposition.WAIT][0])
    if Disposition.WAKE in by:
        return WakeThenRetry(by[Disposition.WAKE][0], wake_retry_after_s)
    if Disposition.RETRY in by:
        return Retry(retry_after_s, State.DRAINING)
    if Disposition.REFUSE in by:
        return Refused("no worker is healthy")
    return Refused("no worker is configured")


# -- leases ---------------------------------------------------------------------------


class LeaseKind(enum.Enum):
    STARTED = "started"
    JOINED = "joined"  # same Idempotency-Key still running: shares its lease
    REPLAYED = "replayed"  # same key finished within the TTL: counted as a replay


_STARTED: Final = LeaseKind.STARTED


class LeaseEntry:
    """One lease: a worker kept active until its last reference ends."""

    __slots__ = ("candidate_key", "key", "kind", "refs", "started_at", "weight", "worker_id")

    def __init__(
        self,
        worker_id: str,
        candidate_key: str,
        key: str | None,
        weight: int,
        started_at: float,
        kind: LeaseKind,
    ) -> None:
        self.worker_id = worker_id
        self.candidate_key = candidate_key
        self.key = key
        self.weight = weight
        self.started_at = started_at
        self.kind = kind
        self.refs = 1

    def __repr__(self) -> str:
        return f"LeaseEntry({self.candidate_key!r}, {self.kind.value}, refs={self.refs})"


@dataclass(frozen=True, slots=True)
class Active:
    """The worker holds live leases (or was placed on a moment ago)."""

    leases: int


@dataclass(frozen=True, slots=True)
class Idle:
    """No lease since ``since``."""

    since: float


@dataclass(frozen=True, slots=True)
class Unknown:
    """Traffic may reach the worker around meshkit: never treated as idle."""


Activity = Active | Idle | Unknown


class LeaseTable:
    """Live leases per worker, keyed by idempotency key (pure, no locking).

    :param ttl_s: how long a finished key is recognised as a replay.
    :param max_finished: bound on remembered finished keys (oldest evicted).
    :param grace_s: how long a placement counts as activity before its lease.
    """

    def __init__(
        self, *, ttl_s: float = 600.0, max_finished: int = 10_000, grace_s: float = PLACE_GRACE_S
    ) -> None:
        self.ttl_s = ttl_s
        self.max_finished = max_finished
        self.grace_s = grace_s
        self._running: dict[str, LeaseEntry] = {}
        self._finished: OrderedDict[str, float] = OrderedDict()
        self._active: dict[str, int] = {}
        self._idle_since: dict[str, float] = {}
        #: worker id -> when a request was last placed on it (written per request)
        self.placed_at: dict[str, float] = {}
        self.started_total = 0
        self.joined_total = 0
        self.replayed_total = 0

    # -- the request path (the no-key case is two dict operations) ----------------

    def start(
        self,
        worker_id: str,
        candidate_key: str,
        now: float,
        *,
        key: str | None = None,
        weight: int = 0,
    ) -> tuple[LeaseEntry, LeaseKind]:
        """A lease for a request forwarded to ``candidate_key``.

        A running ``key`` on the same candidate is joined: the running entry comes
        back with kind JOINED and one more reference, and no new lease is taken (the
        caller acquires no capacity). Every kind is ended with :meth:`end`.
        """
        if key is not None:
            running = self._running.get(key)
            if running is None:
                kind = _STARTED
                self._expire(now)
                if self._finished.pop(key, None) is not None:
                    kind = LeaseKind.REPLAYED
                    self.replayed_total += 1
                else:
                    self.started_total += 1
                entry = LeaseEntry(worker_id, candidate_key, key, weight, now, kind)
                self._running[key] = entry
                self._active[worker_id] = self._active.get(worker_id, 0) + 1
                return entry, kind
            if running.candidate_key == candidate_key:
                running.refs += 1
                self.joined_total += 1
                return running, LeaseKind.JOINED
            # Placed elsewhere (its twin's worker could not take it): an ordinary
            # lease; the key stays with the first.
        self.started_total += 1
        self._active[worker_id] = self._active.get(worker_id, 0) + 1
        return LeaseEntry(worker_id, candidate_key, None, weight, now, _STARTED), _STARTED

    def end(self, entry: LeaseEntry, now: float) -> bool:
        """One reference to ``entry`` ended; True when that was its last (the
        caller releases the capacity it acquired)."""
        entry.refs -= 1
        if entry.refs > 0:
            return False
        if entry.refs < 0:  # pragma: no cover - callers release once
            entry.refs = 0
            return False
        wid = entry.worker_id
        n = self._active.get(wid, 0) - 1
        if n > 0:
            self._active[wid] = n
        else:
            self._active.pop(wid, None)
            self._idle_since[wid] = now
        if entry.key is not None and self._running.get(entry.key) is entry:
            del self._running[entry.key]
            self._finished[entry.key] = now
            self._finished.move_to_end(entry.key)
            self._expire(now)
        return True

    # -- what the lifecycle reads ---------------------------------------------------

    def count(self, worker_id: str) -> int:
        return self._active.get(worker_id, 0)

    @property
    def total(self) -> int:
        return sum(self._active.values())

    def joinable(self, key: str) -> str | None:
        """The candidate key a running ``key`` is on (a join should go there)."""
        entry = self._running.get(key)
        return None if entry is None else entry.candidate_key

    def touch(self, worker_id: str, now: float) -> None:
        """Restart ``worker_id``'s idle clock (added, or just woken)."""
        if worker_id not in self._active:
            self._idle_since[worker_id] = now

    def activity(self, worker_id: str, now: float, *, tracked: bool = True) -> Activity:
        """The activity evidence of ``worker_id`` (what sleep and drain decide on)."""
        if not tracked:
            return Unknown()
        n = self._active.get(worker_id, 0)
        placed = self.placed_at.get(worker_id)
        if n or (placed is not None and now - placed < self.grace_s):
            return Active(n)
        since = self._idle_since.get(worker_id)
        if since is None:
            return Unknown()
        return Idle(since if placed is None else max(since, placed))

    def forget(self, worker_id: str) -> None:
        """The worker was removed; its live leases (if any) still end normally."""
        self._idle_since.pop(worker_id, None)
        self.placed_at.pop(worker_id, None)

    def finished_keys(self) -> int:
        return len(self._finished)

    def _expire(self, now: float) -> None:
        fin = self._finished
        limit = self.max_finished
        while fin:
            at = next(iter(fin.values()))
            if len(fin) > limit or now - at > self.ttl_s:
                fin.popitem(last=False)
            else:
                break


# -- documentation ---------------------------------------------------------------


def transition_table_markdown() -> str:
    """The worker transition table as Markdown (``docs/lifecycle.md`` embeds it).

    Rows are events, columns states; a cell is the next state, ``·`` when the
    state stays, ``✗`` when the pair is invalid.
    """
    states = list(State)
    lines = [
        "| event | " + " | ".join(s.value for s in states) + " |",
        "|---|" + "---|" * len(states),
    ]
    for e in Event:
        cells = []
        for s in states:
            t = TRANSITIONS[(s, e)]
            cells.append("✗" if isinstance(t, Invalid) else "·" if t is s else t.value)
        lines.append(f"| {e.value} | " + " | ".join(cells) + " |")
    lines.append("")
    bstates = list(Breaker)
    lines.append("| breaker event | " + " | ".join(b.value for b in bstates) + " |")
    lines.append("|---|" + "---|" * len(bstates))
    for be in BreakerEvent:
        cells = []
        for b in bstates:
            bt = BREAKER_TRANSITIONS[(b, be)]
            cells.append("✗" if isinstance(bt, Invalid) else "·" if bt is b else bt.value)
        lines.append(f"| {be.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
