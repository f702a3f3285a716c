"""
The Router
==========

The one owner of routing state: the fleet and its load, the policy, Responses
affinity (and the background Responses whose usage this process counted), the
worker states and leases (:class:`~meshkit.core.states.WorkerStates`), the
prefill/decode pair policies, and the lock that serialises them, so WSGI
threads, sync transports, event loops and the lifecycle thread may share it. The
pure core decides (placement, states, flows); the Router applies those decisions
under its lock and offers them as methods. Nothing else takes the lock: the
lifecycle controller, the admin API and the metrics call these methods.

It is the :class:`~meshkit.core.forward.Placer` and the
:class:`~meshkit.core.pd.PdPlacer` the core's flows drive.

Waiting (a request held for a waking worker, a drain) is a predicate evaluated
under the lock: sync callers wait on a :class:`threading.Condition` over it; async
callers on a future that the thread changing the state resolves with
``loop.call_soon_threadsafe``, so cancelling the waiting task ends the wait at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from meshkit.accounting import CountedResponses
from meshkit.core.endpoints import Api
from meshkit.core.engine_load import EngineLoad
from meshkit.core.forward import WakePending
from meshkit.core.kv_events import Batch
from meshkit.core.lifecycle import LeaseEntry, LeaseKind, Verdict
from meshkit.core.placement import (
    admission_refusal,
    configured_for,
    eligible,
    overloaded,
    state_owner_origin,
    uncached_weight,
)
from meshkit.core.policies.affinity import ResponsesAffinity
from meshkit.core.policies.base import (
    BasePolicy,
    Completion,
    Needs,
    PlacementContext,
    Policy,
    merged,
)
from meshkit.core.policies.registry import create_policy
from meshkit.core.requests import RequestView
from meshkit.core.states import WorkerStates, is_tracked
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import ConfigError, NoAvailableWorkers, WorkerWaking

if TYPE_CHECKING:
    from meshkit.config import MeshConfig
    from meshkit.metrics import RouterMetrics

__all__ = ["Lease", "Router"]

_SUCCESS: Final = Verdict.SUCCESS
_FAILURE: Final = Verdict.FAILURE
_NEUTRAL: Final = Verdict.NEUTRAL
_JOINED: Final = LeaseKind.JOINED
_PD_PROTOCOLS: Final = ("sglang", "vllm")
_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]
T = TypeVar("T")


def _overrides(policy: Policy, hook: str) -> bool:
    """Whether ``policy``'s ``hook`` may do something (BasePolicy's hooks are no-ops):
    a call into a policy is an interpreted call, even from a compiled build."""
    return getattr(getattr(policy, hook), "__func__", None) is not getattr(BasePolicy, hook)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Lease:
    """A claim on a candidate's capacity, released exactly once.

    It holds one reference to a lease entry of the lease table: requests that join
    a running twin by ``Idempotency-Key`` share that entry, and the capacity is
    given back when the last reference ends. The release is also the request's
    verdict for the worker's circuit breaker.
    """

    __slots__ = ("_router", "candidate", "entry", "released", "started")

    def __init__(self, router: Router, cand: Candidate, started: float, entry: LeaseEntry) -> None:
        self._router = router
        self.candidate = cand
        self.started = started
        self.entry = entry
        self.released = False

    def release(self, *, ok: bool, status: int | None = None) -> None:
        # No status: the attempt failed before an answer (connect, protocol,
        # timeout) or mid-body; a 5xx is a failure too; any other answer a success.
        if not self.released:  # set once, under the lock: no need to take it to see it
            if status is None:
                verdict = _SUCCESS if ok else _FAILURE
            else:
                verdict = _FAILURE if status >= 500 else _SUCCESS
            self._router.release(self, verdict)

    def abandon(self) -> None:
        """Release without a verdict on the worker (the client left, a pool timeout)."""
        if not self.released:
            self._router.release(self, _NEUTRAL)


class _Readiness:
    """The :class:`~meshkit.core.forward.ReadinessWaiter` of one held request."""

    __slots__ = ("_router", "_wid")

    def __init__(self, router: Router, worker_id: str) -> None:
        self._router = router
        self._wid = worker_id

    def _check(self) -> bool | None:
        return self._router.states.ready(self._wid)

    def wait_sync(self, deadline_s: float) -> bool:
        return self._router.wait_sync(self._check, deadline_s)

    async def wait_async(self, deadline_s: float) -> bool:
        return await self._router.wait_async(self._wid, self._check, deadline_s)


class Router:
    """Routing state and the lock over it (see the module docstring).

    :param on_wake: starts the I/O of a wake (``POST /wake_up``) of a worker the
        router just moved to ``waking``; called under the lock, it must not block.
    """

    def __init__(
        self,
        config: MeshConfig,
        *,
        clock: Callable[[], float],
        metrics: RouterMetrics,
        on_wake: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.on_wake = on_wake or (lambda worker_id: None)
        self._lock = threading.RLock()
        # Bound once: the three methods every request calls (place, lease,
        # release) take the lock through these. A ``with`` block looks
        # ``__enter__``/``__exit__`` up on the lock's type at each entry and passes
        # ``__exit__`` an argument tuple (benchmarks/RESULTS.md, "Builtin methods
        # without a lookup").
        self._acquire = self._lock.acquire
        self._unlock = self._lock.release
        self._cond = threading.Condition(self._lock)
        self._sync_waiting = 0
        self._async_waiters: dict[str, list[_Waiter]] = {}
        self.rng = random.Random(config.routing.seed)
        up = config.upstream
        self.fleet = Fleet(
            config.workers,
            max_in_flight=up.in_flight_limit,
            max_in_flight_per_worker=up.in_flight_limit_per_worker,
            kv_max_blocks=config.kv.max_blocks_per_model,
            kv_silence_s=config.kv.silence_s,
            kv_max_loras=config.kv.max_lora_names,
            kv_max_worker_sets=config.kv.max_worker_sets,
        )
        opts = config.policies.get(config.policy, {}) if isinstance(config.policy, str) else {}
        self.policy = create_policy(config.policy, opts)
        self.affinity = ResponsesAffinity(
            max_entries=config.routing.responses_affinity_max,
            ttl_s=config.routing.responses_affinity_ttl_s,
        )
        #: ids every origin said it does not hold (asked at most once per TTL)
        self.missing = ResponsesAffinity(
            max_entries=config.routing.responses_affinity_max,
            ttl_s=config.routing.responses_lookup_ttl_s,
        )
        #: background Responses whose usage this process counted (read once)
        self.counted = CountedResponses(config.routing.responses_counted_max)
        self.states = WorkerStates(self.fleet, config.lifecycle, clock())
        pd = config.pd
        if pd.protocol not in _PD_PROTOCOLS:
            raise ConfigError("pd.protocol", f"must be one of {', '.join(_PD_PROTOCOLS)}")
        self.pd_protocol = pd.protocol
        self.prefill_policy = create_policy(
            pd.prefill_policy, config.policies.get(pd.prefill_policy, {})
        )
        self.decode_policy = create_policy(
            pd.decode_policy, config.policies.get(pd.decode_policy, {})
        )
        #: the block sizes of the workers the KV index has events of (prepare reads it)
        self.kv_sizes: frozenset[int] = frozenset()
        self._roles_version = -1
        self._pairs = False
        #: the PD policies' needs last merged, and what they merged to
        self._merged: tuple[tuple[Needs, Needs, Needs], Needs] | None = None

    @property
    def policy(self) -> Policy:
        """The placement policy (it may be replaced at runtime)."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._policy = policy
        #: whether completions must be built for it (read once per request)
        self.listens = _overrides(policy, "on_complete")
        #: whether it hears of each placement
        self.hears_placed = _overrides(policy, "on_placed")

    # -- the flows' placer ------------------------------------------------------------

    def place(self, view: RequestView, *, exclude: frozenset[str], attempt: int) -> Candidate:
        """A candidate for ``view`` (eligibility, worker states, affinity, the policy).

        :raises WakePending: only sleeping or waking workers could take it, and
            the client may wait (a wake is under way).
        """
        if attempt:
            self.metrics.retries.labels("failover").inc()
        now = self.clock()
        self._acquire()
        try:
            owner = None
            sid = view.state_id
            if sid:
                owner = self.affinity.owner(sid, now)
            states = self.states
            try:
                cand = states.place(
                    self._policy,
                    view,
                    self.rng,
                    exclude=exclude,
                    attempt=attempt,
                    owner=owner,
                    now=now,
                )
            except NoAvailableWorkers as exc:
                wake = states.unavailable(view, exclude, owner, exc, now)
                self._changed()
                if wake is None:
                    raise
                if wake.start:
                    self.on_wake(wake.worker_id)
                wait_s = self.config.lifecycle.wake_wait_s
                bound = view.timeout.connect if view.timeout is not None else None
                if bound is not None:
                    # A client that waits at most this long for a connection is not
                    # held longer for a waking worker (it is answered 503 then).
                    wait_s = min(wait_s, bound)
                if wait_s <= 0 or view.no_wait:
                    raise WorkerWaking(
                        "the worker is waking up; retry shortly", retry_after_s=wake.retry_after_s
                    ) from None
                deadline = now + wait_s
                waiter = _Readiness(self, wake.worker_id)
                raise WakePending(wake.worker_id, deadline, waiter, wake.retry_after_s) from None
            if states.changed:
                self._changed()
            if self.hears_placed:
                self._policy.on_placed(cand, view, now)
            return cand
        finally:
            self._unlock()

    @property
    def capture_limit(self) -> int:
        """``bounds.max_captured_body_bytes``: the most of a worker's body a flow reads whole."""
        return self.config.bounds.max_captured_body_bytes

    def lease(self, cand: Candidate, view: RequestView, *, admission: bool = True) -> Lease:
        """A lease on ``cand`` (its slot is taken).

        :param admission: check the admission limits again, under the lock that
            takes the slot (another thread may have taken the last one since
            placement). False for prefill/decode legs: the pair is admitted when
            placed, and a refused second leg would strand the first.
        :raises Overloaded: ``cand``'s worker, or the fleet, is at its limit.
        """
        now = self.clock()
        fleet = self.fleet
        self._acquire()
        try:
            if admission and fleet.at_limit(cand.worker):
                refusal = admission_refusal(fleet, cand.worker)
                # The one trial request of a half-open breaker, already placed, may
                # go one over: refused, it would never end and the breaker would
                # wait for it forever.
                if refusal is not None and not self.states.breaker_trial(cand.worker.id):
                    raise refusal
            entry, kind = self.states.leases.start(
                cand.worker.id,
                cand.key,
                now,
                key=view.idempotency_key,
                weight=uncached_weight(fleet, cand, view),
            )
            if kind is not _JOINED:  # a join shares its twin's capacity
                fleet.acquire(cand, entry.weight)
        finally:
            self._unlock()
        return Lease(self, cand, now, entry)

    def release(self, lease: Lease, verdict: Verdict) -> None:
        """(``Lease.release``) One lease reference ends with ``verdict`` on its worker."""
        now = self.clock()
        self._acquire()
        try:
            if lease.released:
                return
            lease.released = True
            states = self.states
            if states.released(lease.entry, verdict, now):
                self.fleet.release(lease.candidate, lease.entry.weight, now - lease.started)
            # Only a waiter needs to hear of it now: the set is bounded by the fleet,
            # and the next change that finds a waiter clears it.
            if states.changed and (self._sync_waiting or self._async_waiters):
                self._changed()
        finally:
            self._unlock()

    def targets(self, view: RequestView) -> list[Candidate]:
        """One candidate per origin for fan-out: the known owner only, else healthy first."""
        now = self.clock()
        with self._lock:
            fleet = self.fleet
            workers = configured_for(fleet, view)
            rid = view.match.resource_id
            if rid:
                owner = self.affinity.owner(rid, now)
                if owner is not None and any(w.origin == owner for w in workers):
                    workers = [w for w in workers if w.origin == owner]
            return self._one_per_origin(workers)

    def _one_per_origin(self, workers: list[Worker]) -> list[Candidate]:
        """(lock) A candidate per origin of ``workers``, healthy ones first."""
        fleet = self.fleet
        by_origin: dict[str, Candidate] = {}
        for w in sorted(workers, key=lambda w: not fleet.healthy(w)):
            cands = fleet.candidates_of(w)
            if cands and w.origin not in by_origin:
                by_origin[w.origin] = cands[0]
        return list(by_origin.values())

    def pass_through(self) -> Candidate:
        """A healthy worker, at random, for a request meshkit does not route."""
        with self._lock:
            healthy = [w for w in self.fleet.workers if self.fleet.healthy(w)]
            if not healthy:
                raise NoAvailableWorkers("no healthy worker is available")
            return self.fleet.candidates_of(healthy[self.rng.randrange(len(healthy))])[0]

    # -- prefill/decode ---------------------------------------------------------------

    def _has_pairs(self) -> bool:
        """Whether the fleet has prefill and decode workers."""
        fleet = self.fleet
        if fleet.version != self._roles_version:
            roles = frozenset(w.role for w in fleet.workers)
            self._pairs = "prefill" in roles and "decode" in roles
            self._roles_version = fleet.version
        return self._pairs

    def disaggregated(self, view: RequestView) -> bool:
        """Whether ``view`` runs on prefill/decode pairs: the fleet has both roles and
        no regular worker serves its API."""
        if view.api in (Api.MODELS, Api.TOKENIZE) or not self._has_pairs():
            return False
        return not any(w.role == "regular" and w.serves(view.api) for w in self.fleet.workers)

    def needs(self) -> Needs:
        """What the placement policies read from a request (the prepare stage asks
        per request): the policy's, and on a fleet of prefill/decode pairs also what
        the prefill and decode policies read."""
        needs = self._policy.needs
        if not self._has_pairs():
            return needs
        parts = (needs, self.prefill_policy.needs, self.decode_policy.needs)
        last = self._merged
        if last is None or any(a is not b for a, b in zip(parts, last[0], strict=True)):
            # asked three times per request: merged once per change of a policy
            last = self._merged = (parts, merged(*parts))
        return last[1]

    def place_pair(self, view: RequestView) -> tuple[Candidate, Candidate]:
        """A (prefill, decode) pair, each side by its own policy. A pair takes two of
        the fleet's ``upstream.max_in_flight`` slots and is admitted here."""
        now = self.clock()
        with self._lock:
            fleet = self.fleet
            prefills = eligible(fleet, view, role="prefill")
            decodes = eligible(fleet, view, role="decode")
            cap = fleet.max_in_flight
            if cap and fleet.in_flight + 2 > cap:
                taken = f"the fleet has {fleet.in_flight} of {cap} slots taken"
                raise overloaded(fleet, cap, taken)
            return (
                self._pick(self.prefill_policy, prefills, view, now),
                self._pick(self.decode_policy, decodes, view, now),
            )

    def _pick(
        self, policy: Policy, cands: list[Candidate], view: RequestView, now: float
    ) -> Candidate:
        fleet = self.fleet
        role = cands[0].worker.role
        ctx = PlacementContext(
            candidates=cands,
            view=view,
            load=fleet.load,
            weight=fleet.weight,
            rng=self.rng,
            fleet=[c for c in fleet.candidates if c.worker.role == role],
            fleet_version=fleet.version,
            now=now,
        )
        chosen = policy.select(ctx)
        policy.on_placed(chosen, view, now)
        return chosen

    def pd_event(self, kind: str) -> None:
        """Count a PD event: ``request`` or ``bootstrap_failure``."""
        if kind == "request":
            self.metrics.pd_requests.inc()
        elif kind == "bootstrap_failure":
            self.metrics.pd_bootstrap_failures.inc()

    # -- what responses teach ---------------------------------------------------------

    def lookup_targets(self, view: RequestView) -> list[Candidate]:
        """Where to ask for the owner of ``view.state_id`` (a response or a
        conversation): one candidate per origin (healthy first) when this process
        knows no owner, the workers share no state domain and the id was not looked
        up in vain lately."""
        rid = view.state_id
        if not rid:
            return []
        now = self.clock()
        with self._lock:
            if self.affinity.owner(rid, now) is not None:
                return []
            if self.missing.owner(rid, now) is not None:
                return []
            fleet = self.fleet
            workers = configured_for(fleet, view)
            if state_owner_origin(workers) is not None:
                return []
            return self._one_per_origin(workers)

    def remember_missing(self, response_id: str) -> None:
        """No origin holds ``response_id`` (``routing.responses_lookup_ttl_s``)."""
        now = self.clock()
        with self._lock:
            self.missing.remember(response_id, "", now)

    def remember_response(self, response_id: str, origin: str) -> None:
        """Responses affinity: ``response_id`` (a response or a conversation) lives
        on ``origin``."""
        now = self.clock()
        with self._lock:
            self.affinity.remember(response_id, origin, now)

    def count_usage_once(self, response_id: str) -> bool:
        """Whether this process is still to count the usage of the background
        Response ``response_id``: True once (it is remembered as counted then),
        False after (``routing.responses_counted_max`` ids are remembered)."""
        with self._lock:
            return self.counted.first(response_id)

    def completed(self, cand: Candidate, view: RequestView, done: Completion) -> None:
        """A response ended: affinity learns the id of the state object it answered
        (a response, a conversation), the policy hears of it."""
        now = self.clock()
        with self._lock:
            if done.response_id and done.ok:
                self.affinity.remember(done.response_id, cand.origin, now)
            self._policy.on_complete(cand, view, done, now)

    # -- the fleet --------------------------------------------------------------------

    @property
    def workers(self) -> tuple[Worker, ...]:
        return self.fleet.workers

    def get(self, worker_id: str) -> Worker | None:
        return self.fleet.get(worker_id)

    def add(self, worker: Worker) -> None:
        """Add ``worker`` (unverified until probed)."""
        with self._lock:
            self.fleet.add(worker)
            self.states.track(worker, self.clock())
            self._changed()

    def replace(self, worker: Worker) -> bool:
        """New labels, key or TLS options for a worker already in the fleet (same
        id); its state, leases and load carry over."""
        with self._lock:
            old = self.fleet.get(worker.id)
            if old is None or not self.fleet.replace(worker):
                return False
            if is_tracked(old) != is_tracked(worker):
                self.states.track(worker, self.clock())  # another machine: start it afresh
            self.states.refresh(worker.id)
            self.kv_sizes = self.fleet.kv.sizes()
            self._changed()
            return True

    def set_policy(
        self,
        policy: Policy | None,
        *,
        prefill: Policy | None = None,
        decode: Policy | None = None,
    ) -> None:
        """Place with these policies from now on (a reload; None keeps the running
        one); responses in flight end on the new ones too."""
        with self._lock:
            if policy is not None:
                self.policy = policy
            if prefill is not None:
                self.prefill_policy = prefill
            if decode is not None:
                self.decode_policy = decode

    def remove(self, worker_id: str) -> Worker | None:
        """Remove a worker (its running requests still end normally)."""
        with self._lock:
            removed = self.fleet.remove(worker_id)
            if removed is not None:
                self._policy.on_removed(removed)
                self.affinity.forget_origin(removed.origin)
                self.states.forget(worker_id)
                self.kv_sizes = self.fleet.kv.sizes()
                self._changed()
            return removed

    def kv_apply(self, worker_id: str, batches: Sequence[Batch], source: str | None = None) -> bool:
        """KV-event batches of ``worker_id`` into the index (the subscriber calls
        this with at most ``kv.apply_blocks`` blocks at a time). True when the worker's
        publisher had been silent until now (see :meth:`kv_silent`).

        :param source: the publisher they came from: batches of one the worker no
            longer names (its entry was replaced, the old subscriber not stopped
            yet) are dropped, or they would outlive the change in the index."""
        with self._lock:
            worker = self.fleet.get(worker_id)
            if worker is None or (source is not None and worker.kv_events != source):
                return False
            kv, group = self.fleet.kv, self.fleet.kv_group(worker)
            for batch in batches:
                kv.apply(worker_id, batch, group)
            self.kv_sizes = kv.sizes()
            return self.fleet.kv_silence.heard(worker_id, self.clock())

    def kv_silent(self) -> list[str]:
        """The workers whose publishers turned silent just now: requests were
        placed there and ``kv.silence_s`` later no batch had come. Each is dropped
        from the index, so the approximate tree matches it until it publishes
        again (:mod:`meshkit.core.kv_silence` says why)."""
        with self._lock:
            now, fleet = self.clock(), self.fleet
            out = []
            for w in fleet.workers:
                if w.kv_events and fleet.kv.covers(w.id) and fleet.kv_silence.check(w.id, now):
                    fleet.kv.forget(w.id)
                    out.append(w.id)
            if out:
                self.kv_sizes = fleet.kv.sizes()
            return out

    def engine_report(self, worker_id: str, report: EngineLoad | None) -> None:
        """An engine's own load (the probes read it), or None when it gave none."""
        with self._lock:
            self.fleet.report_load(worker_id, report)

    def kv_attach(self, worker_id: str) -> None:
        """The subscriber of ``worker_id`` is connected and caught up."""
        with self._lock:
            worker = self.fleet.get(worker_id)
            if worker is not None:
                self.fleet.kv.attach(worker_id, self.fleet.kv_group(worker))
                self.fleet.kv_silence.heard(worker_id, self.clock())

    def kv_detach(self, worker_id: str) -> None:
        """What ``worker_id`` holds is no longer known (its relays are gone): it is
        matched on the approximate tree until its events come again."""
        with self._lock:
            self.fleet.kv.forget(worker_id)
            self.kv_sizes = self.fleet.kv.sizes()

    def kv_clear(self, worker_id: str) -> None:
        """Forget what ``worker_id`` held (a gap, a restart, a bad payload)."""
        with self._lock:
            self.fleet.kv.clear(worker_id)

    def kv_rows(self) -> tuple[list[tuple[str, int, str]], dict[str, int], int, int]:
        """For the metrics: per worker (url, blocks, :meth:`prefix_match`), entries
        per model group, evicted and unchained counts."""
        with self._lock:
            kv = self.fleet.kv
            rows = [(w.url, kv.blocks_of(w.id), self.prefix_match(w)) for w in self.fleet.workers]
            return rows, kv.group_sizes(), kv.evicted, kv.unchained

    def prefix_match(self, worker: Worker) -> str:
        """How cache_aware matches a worker's prefixes: ``events`` (its own KV
        events), ``approximate`` (this router's tree of what it sent there) or
        ``ring`` (other routers place this router's conversations' turns, so chats go
        where ``prefix_hash`` sends them, alike in every router)."""
        if self.fleet.kv.covers(worker.id):
            return "events"
        policy = self._policy
        if worker.role != "regular" and self._has_pairs():
            policy = self.prefill_policy if worker.role == "prefill" else self.decode_policy
        return "ring" if getattr(policy, "ring_placement", False) else "approximate"

    def learn_models(self, worker_id: str, models: frozenset[str] | None) -> None:
        """What an unlabelled worker's ``GET /v1/models`` listed (the probes call this)."""
        with self._lock:
            if self.fleet.learn(worker_id, models):
                self._changed()

    def set_healthy(self, worker_id: str, healthy: bool) -> None:
        with self._lock:
            self.states.set_manual(worker_id, healthy)

    # -- the lifecycle's state changes (the controller calls these) ---------------------

    def do(self, op: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``op(states, *args, now, **kw)`` under the lock, then wake whoever waits on
        the workers it changed: one check-and-change of the lifecycle (``op`` is a
        method of :class:`~meshkit.core.states.WorkerStates`)."""
        with self._lock:
            try:
                return op(self.states, *args, self.clock(), **kw)
            finally:
                if self.states.changed:
                    self._changed()

    def ask_wake(self, worker_id: str) -> None:
        """An explicit wake (admin): starts one unless the worker is ready or waking.

        :raises LifecycleError: no sleep mode, or a state that cannot be woken."""
        with self._lock:
            if self.do(WorkerStates.wake_asked, worker_id):
                self.on_wake(worker_id)

    # -- reading ----------------------------------------------------------------------

    def describe(self, worker_id: str | None = None) -> list[dict[str, Any]]:
        """Every worker (or the one named) for the admin API: never a credential."""
        with self._lock:
            now = self.clock()
            kv = self.fleet.kv
            rows = []
            for i, w in enumerate(self.fleet.workers):
                if worker_id is None or w.id == worker_id:
                    row = self.states.describe(w, i, now)
                    row["prefix_match"] = self.prefix_match(w)
                    if w.kv_events:
                        row["kv_blocks"] = kv.blocks_of(w.id)
                        row["kv_silent"] = self.fleet.kv_silence.silent(w.id)
                        # Is anything flowing? (None: no batch or subscription yet)
                        heard = self.fleet.kv_silence.heard_at(w.id)
                        row["kv_heard_s"] = None if heard is None else round(now - heard, 3)
                    report = self.fleet.engine.get(w.id)
                    if report is not None:
                        row["engine_load"] = {
                            "running": report.running,
                            "waiting": report.waiting,
                            "kv_cache_usage": report.kv_usage,
                            "other_routers": sum(
                                self.fleet.others.get(c.key, 0) for c in self.fleet.candidates_of(w)
                            ),
                        }
                    rows.append(row)
            return rows

    def loads(self) -> dict[str, int]:
        """In-flight requests per candidate key."""
        with self._lock:
            return dict(self.fleet.load)

    def load_of(self, worker: Worker) -> int:
        with self._lock:
            fleet = self.fleet
            return sum(fleet.load.get(c.key, 0) for c in fleet.candidates_of(worker))

    def total_load(self) -> int:
        with self._lock:
            return sum(self.fleet.load.values())

    def health(self) -> tuple[int, int, int, int]:
        """``(workers, healthy or asleep, of those verified by a probe, in flight)``."""
        with self._lock:
            workers = self.fleet.workers
            states = self.states
            serving = [w for w in workers if states.serving(w)]
            verified = sum(1 for w in serving if w.id not in states.unverified)
            return len(workers), len(serving), verified, self.fleet.in_flight

    def lifecycle_rows(self) -> tuple[list[tuple[str, Any, Any, bool]], dict[str, int]]:
        """What the lifecycle metrics read at scrape time: one row per worker
        ``(url, state, breaker, healthy)`` and the counters."""
        with self._lock:
            states = self.states
            rows = [
                (w.url, m.state, m.breaker, states.health_of(w.id))
                for w in self.fleet.workers
                if (m := states.machines.get(w.id)) is not None
            ]
            leases = states.leases
            counters = {
                "leases": leases.total,
                "wakes": states.wakes_total,
                "sleeps": states.sleeps_total,
                "started": leases.started_total,
                "joined": leases.joined_total,
                "replayed": leases.replayed_total,
            }
        return rows, counters

    # -- waiting ----------------------------------------------------------------------

    def readiness(self, worker_id: str) -> _Readiness:
        return _Readiness(self, worker_id)

    def _changed(self) -> None:
        """(lock) Wake whoever waits on a worker whose state changed."""
        changed = self.states.changed
        if self._sync_waiting:
            self._cond.notify_all()
        if self._async_waiters:
            for wid in changed:
                for loop, fut in self._async_waiters.pop(wid, ()):
                    # A closed loop has nobody waiting any more.
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(_resolve, fut)
        changed.clear()

    def _verdict(
        self, pred: Callable[[], bool | None], deadline: float, poll_s: float | None
    ) -> tuple[bool | None, float]:
        """(lock) ``pred()``'s verdict (False once ``deadline`` passed), else None and
        how long to wait before looking again."""
        r = pred()
        if r is not None:
            return r, 0.0
        remaining = deadline - self.clock()
        if remaining <= 0:
            return False, 0.0
        return None, remaining if poll_s is None else min(remaining, poll_s)

    def wait_sync(
        self, pred: Callable[[], bool | None], deadline: float, *, poll_s: float | None = None
    ) -> bool:
        """Block until ``pred()`` (under the lock) is not None, or ``deadline``."""
        with self._cond:
            while True:
                verdict, wait = self._verdict(pred, deadline, poll_s)
                if verdict is not None:
                    return verdict
                self._sync_waiting += 1
                try:
                    self._cond.wait(wait)
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
        lock = self._lock
        while True:
            with lock:
                verdict, wait = self._verdict(pred, deadline, poll_s)
                if verdict is not None:
                    return verdict
                fut: asyncio.Future[None] = loop.create_future()
                waiter = (loop, fut)
                self._async_waiters.setdefault(worker_id, []).append(waiter)
            try:
                # not wait_for: on 3.11 it drops a cancel that lands with the wake-up
                async with asyncio.timeout(wait):
                    await fut
            except TimeoutError:
                pass
            finally:
                with lock:
                    waiters = self._async_waiters.get(worker_id)
                    if waiters is not None and waiter in waiters:
                        waiters.remove(waiter)
                        if not waiters:
                            del self._async_waiters[worker_id]

    def waiting(self, worker_id: str) -> bool:
        """Whether a coroutine waits on ``worker_id`` (tests, diagnostics)."""
        with self._lock:
            return worker_id in self._async_waiters
