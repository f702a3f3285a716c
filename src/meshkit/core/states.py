"""
Worker states, as placement reads them
======================================

:class:`WorkerStates` is the lifecycle's data (``docs/lifecycle.md``): one
:class:`~meshkit.core.lifecycle.WorkerMachine` per worker, the lease table, and the
few sets placement reads. It is plain data and decisions: no lock (the
:class:`~meshkit.router.Router` that owns it serialises every call), no clock
(``now`` is passed in), no I/O (a wake to start is *returned*; the router starts it).

How placement sees the lifecycle (the cheap part): a worker that must not take new
requests (failed, asleep, waking, draining, breaker open, untracked when tracking is
required) is put in ``fleet.unhealthy`` *when its disposition changes*, so the
placement filter does the work and a request pays nothing for it. Only three small
sets are checked per request: unverified workers (placed only when no verified one
can take the request), open breakers (a cool-down may have passed) and half-open
breakers (the placement is the trial). Everything else happens on the slow path,
when placement finds nobody (:meth:`WorkerStates.unavailable`).

Every worker whose state changed is added to :attr:`WorkerStates.changed`; the router
wakes whoever waits on those workers (a held request, a drain) and clears it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, NamedTuple
from urllib.parse import quote

from meshkit.core.lifecycle import (
    Active,
    Breaker,
    Disposition,
    Event,
    Idle,
    LeaseEntry,
    LeaseTable,
    LifecycleError,
    Retry,
    State,
    Thresholds,
    Verdict,
    WakeThenRetry,
    WorkerMachine,
    disposition,
    route,
)
from meshkit.core.placement import configured_for
from meshkit.core.placement import place as place_candidate
from meshkit.core.policies.base import Policy
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import NoAvailableWorkers

if TYPE_CHECKING:
    from meshkit.config import LifecycleConfig

__all__ = ["WakeDecision", "WorkerStates", "is_tracked"]

_ROUTABLE: Final = (Disposition.ROUTE, Disposition.FALLBACK)
_SUCCESS: Final = Verdict.SUCCESS  # read per request: a global is cheaper than the member


def is_tracked(worker: Worker) -> bool:
    """``mesh.tracking`` = ``complete`` (default): all its traffic goes through
    meshkit, so its leases are the whole truth about its activity."""
    return worker.labels.get("mesh.tracking", "complete").strip() == "complete"


def _toggle(s: set[str], key: str, on: bool) -> None:
    if on:
        s.add(key)
    else:
        s.discard(key)


class WakeDecision(NamedTuple):
    """What :meth:`WorkerStates.unavailable` decided: hold the request for
    ``worker_id`` (``start``: a wake must be started for it now)."""

    worker_id: str
    start: bool
    retry_after_s: float


class WorkerStates:
    """The lifecycle state of one fleet (see the module docstring)."""

    def __init__(self, fleet: Fleet, config: LifecycleConfig, now: float) -> None:
        self.fleet = fleet
        self.config = config
        self.thresholds = Thresholds(
            failure=max(1, config.failure_threshold),
            success=max(1, config.success_threshold),
            breaker_failures=config.breaker_failures,
            breaker_open_s=config.breaker_open_s,
        )
        self.leases = LeaseTable(
            ttl_s=config.idempotency_ttl_s, max_finished=config.idempotency_max
        )
        self.placed_at = self.leases.placed_at
        self.machines: dict[str, WorkerMachine] = {}
        #: set_healthy(False) by the operator; merged into fleet.unhealthy
        self.manual: set[str] = set()
        #: not routable by lifecycle state or breaker (also in fleet.unhealthy)
        self.blocked: set[str] = set()
        self.unverified: set[str] = set()
        self.sleepy: set[str] = set()  # sleeping or waking
        self.open_breakers: set[str] = set()
        self.half_open: set[str] = set()  # half-open with no trial in flight
        self.breaker_dirty: set[str] = set()  # not closed, or failures counted
        #: wakes/sleeps in flight, and a counter bumped when one starts or ends:
        #: a probe's sleep report that raced with one is dropped
        self.ops: dict[str, int] = {}
        self.op_epoch: dict[str, int] = {}
        self.wakes_total = 0
        self.sleeps_total = 0
        #: times each worker's breaker opened (closed/half-open → open)
        self.trips: dict[str, int] = {}
        #: workers whose state changed since the owner last looked (it wakes their waiters)
        self.changed: set[str] = set()
        for w in fleet.workers:
            self.track(w, now)

    # -- workers joining and leaving --------------------------------------------------

    def track(self, worker: Worker, now: float) -> None:
        """A new worker: unverified until probed, ready when probing is off,
        untracked when its traffic does not all go through meshkit."""
        m = WorkerMachine(self.thresholds)
        if is_tracked(worker):
            m.handle(Event.ADDED)
            if not self.config.probe:
                m.handle(Event.ASSUMED_READY)
        self.machines[worker.id] = m
        self.leases.touch(worker.id, now)
        self._refresh(worker.id)

    def refresh(self, worker_id: str) -> None:
        """The worker's labels changed (same id): placement's sets are recomputed."""
        self._refresh(worker_id)
        self.changed.add(worker_id)

    def forget(self, worker_id: str) -> None:
        """The worker was removed from the fleet."""
        self.machines.pop(worker_id, None)
        for s in (
            self.manual,
            self.blocked,
            self.unverified,
            self.sleepy,
            self.open_breakers,
            self.half_open,
            self.breaker_dirty,
        ):
            s.discard(worker_id)
        self.leases.forget(worker_id)
        # Nothing keyed by a removed worker stays (workers come and go): its
        # wake or sleep in flight ends without one (see _end_op).
        self.ops.pop(worker_id, None)
        self.op_epoch.pop(worker_id, None)
        self.trips.pop(worker_id, None)
        self.changed.add(worker_id)

    def set_manual(self, worker_id: str, healthy: bool) -> None:
        """An operator's health verdict, kept apart from (and over) the probes'."""
        unhealthy = self.fleet.unhealthy
        if healthy:
            self.manual.discard(worker_id)
            if worker_id not in self.blocked:
                unhealthy.discard(worker_id)
        else:
            self.manual.add(worker_id)
            unhealthy.add(worker_id)

    # -- state changes ----------------------------------------------------------------

    def machine(self, worker_id: str) -> WorkerMachine:
        m = self.machines.get(worker_id)
        if m is None:
            raise LifecycleError(f"no such worker: {worker_id}")
        return m

    def apply(self, worker_id: str, event: Event, now: float) -> State:
        """Apply ``event``; raises :class:`LifecycleError` for an invalid pair."""
        m = self.machine(worker_id)
        before = m.state
        state = m.handle(event)
        if state is State.READY and before is not State.READY:
            self.leases.touch(worker_id, now)
        self._refresh(worker_id)
        return state

    def disposition(self, worker_id: str) -> Disposition:
        m = self.machine(worker_id)
        return disposition(
            m.state, m.breaker, m.trial, require_tracking=self.config.require_tracking
        )

    def _refresh(self, worker_id: str) -> None:
        """Recompute the sets placement reads for one worker."""
        m = self.machines.get(worker_id)
        if m is None:
            return
        d = disposition(m.state, m.breaker, m.trial, require_tracking=self.config.require_tracking)
        unhealthy = self.fleet.unhealthy
        # fleet.unhealthy is touched only when blocked-ness flips, so marks set by
        # the operator (set_healthy) survive lifecycle events.
        if d not in _ROUTABLE:
            if worker_id not in self.blocked:
                self.blocked.add(worker_id)
                unhealthy.add(worker_id)
        elif worker_id in self.blocked:
            self.blocked.discard(worker_id)
            if worker_id not in self.manual:
                unhealthy.discard(worker_id)
        _toggle(self.unverified, worker_id, d is Disposition.FALLBACK)
        _toggle(self.sleepy, worker_id, m.state in (State.SLEEPING, State.WAKING))
        _toggle(self.open_breakers, worker_id, m.breaker is Breaker.OPEN)
        _toggle(self.half_open, worker_id, m.breaker is Breaker.HALF_OPEN and not m.trial)
        _toggle(
            self.breaker_dirty,
            worker_id,
            m.breaker is not Breaker.CLOSED or m.breaker_failures > 0,
        )
        self.changed.add(worker_id)

    # -- the request path -------------------------------------------------------------

    def place(
        self,
        policy: Policy,
        view: RequestView,
        rng: random.Random,
        *,
        exclude: frozenset[str],
        attempt: int,
        owner: str | None,
        now: float,
    ) -> Candidate:
        """Placement with the lifecycle: eligibility, states, then the policy.

        :raises NoAvailableWorkers: nobody can take it (see :meth:`unavailable`).
        """
        if self.open_breakers:
            for wid in list(self.open_breakers):
                m = self.machines.get(wid)
                if m is not None and m.cool(now):
                    self._refresh(wid)
        key = view.idempotency_key
        prefer = None if key is None else self.leases.joinable(key)
        unverified = self.unverified
        # Unverified workers are routable but not preferred: the verified ones are
        # tried first (a failed pass calls no policy: a round robin's rotation holds).
        admit = (lambda w: w.id not in unverified) if unverified else None
        while True:
            try:
                cand = place_candidate(
                    self.fleet,
                    policy,
                    view,
                    rng,
                    now=now,
                    attempt=attempt,
                    exclude=exclude,
                    owner=owner,
                    prefer=prefer,
                    admit=admit,
                )
                break
            except NoAvailableWorkers:
                if admit is None:
                    raise
                admit = None
        wid = cand.worker.id
        self.placed_at[wid] = now
        if cand.worker.kv_events is not None and self.fleet.kv.would_store(wid, view.kv_keys):
            self.fleet.kv_silence.expect(wid, now)
        if self.half_open and wid in self.half_open:
            self.machines[wid].start_trial(now)
            self._refresh(wid)
        return cand

    def unavailable(
        self,
        view: RequestView,
        exclude: frozenset[str],
        owner: str | None,
        exc: NoAvailableWorkers,
        now: float,
    ) -> WakeDecision | None:
        """Nobody can take ``view`` now: whether a wake helps (None: the refusal
        stands); a wake it decides to start is begun (the caller sends it)."""
        if not self.sleepy:
            return None  # nothing asleep: the refusal (503 with a hint) stands
        fleet = self.fleet
        workers = configured_for(fleet, view)
        if owner is not None and view.stateful:
            workers = [w for w in workers if w.origin == owner]
        dispositions = []
        for w in workers:
            if w.id in self.manual or w.id not in self.machines:
                continue
            if all(c.key in exclude for c in fleet.candidates_of(w)):
                continue
            dispositions.append((w.id, self.disposition(w.id)))
        cfg = self.config
        outcome = route(
            dispositions,
            retry_after_s=exc.retry_after_s or 1.0,
            wake_retry_after_s=cfg.wake_retry_after_s,
        )
        if isinstance(outcome, WakeThenRetry):
            decision = WakeDecision(outcome.worker_id, True, cfg.wake_retry_after_s)
        elif isinstance(outcome, Retry) and outcome.worker_id is not None:
            # already waking: share that wake
            decision = WakeDecision(outcome.worker_id, False, cfg.wake_retry_after_s)
        else:
            return None
        if decision.start:
            self.begin_wake(decision.worker_id, now)
        return decision

    def released(self, entry: LeaseEntry, verdict: Verdict, now: float) -> bool:
        """One lease reference ended; True when the lease itself ended."""
        ended = self.leases.end(entry, now)
        wid = entry.worker_id
        if ended and wid not in self.machines and not self.leases.count(wid):
            self.leases.forget(wid)  # removed while it ran: its idle clock goes too
        # A success on a worker whose breaker is clean changes nothing: skip it.
        if verdict is not _SUCCESS or wid in self.breaker_dirty:
            m = self.machines.get(wid)
            if m is not None:
                before = (m.breaker, m.trial, m.breaker_failures > 0)
                m.record(verdict, now)
                if (m.breaker, m.trial, m.breaker_failures > 0) != before:
                    if m.breaker is Breaker.OPEN and before[0] is not Breaker.OPEN:
                        self.trips[wid] = self.trips.get(wid, 0) + 1
                    self._refresh(wid)
        if ended and not self.leases.count(wid):
            self.changed.add(wid)  # a drain may be waiting for this
        return ended

    def breaker_trial(self, worker_id: str) -> bool:
        """Whether ``worker_id`` carries the one trial request of a half-open breaker."""
        if worker_id not in self.breaker_dirty:
            return False
        m = self.machines.get(worker_id)
        return m is not None and bool(m.trial)

    def ready(self, worker_id: str) -> bool | None:
        """For a request held for ``worker_id``: None while it wakes, then whether it
        can take requests (False when it was removed or its wake failed)."""
        m = self.machines.get(worker_id)
        if m is None:
            return False
        if m.state is State.WAKING:
            return None
        return worker_id not in self.blocked

    # -- drain, wake, sleep -----------------------------------------------------------

    def begin_drain(self, worker_id: str, now: float) -> None:
        """Stop new placements on ``worker_id``."""
        if self.machine(worker_id).state is not State.DRAINING:
            self.apply(worker_id, Event.DRAIN_REQUESTED, now)

    def drained(self, worker_id: str, now: float) -> bool | None:
        """True once ``worker_id`` holds no lease (or is gone); None while it does."""
        if worker_id not in self.machines:
            return True
        return None if isinstance(self.leases.activity(worker_id, now), Active) else True

    def finish_drain(self, worker_id: str, now: float) -> None:
        """The drain ended with no lease left: the worker is drained."""
        if worker_id in self.machines:
            self.apply(worker_id, Event.DRAINED, now)

    def _begin_op(self, worker_id: str) -> None:
        self.ops[worker_id] = self.ops.get(worker_id, 0) + 1
        self.op_epoch[worker_id] = self.op_epoch.get(worker_id, 0) + 1

    def _end_op(self, worker_id: str) -> None:
        n = self.ops.get(worker_id, 0) - 1
        if n > 0:
            self.ops[worker_id] = n
        else:
            self.ops.pop(worker_id, None)
        if worker_id in self.machines:
            self.op_epoch[worker_id] = self.op_epoch.get(worker_id, 0) + 1

    def begin_wake(self, worker_id: str, now: float) -> None:
        """SLEEPING → WAKING: the caller sends one ``POST /wake_up`` (a second
        request finds the worker waking and waits for this one)."""
        self.apply(worker_id, Event.WAKE_STARTED, now)
        self._begin_op(worker_id)

    def wake_called(self, worker_id: str, now: float) -> None:
        """This process sends the ``POST /wake_up`` (counted here, not when the
        wake begins: with ``serve --processes`` a wake one process begins is sent
        by process 0, and the processes' sums count each call to the engine once)."""
        self.wakes_total += 1

    def wake_asked(self, worker_id: str, now: float) -> bool:
        """An explicit wake (admin): True when a wake must be started now, False
        when none is needed (ready, or waking already).

        :raises LifecycleError: no sleep mode, or not in a wakeable state."""
        m = self.machine(worker_id)
        worker = self.fleet.get(worker_id)
        if worker is None or worker.sleep_mode != "vllm":
            raise LifecycleError("the worker has no sleep mode", state=m.state)
        if m.state in (State.READY, State.WAKING):
            return False
        self.begin_wake(worker_id, now)
        return True

    def wake_target(self, worker_id: str, now: float) -> Worker | None:
        """The worker to send ``/wake_up`` to, if it is still waking."""
        m = self.machines.get(worker_id)
        if m is None or m.state is not State.WAKING:
            return None
        return self.fleet.get(worker_id)

    def wake_done(self, worker_id: str, ok: bool, now: float) -> None:
        """The wake ended (or never ran)."""
        if worker_id in self.ops:
            self._end_op(worker_id)
        if worker_id in self.machines:
            self.apply(worker_id, Event.WAKE_SUCCEEDED if ok else Event.WAKE_FAILED, now)

    def begin_sleep(self, worker_id: str, now: float, *, strict: bool) -> Worker | None:
        """Right before ``POST /sleep``: the worker, now SLEEPING, or None when it
        must not sleep (a lease, a placement in flight, a state other than ready).

        :raises LifecycleError: (``strict``) unknown worker, no sleep mode, or a
            state that cannot sleep.
        """
        refusal = self._sleep_refusal(worker_id, now)
        if refusal is not None:
            if strict:
                raise refusal
            return None
        self.apply(worker_id, Event.SLEEP_STARTED, now)
        self._begin_op(worker_id)
        self.sleeps_total += 1
        return self.fleet.get(worker_id)

    def _sleep_refusal(
        self, worker_id: str, now: float, idle_s: float = 0.0, unverified: bool = False
    ) -> LifecycleError | None:
        """Why ``worker_id`` must not be put to sleep now (None: it may); with
        ``idle_s``, also when it was not idle here for that long; ``unverified``:
        a worker not probed yet may be too."""
        m = self.machines.get(worker_id)
        worker = self.fleet.get(worker_id)
        if m is None or worker is None:
            return LifecycleError(f"no such worker: {worker_id}")
        if worker.sleep_mode != "vllm":
            return LifecycleError("the worker has no sleep mode", state=m.state)
        if m.state is not State.READY and not (unverified and m.state is State.UNVERIFIED):
            return LifecycleError(f"a {m.state.value} worker cannot be put to sleep", state=m.state)
        act = self.leases.activity(worker_id, now, tracked=is_tracked(worker))
        if not isinstance(act, Idle):
            # Never sleep a worker that holds (or is about to hold) a lease.
            return LifecycleError("the worker holds a lease or was just placed on", state=m.state)
        if now - act.since < idle_s:
            return LifecycleError(
                f"the worker was used here in the last {idle_s:g} s", state=m.state
            )
        return None

    def check_sleep(self, worker_id: str, now: float, idle_s: float = 0.0) -> None:
        """:meth:`begin_sleep`'s strict checks, changing nothing: what another
        process of the same gateway asks before it puts the engine to sleep.

        :raises LifecycleError: unknown worker, no sleep mode, a state other than
            ready, or a lease (or a placement in flight) on it.
        """
        refusal = self._sleep_refusal(worker_id, now, idle_s)
        if refusal is not None:
            raise refusal

    def follow_sleep(self, worker_id: str, asleep: bool, now: float, idle_s: float = 0.0) -> bool:
        """Another process of the same gateway (``meshkit serve --processes``) puts
        the engine to sleep (``asleep``) or woke it: the state follows, with no call
        to the engine, so the engine is slept or woken once for the whole gateway.

        Going to sleep is refused like :meth:`begin_sleep` (a lease here vetoes it:
        the other process has not called the engine yet), but a worker not probed
        here yet follows too; a worker already asleep here accepts it unchanged. A
        probe's sleep report that raced with it is dropped (the op epoch moves), as
        after a sleep or wake of this process's own. ``sleeps_total`` and
        ``wakes_total`` count only the process that called the engine, so summed
        over processes they count each call once.

        :returns: whether the state changed (a veto's rollback undoes only those).
        :raises LifecycleError: (``asleep``) see :meth:`check_sleep`; (awake) no
            sleep mode, or an untracked worker.
        """
        m = self.machine(worker_id)
        worker = self.fleet.get(worker_id)
        if worker is None or worker.sleep_mode != "vllm":
            raise LifecycleError("the worker has no sleep mode", state=m.state)
        before = m.state
        if asleep:
            if before is State.SLEEPING:
                return False
            # A worker this process has not probed yet (it just started) takes the
            # sibling's word as a first look, as it would a probe's sleep report;
            # a lease here still vetoes it.
            refusal = self._sleep_refusal(worker_id, now, idle_s, unverified=True)
            if refusal is not None:
                raise refusal
            self.apply(worker_id, Event.REPORTED_SLEEPING, now)
        else:
            self.apply(worker_id, Event.REPORTED_AWAKE, now)
        self.op_epoch[worker_id] = self.op_epoch.get(worker_id, 0) + 1
        return m.state is not before

    def sleep_done(self, worker_id: str, ok: bool, now: float) -> None:
        if worker_id in self.ops:
            self._end_op(worker_id)
        if worker_id in self.machines:
            self.apply(worker_id, Event.SLEEP_SUCCEEDED if ok else Event.SLEEP_FAILED, now)

    def idle_candidates(self, now: float) -> list[str]:
        """Sleep-mode workers idle for ``idle_sleep_s``."""
        idle_s = self.config.idle_sleep_s
        if idle_s is None:
            return []
        out = []
        for w in self.fleet.workers:
            if w.sleep_mode != "vllm" or w.id in self.ops:
                continue
            m = self.machines.get(w.id)
            if m is None or m.state is not State.READY:
                continue
            act = self.leases.activity(w.id, now, tracked=is_tracked(w))
            if isinstance(act, Idle) and now - act.since >= idle_s:
                out.append(w.id)
        return out

    # -- probes -----------------------------------------------------------------------

    def probe_targets(self, now: float) -> list[tuple[Worker, int]]:
        """Tracked workers to probe, with their op epoch."""
        out = []
        for w in self.fleet.workers:
            m = self.machines.get(w.id)
            if m is not None and m.state is not State.UNTRACKED:
                out.append((w, self.op_epoch.get(w.id, 0)))
        return out

    def probed(self, results: Iterable[tuple[Worker, int, bool, bool | None]], now: float) -> None:
        """Apply one probe round at once.

        All results of a round land together, so placement never sees half a fleet
        verified (a round robin over a partly verified fleet would skip workers).
        A sleep report is dropped when a wake or sleep ran meanwhile: it may
        describe the worker before that operation.
        """
        for worker, epoch, ok, sleeping in results:
            wid = worker.id
            m = self.machines.get(wid)
            if m is None or m.state is State.UNTRACKED:
                continue
            self.apply(wid, Event.PROBE_OK if ok else Event.PROBE_FAILED, now)
            if (
                ok
                and sleeping is not None
                and wid not in self.ops
                and self.op_epoch.get(wid, 0) == epoch
            ):
                self.apply(wid, Event.REPORTED_SLEEPING if sleeping else Event.REPORTED_AWAKE, now)

    # -- reading ----------------------------------------------------------------------

    def describe(self, worker: Worker, index: int, now: float) -> dict[str, Any]:
        """One worker for the admin API: never its credentials."""
        m = self.machines.get(worker.id)
        fleet = self.fleet
        tracked = is_tracked(worker)
        act = self.leases.activity(worker.id, now, tracked=tracked)
        activity: dict[str, Any]
        if isinstance(act, Active):
            activity = {"kind": "active"}
        elif isinstance(act, Idle):
            activity = {"kind": "idle", "idle_s": round(max(0.0, now - act.since), 3)}
        else:
            activity = {"kind": "unknown"}
        return {
            "id": quote(worker.id, safe=""),
            "index": index,
            "url": worker.url,
            "labels": dict(worker.labels),
            # None: any model (unlabelled, and its list not learned yet)
            "models": None if (ms := fleet.models_of(worker)) is None else sorted(ms),
            "sleep_mode": worker.sleep_mode,
            "tracked": tracked,
            "state": m.state.value if m is not None else None,
            "healthy": worker.id not in fleet.unhealthy,
            "breaker": m.breaker.value if m is not None else None,
            "breaker_trips": self.trips.get(worker.id, 0),
            "load": sum(fleet.load.get(c.key, 0) for c in fleet.candidates_of(worker)),
            "leases": self.leases.count(worker.id),
            "activity": activity,
        }

    def health_of(self, worker_id: str) -> bool:
        """The probe verdict: False when failed, not yet probed, or set unhealthy."""
        m = self.machines.get(worker_id)
        if m is None or worker_id in self.manual:
            return False
        return m.state not in (State.FAILED, State.UNVERIFIED)

    def serving(self, worker: Worker) -> bool:
        """Counted as healthy by ``Mesh.health``: routable, or asleep (a wake serves it)."""
        return worker.id not in self.fleet.unhealthy or (
            worker.id in self.sleepy and worker.id not in self.manual
        )
