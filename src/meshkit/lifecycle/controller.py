"""
The lifecycle controller
========================

One :class:`Lifecycle` per :class:`~meshkit.Mesh`: the worker machines and the
lease table of :mod:`meshkit.core.lifecycle`, the sets placement reads, the
waiters of held requests and drains, and the handle on the background
:class:`~meshkit.lifecycle.runner.Runner` that probes, wakes and sleeps workers.

Locking: the controller has no lock of its own. Methods marked *(lock)* are
called with the Mesh lock held (the Mesh calls them from ``place``/``lease``/
``release``); the others take it themselves. Waiting never holds it.

How placement sees the lifecycle (the cheap part): a worker that must not take new
requests (failed, asleep, waking, draining, breaker open, untracked when tracking
is required) is put in ``fleet.unhealthy`` *when its disposition changes*, so the
existing placement filter does the work and a request pays nothing for it. Only
three small sets are checked per request: unverified workers (placed only when no
verified one can take the request), open breakers (a cool-down may have passed)
and half-open breakers (the placement is the trial). Everything else happens on
the slow path, when placement finds nobody (:meth:`Lifecycle.place`).

Waiting: a held request or a drain waits on a predicate evaluated under the Mesh
lock. Sync callers wait on a :class:`threading.Condition` over the Mesh lock;
async callers on a future that the thread changing the state resolves with
``loop.call_soon_threadsafe``, so cancelling the waiting task (the client left)
ends the wait at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from meshkit.core.forward import WakePending
from meshkit.core.lifecycle import (
    Active,
    Breaker,
    Disposition,
    Event,
    Idle,
    LeaseEntry,
    LeaseKind,
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
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker
from meshkit.errors import NoAvailableWorkers, WorkerWaking

if TYPE_CHECKING:
    from meshkit.lifecycle.runner import Runner
    from meshkit.mesh import Mesh

__all__ = ["IDEMPOTENCY_KEY", "NO_WAIT", "Lifecycle", "is_tracked"]

#: ``RequestView.extra`` keys the Mesh fills from request headers.
IDEMPOTENCY_KEY = "mesh.idempotency_key"
NO_WAIT = "mesh.no_wait"

_ROUTABLE = (Disposition.ROUTE, Disposition.FALLBACK)
_SUCCESS = Verdict.SUCCESS  # read per request: a global is cheaper than the member
_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


def is_tracked(worker: Worker) -> bool:
    """``mesh.tracking`` = ``complete`` (default): all its traffic goes through
    meshkit, so its leases are the whole truth about its activity."""
    return worker.labels.get("mesh.tracking", "complete").strip() == "complete"


def _toggle(s: set[str], key: str, on: bool) -> None:
    if on:
        s.add(key)
    else:
        s.discard(key)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Readiness:
    """The :class:`~meshkit.core.forward.ReadinessWaiter` of one held request."""

    __slots__ = ("_lc", "_wid")

    def __init__(self, lc: Lifecycle, worker_id: str) -> None:
        self._lc = lc
        self._wid = worker_id

    def _check(self) -> bool | None:
        lc = self._lc
        m = lc.machines.get(self._wid)
        if m is None:
            return False  # removed while we waited
        if m.state is State.WAKING:
            return None
        return self._wid not in lc.blocked

    def wait_sync(self, deadline_s: float) -> bool:
        return self._lc.wait_sync(self._check, deadline_s)

    async def wait_async(self, deadline_s: float) -> bool:
        return await self._lc.wait_async(self._wid, self._check, deadline_s)


class Lifecycle:
    """Worker lifecycle state of one Mesh (see the module docstring)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        cfg = self.config = mesh.config.lifecycle
        self.thresholds = Thresholds(
            failure=max(1, cfg.failure_threshold),
            success=max(1, cfg.success_threshold),
            breaker_failures=cfg.breaker_failures,
            breaker_open_s=cfg.breaker_open_s,
        )
        self.leases = LeaseTable(ttl_s=cfg.idempotency_ttl_s, max_finished=cfg.idempotency_max)
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
        self.cond = threading.Condition(mesh._lock)
        self._sync_waiting = 0
        self._async_waiters: dict[str, list[_Waiter]] = {}
        self._runner: Runner | None = None
        self._closed = False
        #: the runner was started (or found unnecessary); read per request
        self.started = False
        now = mesh.clock()
        for w in mesh.fleet.workers:
            self.track(w, now)

    # -- workers joining and leaving --------------------------------------------------

    def track(self, worker: Worker, now: float) -> None:
        """(lock) A new worker: unverified until probed, ready when probing is off,
        untracked when its traffic does not all go through meshkit."""
        m = WorkerMachine(self.thresholds)
        if is_tracked(worker):
            m.handle(Event.ADDED)
            if not self.config.probe:
                m.handle(Event.ASSUMED_READY)
        self.machines[worker.id] = m
        self.leases.touch(worker.id, now)
        self._refresh(worker.id)

    def forget(self, worker_id: str) -> None:
        """(lock) The worker was removed from the fleet."""
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
        self._notify(worker_id)

    def set_manual(self, worker_id: str, healthy: bool) -> None:
        """(lock) ``Mesh.set_healthy``: an operator's verdict, kept apart from probes."""
        unhealthy = self.mesh.fleet.unhealthy
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

    def apply(self, worker_id: str, event: Event) -> State:
        """(lock) Apply ``event``; raises :class:`LifecycleError` for an invalid pair."""
        m = self.machine(worker_id)
        before = m.state
        state = m.handle(event)
        if state is State.READY and before is not State.READY:
            self.leases.touch(worker_id, self.mesh.clock())
        self._refresh(worker_id)
        return state

    def disposition(self, worker_id: str) -> Disposition:
        m = self.machine(worker_id)
        return disposition(
            m.state, m.breaker, m.trial, require_tracking=self.config.require_tracking
        )

    def _refresh(self, worker_id: str) -> None:
        """(lock) Recompute the sets placement reads for one worker; wake its waiters."""
        m = self.machines.get(worker_id)
        if m is None:
            return
        d = disposition(m.state, m.breaker, m.trial, require_tracking=self.config.require_tracking)
        unhealthy = self.mesh.fleet.unhealthy
        # fleet.unhealthy is touched only when blocked-ness flips, so marks set by
        # the operator (set_healthy) or by other code survive lifecycle events.
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
        self._notify(worker_id)

    # -- the request path -------------------------------------------------------------

    def place(
        self,
        view: RequestView,
        *,
        exclude: frozenset[str],
        attempt: int,
        owner: str | None,
        now: float,
    ) -> Candidate:
        """(lock) Placement with the lifecycle: the Mesh's ``place``.

        :raises WakePending: only sleeping/waking workers could take it and the
            client may wait (a wake is under way).
        :raises WorkerWaking: the same, but the client asked not to wait.
        """
        if self.open_breakers:
            self._cool(now)
        prefer = None
        key = view.extra.get(IDEMPOTENCY_KEY) if view.extra else None
        if key is not None:
            prefer = self.leases.joinable(key)
        mesh = self.mesh
        admit = mesh.admit
        try:
            if not self.unverified:
                # The common case, called directly (one frame less per request).
                cand = place_candidate(
                    mesh.fleet,
                    mesh.policy,
                    view,
                    mesh.rng,
                    now=now,
                    attempt=attempt,
                    exclude=exclude,
                    owner=owner,
                    admit=admit,
                    prefer=prefer,
                )
            else:
                # Unverified workers are routable but not preferred: try the
                # verified ones first (a failed pass calls no policy, so a round
                # robin's rotation is not disturbed).
                try:
                    cand = self._place(
                        view, exclude, attempt, owner, now, self._verified(admit), prefer
                    )
                except NoAvailableWorkers:
                    cand = self._place(view, exclude, attempt, owner, now, admit, prefer)
        except NoAvailableWorkers as exc:
            self._unavailable(view, exclude, owner, now, exc)
            raise
        wid = cand.worker.id
        self.placed_at[wid] = now  # LeaseTable.placed(), without the call
        if self.half_open and wid in self.half_open:
            self.machines[wid].start_trial(now)
            self._refresh(wid)
        return cand

    def _place(
        self,
        view: RequestView,
        exclude: frozenset[str],
        attempt: int,
        owner: str | None,
        now: float,
        admit: Callable[[Worker], bool] | None,
        prefer: str | None,
    ) -> Candidate:
        mesh = self.mesh
        return place_candidate(
            mesh.fleet,
            mesh.policy,
            view,
            mesh.rng,
            now=now,
            attempt=attempt,
            exclude=exclude,
            owner=owner,
            admit=admit,
            prefer=prefer,
        )

    def _verified(self, admit: Callable[[Worker], bool] | None) -> Callable[[Worker], bool]:
        unverified = self.unverified
        if admit is None:
            return lambda w: w.id not in unverified
        return lambda w: w.id not in unverified and admit(w)

    def _cool(self, now: float) -> None:
        for wid in list(self.open_breakers):
            m = self.machines.get(wid)
            if m is not None and m.cool(now):
                self._refresh(wid)

    def _unavailable(
        self,
        view: RequestView,
        exclude: frozenset[str],
        owner: str | None,
        now: float,
        exc: NoAvailableWorkers,
    ) -> None:
        """(lock) Nobody can take ``view`` now: start or join a wake, if that helps.

        Returns only when the original refusal stands.
        """
        if not self.sleepy:
            return  # nothing asleep: the refusal (503 with a hint) stands
        mesh = self.mesh
        admit = mesh.admit
        workers = configured_for(mesh.fleet, view)
        if owner is not None and view.stateful:
            workers = [w for w in workers if w.origin == owner]
        dispositions = []
        for w in workers:
            if w.id in self.manual or w.id not in self.machines:
                continue
            if admit is not None and not admit(w):
                continue
            if all(c.key in exclude for c in mesh.fleet.candidates_of(w)):
                continue
            dispositions.append((w.id, self.disposition(w.id)))
        cfg = self.config
        outcome = route(
            dispositions,
            retry_after_s=exc.retry_after_s or 1.0,
            wake_retry_after_s=cfg.wake_retry_after_s,
        )
        if isinstance(outcome, WakeThenRetry):
            wid = outcome.worker_id
            self._start_wake(wid)
        elif isinstance(outcome, Retry) and outcome.worker_id is not None:
            wid = outcome.worker_id  # already waking: share that wake
        else:
            return
        hint = cfg.wake_retry_after_s
        if cfg.wake_wait_s <= 0 or view.extra.get(NO_WAIT):
            raise WorkerWaking("the worker is waking up; retry shortly", retry_after_s=hint)
        raise WakePending(wid, now + cfg.wake_wait_s, _Readiness(self, wid), hint)

    def take(self, cand: Candidate, view: RequestView, now: float) -> tuple[LeaseEntry, LeaseKind]:
        """(lock) The lease of a forwarded request (a join shares its twin's)."""
        key = view.extra.get(IDEMPOTENCY_KEY) if view.extra else None
        return self.leases.start(cand.worker.id, cand.key, now, key=key, weight=view.prompt_weight)

    def released(self, entry: LeaseEntry, verdict: Verdict, now: float) -> bool:
        """(lock) One lease reference ended; True when the lease itself ended."""
        ended = self.leases.end(entry, now)
        wid = entry.worker_id
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
        if ended and (self._sync_waiting or self._async_waiters) and not self.leases.count(wid):
            self._notify(wid)  # a drain may be waiting for this
        return ended

    # -- waiting ----------------------------------------------------------------------

    def _notify(self, worker_id: str) -> None:
        """(lock) Something about ``worker_id`` changed: let its waiters re-check."""
        if self._sync_waiting:
            self.cond.notify_all()
        waiters = self._async_waiters.pop(worker_id, None)
        if waiters:
            for loop, fut in waiters:
                # A closed loop has nobody waiting any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_resolve, fut)

    def wait_sync(
        self, pred: Callable[[], bool | None], deadline: float, *, poll_s: float | None = None
    ) -> bool:
        """Block until ``pred()`` (under the lock) is not None, or ``deadline``."""
        clock = self.mesh.clock
        with self.cond:
            while True:
                r = pred()
                if r is not None:
                    return r
                remaining = deadline - clock()
                if remaining <= 0:
                    return False
                if poll_s is not None:
                    remaining = min(remaining, poll_s)
                self._sync_waiting += 1
                try:
                    self.cond.wait(remaining)
                finally:
                    self._sync_waiting -= 1

    async def wait_async(
        self,
        worker_id: str,
        pred: Callable[[], bool | None],
        deadline: float,
        *,
        poll_s: float | None = None,
    ) -> bool:
        """:meth:`wait_sync` for a coroutine; cancelling it stops the wait at once."""
        loop = asyncio.get_running_loop()
        clock = self.mesh.clock
        lock = self.mesh._lock
        while True:
            with lock:
                r = pred()
                if r is not None:
                    return r
                remaining = deadline - clock()
                if remaining <= 0:
                    return False
                fut: asyncio.Future[None] = loop.create_future()
                waiter = (loop, fut)
                self._async_waiters.setdefault(worker_id, []).append(waiter)
            if poll_s is not None:
                remaining = min(remaining, poll_s)
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                pass
            finally:
                with lock:
                    waiters = self._async_waiters.get(worker_id)
                    if waiters is not None and waiter in waiters:
                        waiters.remove(waiter)
                        if not waiters:
                            del self._async_waiters[worker_id]

    # -- drain --------------------------------------------------------------------------

    def begin_drain(self, worker_id: str) -> None:
        """(lock) Stop new placements on ``worker_id``."""
        if self.machine(worker_id).state is not State.DRAINING:
            self.apply(worker_id, Event.DRAIN_REQUESTED)

    def _drained(self, worker_id: str) -> bool | None:
        if worker_id not in self.machines:
            return True
        act = self.leases.activity(worker_id, self.mesh.clock())
        return None if isinstance(act, Active) else True

    def _drain_deadline(self, timeout_s: float | None) -> float:
        wait = self.config.drain_timeout_s if timeout_s is None else timeout_s
        return self.mesh.clock() + max(0.0, wait)

    def _finish_drain(self, worker_id: str, drained: bool) -> bool:
        with self.mesh._lock:
            if drained and worker_id in self.machines:
                self.apply(worker_id, Event.DRAINED)
        return drained

    def drain(self, worker_id: str, timeout_s: float | None = None) -> bool:
        """Stop placements, wait for the worker's leases to end (bounded)."""
        deadline = self._drain_deadline(timeout_s)
        with self.mesh._lock:
            self.begin_drain(worker_id)
        # A placement counts as activity for PLACE_GRACE_S before its lease exists,
        # and that expiry wakes nobody: re-check at that pace.
        ok = self.wait_sync(lambda: self._drained(worker_id), deadline, poll_s=self.leases.grace_s)
        return self._finish_drain(worker_id, ok)

    async def adrain(self, worker_id: str, timeout_s: float | None = None) -> bool:
        deadline = self._drain_deadline(timeout_s)
        with self.mesh._lock:
            self.begin_drain(worker_id)
        ok = await self.wait_async(
            worker_id, lambda: self._drained(worker_id), deadline, poll_s=self.leases.grace_s
        )
        return self._finish_drain(worker_id, ok)

    # -- sleep and wake ---------------------------------------------------------------

    def _begin_op(self, worker_id: str) -> None:
        self.ops[worker_id] = self.ops.get(worker_id, 0) + 1
        self.op_epoch[worker_id] = self.op_epoch.get(worker_id, 0) + 1

    def _end_op(self, worker_id: str) -> None:
        n = self.ops.get(worker_id, 0) - 1
        if n > 0:
            self.ops[worker_id] = n
        else:
            self.ops.pop(worker_id, None)
        self.op_epoch[worker_id] = self.op_epoch.get(worker_id, 0) + 1

    def _start_wake(self, worker_id: str) -> None:
        """(lock) SLEEPING → WAKING and one ``POST /wake_up`` (deduplicated: a
        second request finds the worker waking and waits for this one)."""
        self.apply(worker_id, Event.WAKE_STARTED)
        self.wakes_total += 1
        self._begin_op(worker_id)
        fut = self.runner().submit_wake(worker_id)
        fut.add_done_callback(lambda f: self._wake_not_run(worker_id, f))

    def _wake_not_run(self, worker_id: str, fut: concurrent.futures.Future[bool]) -> None:
        # The runner stopped before performing the wake: do not leave it "waking".
        if fut.cancelled() or fut.exception() is not None:
            self.wake_done(worker_id, False)

    def start_wake(self, worker_id: str) -> bool:
        """(lock) An explicit wake (admin): True when a wake is now under way or
        not needed. :raises LifecycleError: no sleep mode, or not in a wakeable state."""
        m = self.machine(worker_id)
        worker = self.mesh.fleet.get(worker_id)
        if worker is None or worker.sleep_mode != "vllm":
            raise LifecycleError("the worker has no sleep mode", state=m.state)
        if m.state in (State.READY, State.WAKING):
            return True
        self._start_wake(worker_id)
        return True

    def wake_target(self, worker_id: str) -> Worker | None:
        """(takes the lock) The worker to send ``/wake_up`` to, if it is still waking."""
        with self.mesh._lock:
            m = self.machines.get(worker_id)
            if m is None or m.state is not State.WAKING:
                return None
            return self.mesh.fleet.get(worker_id)

    def wake_done(self, worker_id: str, ok: bool) -> None:
        """(takes the lock) The wake ended (or never ran)."""
        with self.mesh._lock:
            if worker_id in self.ops:
                self._end_op(worker_id)
            if worker_id in self.machines:
                self.apply(worker_id, Event.WAKE_SUCCEEDED if ok else Event.WAKE_FAILED)

    def readiness(self, worker_id: str) -> _Readiness:
        return _Readiness(self, worker_id)

    def begin_sleep(self, worker_id: str, *, strict: bool) -> Worker | None:
        """(takes the lock) Right before ``POST /sleep``: the worker, now SLEEPING,
        or None when it must not sleep (a lease, a placement in flight, a state
        other than ready). Checked and applied under one lock hold, so no request
        can be placed on it in between.

        :raises LifecycleError: (``strict``) unknown worker, no sleep mode, or a
            state that cannot sleep.
        """
        with self.mesh._lock:
            m = self.machines.get(worker_id)
            worker = self.mesh.fleet.get(worker_id)
            if m is None or worker is None:
                if strict:
                    raise LifecycleError(f"no such worker: {worker_id}")
                return None
            if worker.sleep_mode != "vllm":
                if strict:
                    raise LifecycleError("the worker has no sleep mode", state=m.state)
                return None
            if m.state is not State.READY:
                if strict:
                    raise LifecycleError(
                        f"a {m.state.value} worker cannot be put to sleep", state=m.state
                    )
                return None
            act = self.leases.activity(worker_id, self.mesh.clock(), tracked=is_tracked(worker))
            if not isinstance(act, Idle):
                # Never sleep a worker that holds (or is about to hold) a lease.
                if strict:
                    raise LifecycleError(
                        "the worker holds a lease or was just placed on", state=m.state
                    )
                return None
            self.apply(worker_id, Event.SLEEP_STARTED)
            self._begin_op(worker_id)
            self.sleeps_total += 1
            return worker

    def sleep_done(self, worker_id: str, ok: bool) -> None:
        with self.mesh._lock:
            if worker_id in self.ops:
                self._end_op(worker_id)
            if worker_id in self.machines:
                self.apply(worker_id, Event.SLEEP_SUCCEEDED if ok else Event.SLEEP_FAILED)

    def idle_candidates(self) -> list[str]:
        """(takes the lock) Sleep-mode workers idle for ``idle_sleep_s``."""
        idle_s = self.config.idle_sleep_s
        if idle_s is None:
            return []
        out = []
        with self.mesh._lock:
            now = self.mesh.clock()
            for w in self.mesh.fleet.workers:
                if w.sleep_mode != "vllm" or w.id in self.ops:
                    continue
                m = self.machines.get(w.id)
                if m is None or m.state is not State.READY:
                    continue
                act = self.leases.activity(w.id, now, tracked=is_tracked(w))
                if isinstance(act, Idle) and now - act.since >= idle_s:
                    out.append(w.id)
        return out

    # -- probes -------------------------------------------------------------------------

    def probe_targets(self) -> list[tuple[Worker, int]]:
        """(takes the lock) Tracked workers to probe, with their op epoch."""
        with self.mesh._lock:
            out = []
            for w in self.mesh.fleet.workers:
                m = self.machines.get(w.id)
                if m is not None and m.state is not State.UNTRACKED:
                    out.append((w, self.op_epoch.get(w.id, 0)))
            return out

    def probed(self, results: list[tuple[Worker, int, bool, bool | None]]) -> None:
        """(takes the lock) Apply one probe round at once.

        All results of a round land together, so placement never sees half a fleet
        verified (a round robin over a partly verified fleet would skip workers).
        A sleep report is dropped when a wake or sleep ran meanwhile: it may
        describe the worker before that operation.
        """
        with self.mesh._lock:
            for worker, epoch, ok, sleeping in results:
                wid = worker.id
                m = self.machines.get(wid)
                if m is None or m.state is State.UNTRACKED:
                    continue
                self.apply(wid, Event.PROBE_OK if ok else Event.PROBE_FAILED)
                if (
                    ok
                    and sleeping is not None
                    and wid not in self.ops
                    and self.op_epoch.get(wid, 0) == epoch
                ):
                    self.apply(wid, Event.REPORTED_SLEEPING if sleeping else Event.REPORTED_AWAKE)

    # -- the runner ---------------------------------------------------------------------

    def runner(self) -> Runner:
        if self._runner is None:
            from meshkit.lifecycle.runner import Runner  # aiohttp: imported when needed

            self._runner = Runner(self)
        return self._runner

    def start(self) -> None:
        """Start the background runner if there is anything for it to do."""
        if self.started or self._closed:
            return
        self.started = True
        cfg = self.config
        if (
            cfg.probe
            or cfg.idle_sleep_s is not None
            or any(w.sleep_mode for w in self.mesh.fleet.workers)
        ):
            self.runner().start()

    def kick(self) -> None:
        """Probe now (a worker was added)."""
        if self._runner is not None:
            self._runner.kick()

    def close(self) -> None:
        self._closed = True
        if self._runner is not None:
            self._runner.stop()

    # -- reading ------------------------------------------------------------------------

    def describe(self, worker: Worker, index: int, now: float) -> dict[str, Any]:
        """(lock) One worker for the admin API: never its credentials."""
        m = self.machines.get(worker.id)
        fleet = self.mesh.fleet
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
        """(lock) The probe verdict: False when failed, not yet probed, or set unhealthy."""
        m = self.machines.get(worker_id)
        if m is None or worker_id in self.manual:
            return False
        return m.state not in (State.FAILED, State.UNVERIFIED)
