"""
Preparation pool
================

A fixed set of named OS threads (``meshkit-prepare-0`` ... ``meshkit-prepare-N``)
that runs request preparation — JSON parsing of large bodies, chat-template
rendering, tokenization — off the event loop. The Mesh owns one pool; by default it
has half the CPUs (at least one), leaving the other half to I/O.

Jobs are plain callables. Three ways in:

- :meth:`PreparePool.submit` queues a job and returns its :class:`Job` at once;
- :meth:`PreparePool.run` blocks the calling thread (only) until the job settles;
- :meth:`PreparePool.run_async` awaits it without blocking the event loop: the
  worker hands the result over with ``loop.call_soon_threadsafe`` on a future
  (no ``run_in_executor``, no executor threads of the loop).

Admission
---------

At most ``queue_capacity`` jobs wait. One more is refused at once with
:class:`~meshkit.errors.PrepareQueueFull` (503, with a retry hint estimated from
the recent run time and the backlog). A pool that is shut down, or whose worker
thread died, refuses with :class:`~meshkit.errors.PoolUnavailable` (503).

Deadlines
---------

One deadline per job, counted from ``submit``, covers waiting and running:

- a job still queued ``queue_timeout_ms`` after submit is taken out of the queue
  and never runs: :class:`~meshkit.errors.PrepareTimeout` (504);
- a job not finished ``timeout_ms`` after submit answers its caller with
  :class:`~meshkit.errors.PrepareTimeout`; Python cannot stop a thread, so the
  worker finishes the job in the background and the result is thrown away.

Deadlines are enforced by whoever waits (:meth:`Job.result`, :meth:`run`,
:meth:`run_async` arm a timer), by the worker that dequeues an overdue job, and by
:meth:`PreparePool.expire_overdue`, which tests call after advancing a fake clock.
A job that completes before anybody noticed its deadline passed keeps its result:
the work is done, and the deadline exists to bound the wait, not to waste work.

Outcomes
--------

Every accepted job is counted exactly once in :attr:`PreparePool.outcomes`:

``success``
    the callable returned.
``failed``
    the callable raised. The exception reaches the caller unchanged; the error
    metric's reason is the :class:`~meshkit.errors.MeshError` code (mapped to the
    pool's own reasons: ``request_too_large`` → ``too_large``, ...) or ``failed``
    for any other exception.
``timeout``
    a deadline passed first (504).
``cancelled``
    the caller went away (an awaiting task was cancelled — a client disconnect —
    or :meth:`Job.cancel`), or the pool shut down. A job cancelled while queued
    never runs; one cancelled while running finishes in the background unheard.

Shutdown
--------

:meth:`PreparePool.shutdown` stops admission, **cancels the queued jobs** (their
callers get :class:`~meshkit.errors.PoolUnavailable`; they never run), waits up to
``shutdown_grace_ms`` for the running ones, then answers the callers of jobs still
running with :class:`~meshkit.errors.PoolUnavailable` and returns anyway: the
threads are daemons, so one stuck job cannot hold the process.

Health
------

A worker thread that exits for any reason other than shutdown (a
``BaseException`` such as ``SystemExit`` escaping a job, for instance) marks the
pool unhealthy: :attr:`PreparePool.healthy` turns False and new submits raise
:class:`~meshkit.errors.PoolUnavailable`. The job that killed the thread fails
with :class:`~meshkit.errors.PoolUnavailable` (its cause attached). Remaining
threads finish the queue; when the last one is gone, queued jobs are cancelled.
Tests kill a worker on purpose with :meth:`PreparePool.kill_worker_for_testing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Final, Generic, Literal, TypeVar, cast

from prometheus_client import CollectorRegistry

from meshkit.config import PrepareConfig
from meshkit.core.requests import ClientTimeout
from meshkit.errors import (
    MeshError,
    PoolUnavailable,
    PrepareQueueFull,
    PrepareTimeout,
)
from meshkit.metrics import PrepareMetrics

__all__ = [
    "OUTCOMES",
    "Job",
    "JobCancelled",
    "Outcome",
    "PoolConfig",
    "PreparePool",
    "current_worker_index",
    "default_workers",
]

T = TypeVar("T")

Outcome = Literal["success", "timeout", "cancelled", "failed"]
OUTCOMES: Final[tuple[Outcome, ...]] = ("success", "timeout", "cancelled", "failed")

_log = logging.getLogger(__name__)

# A MeshError raised by a job is counted under its code, except the pool's own
# refusals and the 413, which share the reasons the pool itself uses.
_REASON_BY_CODE: Final = {
    "request_too_large": "too_large",
    "prepare_timeout": "timeout",
    "prepare_pool_unavailable": "unavailable",
    "prepare_queue_full": "queue_full",
}

_QUEUED: Final = 0
_RUNNING: Final = 1
_FINISHED: Final = 2  # executed
_SKIPPED: Final = 3  # taken out of the queue without running

_local = threading.local()


def current_worker_index() -> int | None:
    """The index of the pool thread calling this, or ``None`` outside any pool."""
    index: int | None = getattr(_local, "index", None)
    return index


def default_workers() -> int:
    """Half the CPUs this process may run on, at least one."""
    return PrepareConfig().resolved_workers


class JobCancelled(Exception):
    """The job was cancelled by its caller; nobody is left to answer."""


class _WorkerKilled(BaseException):
    """Raised inside a worker by the test hook: an unexpected thread exit."""


#: the pool's sizing and bounds are ``[prepare]``'s (one definition, checked there)
PoolConfig = PrepareConfig


class Job(Generic[T]):
    """One callable submitted to a :class:`PreparePool`."""

    __slots__ = (
        "_callbacks",
        "_event",
        "_exc",
        "_fn",
        "_outcome",
        "_pool",
        "_result",
        "_state",
        "client_deadline",
        "deadline",
        "queue_deadline",
        "submitted_at",
    )

    def __init__(
        self,
        pool: PreparePool,
        fn: Callable[[], T],
        submitted_at: float,
        queue_deadline: float,
        deadline: float,
        client_deadline: float | None = None,
    ) -> None:
        self._pool = pool
        self._fn: Callable[[], T] | None = fn
        self.submitted_at = submitted_at
        #: the client's own bound, when it is the tighter: it then settles the job
        #: with :class:`~meshkit.core.requests.ClientTimeout` ("pool")
        self.client_deadline = client_deadline
        if client_deadline is not None:
            queue_deadline = min(queue_deadline, client_deadline)
            deadline = min(deadline, client_deadline)
        self.queue_deadline = queue_deadline
        self.deadline = deadline
        self._state = _QUEUED
        self._outcome: Outcome | None = None
        self._result: T | None = None
        self._exc: BaseException | None = None
        self._event: threading.Event | None = None
        self._callbacks: list[Callable[[Job[T]], None]] | None = None

    def __repr__(self) -> str:
        state = ("queued", "running", "finished", "skipped")[self._state]
        return f"<Job {state} outcome={self._outcome}>"

    @property
    def outcome(self) -> Outcome | None:
        """How the job settled, or ``None`` while it has not."""
        return self._outcome

    @property
    def started(self) -> bool:
        """Whether a worker took the job (it may still be running)."""
        return self._state in (_RUNNING, _FINISHED)

    def done(self) -> bool:
        """Whether the job settled (its caller has an answer)."""
        return self._outcome is not None

    def cancel(self) -> bool:
        """Give up on the job: a queued job never runs, a running one is unheard.

        Returns True if this call settled the job (outcome ``cancelled``), False if
        it had settled already.
        """
        return self._pool._cancel(self)

    def result(self) -> T:
        """Block this thread until the job settles; return its value or raise."""
        return self._pool._wait(self)

    def add_done_callback(self, callback: Callable[[Job[T]], None]) -> None:
        """Call ``callback(job)`` once the job settles (at once if it has).

        The callback runs in whichever thread settles the job: keep it short and
        hand off (``loop.call_soon_threadsafe``).
        """
        self._pool._add_callback(self, callback)

    def _value(self) -> T:
        if self._exc is not None:
            raise self._exc
        return cast(T, self._result)


_Callbacks = list[tuple[Callable[[Any], None], Job[Any]]]


class PreparePool:
    """A bounded pool of preparation threads (see the module documentation)."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        metrics: PrepareMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """Start the worker threads.

        :param metrics: the collectors to update; by default new ones, registered in
            ``registry`` (itself new by default: one registry per Mesh).
        :param clock: monotonic seconds; tests pass a fake one they advance.
        """
        self.config = config
        if metrics is None:
            metrics = PrepareMetrics(registry, clock=clock)
        self.metrics = metrics
        self._clock = clock
        self._workers = config.resolved_workers
        self._queue_timeout_s = min(config.queue_timeout_ms, config.timeout_ms) / 1000
        self._timeout_s = config.timeout_ms / 1000
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[Job[Any]] = deque()
        self._running: set[Job[Any]] = set()  # executing, whether heard or abandoned
        self._outcomes: Counter[str] = Counter(dict.fromkeys(OUTCOMES, 0))
        self._closing = False
        self._failure: str | None = None
        self._kill_requests = 0
        self._exited = threading.Condition(self._lock)
        self._exited_names: list[str] = []
        self._ewma_run_s = 0.01  # seeds the retry hint before any job ran
        self._threads = [
            threading.Thread(
                target=self._worker_main, args=(i,), name=f"meshkit-prepare-{i}", daemon=True
            )
            for i in range(self._workers)
        ]
        self._live = len(self._threads)
        self.metrics.live_workers.set(self._live)
        for thread in self._threads:
            thread.start()

    # -- state --------------------------------------------------------------------

    @property
    def workers(self) -> int:
        """The number of worker threads the pool started with."""
        return self._workers

    @property
    def healthy(self) -> bool:
        """False once shut down or once a worker thread died."""
        return (
            not self._closing and self._failure is None and all(t.is_alive() for t in self._threads)
        )

    @property
    def failure(self) -> str | None:
        """Why the pool is unhealthy (``None`` while healthy or merely shut down)."""
        return self._failure

    @property
    def outcomes(self) -> Counter[str]:
        """A snapshot of the settled jobs by outcome (all four keys present)."""
        with self._lock:
            return Counter(self._outcomes)

    @property
    def queued(self) -> int:
        """Jobs waiting for a worker."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Jobs a worker is executing (including abandoned ones)."""
        return len(self._running)

    @property
    def live_workers(self) -> int:
        """Worker threads alive."""
        return self._live

    # -- submission ---------------------------------------------------------------

    def submit(self, fn: Callable[[], T], within_s: float | None = None) -> Job[T]:
        """Queue ``fn``; return its :class:`Job` at once.

        ``within_s``: the client's own bound on the whole job (None or ``<= 0``:
        only the pool's). When it fires first the job settles with
        :class:`~meshkit.core.requests.ClientTimeout` ("pool"), as the client's
        library would time out a wait for a connection.

        :raises PrepareQueueFull: (503, with ``retry_after_s``) when
            ``queue_capacity`` jobs already wait.
        :raises PoolUnavailable: (503) after shutdown or a worker death.
        """
        now = self._clock()
        with self._lock:
            if self._closing or self._failure is not None:
                self.metrics.error("unavailable")
                raise PoolUnavailable(self._unavailable_message())
            if len(self._queue) >= self.config.queue_capacity:
                self.metrics.error("queue_full")
                raise PrepareQueueFull(
                    f"the preparation queue is full ({self.config.queue_capacity} jobs wait)",
                    retry_after_s=self._retry_hint_locked(),
                )
            mine = now + within_s if within_s is not None and within_s > 0 else None
            job = Job(self, fn, now, now + self._queue_timeout_s, now + self._timeout_s, mine)
            self._queue.append(job)
            self._gauges_locked()
            self._work.notify()
        return job

    def run(self, fn: Callable[[], T], within_s: float | None = None) -> T:
        """Run ``fn`` in the pool, blocking only the calling thread.

        Called from one of this pool's own threads, ``fn`` runs inline: waiting for
        a sibling could deadlock a saturated pool.

        :raises PrepareTimeout: (504) when the job's deadline passes first.
        """
        if getattr(_local, "pool", None) is self:
            return fn()
        return self._wait(self.submit(fn, within_s))

    async def run_async(self, fn: Callable[[], T], within_s: float | None = None) -> T:
        """Run ``fn`` in the pool and await it without blocking the event loop.

        If the awaiting task is cancelled (the client disconnected) before a worker
        took the job, the job is cancelled and never runs; if it is running, its
        result is discarded. Either way the outcome is ``cancelled``.

        :raises PrepareTimeout: (504) when the job's deadline passes first.
        """
        loop = asyncio.get_running_loop()
        job = self.submit(fn, within_s)
        future: asyncio.Future[T] = loop.create_future()

        def deliver() -> None:
            if future.done():  # the awaiting task was cancelled meanwhile
                return
            try:
                future.set_result(job._value())
            except BaseException as exc:  # the job's own exception, handed over as is
                future.set_exception(exc)

        def on_done(_job: Job[T]) -> None:
            # A closed loop raises RuntimeError: nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver)

        timer: asyncio.TimerHandle | None = None

        def arm() -> None:
            nonlocal timer
            delay = self._next_deadline(job) - self._clock()
            timer = loop.call_later(max(delay, 0.0), on_timer)

        def on_timer() -> None:
            self._fire(self._expire(job))
            if not job.done():
                arm()

        job.add_done_callback(on_done)
        arm()
        try:
            return await future
        except asyncio.CancelledError:
            job.cancel()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    # -- deadlines and cancellation ----------------------------------------------

    def expire_overdue(self) -> int:
        """Settle every job whose deadline passed by the pool's clock; return how many.

        Waiters do this for their own job; call it after advancing a fake clock, or
        periodically when jobs are submitted without anybody waiting on them.
        """
        now = self._clock()
        callbacks: _Callbacks = []
        with self._lock:
            overdue = [j for j in self._queue if now >= j.queue_deadline]
            overdue += [j for j in self._running if j._outcome is None and now >= j.deadline]
            for job in overdue:
                callbacks += self._expire_locked(job, now)
        self._fire(callbacks)
        return len(overdue)

    def _next_deadline(self, job: Job[Any]) -> float:
        return job.queue_deadline if job._state == _QUEUED else job.deadline

    def _expire(self, job: Job[Any]) -> _Callbacks:
        with self._lock:
            return self._expire_locked(job, self._clock())

    def _expire_locked(self, job: Job[Any], now: float) -> _Callbacks:
        if job._outcome is not None:
            return []
        mine = job.client_deadline
        if mine is not None and now >= mine and job._state in (_QUEUED, _RUNNING):
            # The client gave up, as it would on a direct connection: its own timeout,
            # not a 504 of meshkit's.
            if job._state == _QUEUED:
                self._dequeue_locked(job)
            return self._settle_locked(job, "timeout", exc=ClientTimeout("pool"), reason="timeout")
        if job._state == _QUEUED and now >= job.queue_deadline:
            self._dequeue_locked(job)
            return self._settle_locked(
                job,
                "timeout",
                exc=PrepareTimeout(
                    "preparation waited longer than "
                    f"{self._queue_timeout_s * 1000:.0f} ms for a worker"
                ),
                reason="timeout",
            )
        if job._state == _RUNNING and now >= job.deadline:
            return self._settle_locked(
                job,
                "timeout",
                exc=PrepareTimeout(f"preparation took longer than {self.config.timeout_ms} ms"),
                reason="timeout",
            )
        return []

    def _cancel(self, job: Job[Any]) -> bool:
        with self._lock:
            if job._outcome is not None:
                return False
            if job._state == _QUEUED:
                self._dequeue_locked(job)
            callbacks = self._settle_locked(
                job, "cancelled", exc=JobCancelled("cancelled by its caller"), reason="cancelled"
            )
        self._fire(callbacks)
        return True

    def _wait(self, job: Job[T]) -> T:
        while job._outcome is None:
            with self._lock:
                now = self._clock()
                callbacks = self._expire_locked(job, now)
                event: threading.Event | None = None
                if job._outcome is None:
                    if job._event is None:
                        job._event = threading.Event()
                    event = job._event
                    remaining = self._next_deadline(job) - now
            if event is None:
                self._fire(callbacks)
            else:
                # Wakes when the job settles, or at its next deadline to expire it.
                event.wait(max(remaining, 0.0))
        return job._value()

    def _add_callback(self, job: Job[T], callback: Callable[[Job[T]], None]) -> None:
        with self._lock:
            if job._outcome is None:
                if job._callbacks is None:
                    job._callbacks = []
                job._callbacks.append(callback)
                return
        callback(job)

    # -- settling (always under the lock; callbacks fire after it is released) ----

    def _dequeue_locked(self, job: Job[Any]) -> None:
        self._queue.remove(job)
        job._state = _SKIPPED
        job._fn = None
        self._gauges_locked()

    def _settle_locked(
        self,
        job: Job[Any],
        outcome: Outcome,
        *,
        result: Any = None,
        exc: BaseException | None = None,
        reason: str | None = None,
    ) -> _Callbacks:
        if job._outcome is not None:
            return []
        job._outcome = outcome
        job._result = result
        job._exc = exc
        self._outcomes[outcome] += 1
        if reason is not None:
            self.metrics.error(reason)
        if job._event is not None:
            job._event.set()
        callbacks = job._callbacks
        job._callbacks = None
        return [(cb, job) for cb in callbacks] if callbacks else []

    @staticmethod
    def _fire(callbacks: _Callbacks) -> None:
        for callback, job in callbacks:
            try:
                callback(job)
            except Exception:  # a callback's failure must not take a worker down
                _log.exception("prepare job callback failed")

    def _gauges_locked(self) -> None:
        queued = len(self._queue)
        self.metrics.queued_jobs.set(queued)
        self.metrics.dispatched_jobs.set(queued + len(self._running))
        self.metrics.busy_workers.set(len(self._running))

    def _retry_hint_locked(self) -> float:
        backlog = len(self._queue) + len(self._running)
        return max(0.05, self._ewma_run_s * backlog / max(1, self._live))

    def _unavailable_message(self) -> str:
        if self._failure is not None:
            return f"the preparation pool failed: {self._failure}"
        return "the preparation pool is shut down"

    # -- workers -----------------------------------------------------------------

    def _worker_main(self, index: int) -> None:
        _local.index = index
        _local.pool = self
        clean = False
        try:
            self._worker_loop()
            clean = True
        except _WorkerKilled:
            pass
        except BaseException:
            # Logged, not re-raised: the pool reports the death through `healthy`.
            _log.critical("preparation worker %d died", index, exc_info=True)
        finally:
            self._worker_exited(index, clean)

    def _worker_loop(self) -> None:
        metrics = self.metrics
        while True:
            callbacks: _Callbacks = []
            with self._lock:
                while not self._queue and not self._kill_requests:
                    if self._closing:
                        return
                    self._work.wait()
                if self._kill_requests:
                    self._kill_requests -= 1
                    raise _WorkerKilled
                job = self._queue[0]
                now = self._clock()
                if now >= job.queue_deadline:
                    # Overdue before anybody noticed: it never runs.
                    callbacks = self._expire_locked(job, now)
                    overdue = True
                else:
                    overdue = False
                    self._queue.popleft()
                    job._state = _RUNNING
                    self._running.add(job)
                    self._gauges_locked()
            if overdue:
                self._fire(callbacks)
                continue
            metrics.queue_seconds.observe(max(0.0, now - job.submitted_at))
            fn = job._fn
            assert fn is not None  # only cleared once the job finished
            try:
                value = fn()
            except Exception as exc:
                self._finish(job, now, None, exc)
            except BaseException as exc:
                unavailable = PoolUnavailable("a preparation worker died running this job")
                unavailable.__cause__ = exc
                self._finish(job, now, None, unavailable, reason="failed")
                raise
            else:
                self._finish(job, now, value, None)

    def _finish(
        self,
        job: Job[Any],
        started: float,
        value: Any,
        exc: BaseException | None,
        *,
        reason: str | None = None,
    ) -> None:
        ended = self._clock()
        run_s = max(0.0, ended - started)
        self.metrics.run_seconds.observe(run_s)
        with self._lock:
            self._running.discard(job)
            job._state = _FINISHED
            job._fn = None
            self._ewma_run_s += 0.2 * (run_s - self._ewma_run_s)
            self._gauges_locked()
            if exc is None:
                callbacks = self._settle_locked(job, "success", result=value)
            else:
                if reason is None:
                    reason = (
                        _REASON_BY_CODE.get(exc.code, exc.code)
                        if isinstance(exc, MeshError)
                        else "failed"
                    )
                callbacks = self._settle_locked(job, "failed", exc=exc, reason=reason)
        self._fire(callbacks)

    def _worker_exited(self, index: int, clean: bool) -> None:
        callbacks: _Callbacks = []
        with self._lock:
            self._live -= 1
            self.metrics.live_workers.set(self._live)
            if not clean and not self._closing:
                if self._failure is None:
                    self._failure = f"worker meshkit-prepare-{index} exited unexpectedly"
                _log.error("preparation pool unhealthy: %s", self._failure)
            if self._live == 0 and self._queue:
                callbacks = self._drain_locked("no preparation worker is left")
            self._exited_names.append(f"meshkit-prepare-{index}")
            self._exited.notify_all()
        self._fire(callbacks)

    def _drain_locked(self, why: str) -> _Callbacks:
        callbacks: _Callbacks = []
        while self._queue:
            job = self._queue[0]
            self._dequeue_locked(job)
            callbacks += self._settle_locked(
                job, "cancelled", exc=PoolUnavailable(why), reason="unavailable"
            )
        return callbacks

    # -- shutdown ------------------------------------------------------------------

    def shutdown(self, wait: bool = True) -> None:
        """Stop admission, cancel queued jobs, wait ≤ ``shutdown_grace_ms`` for the rest.

        Queued jobs never run: their callers get :class:`PoolUnavailable`. With
        ``wait``, callers of jobs still running after the grace get
        :class:`PoolUnavailable` too, and the method returns (the threads are
        daemons). Idempotent.
        """
        with self._lock:
            self._closing = True
            callbacks = self._drain_locked("the preparation pool is shutting down")
            self._work.notify_all()
        self._fire(callbacks)
        if not wait:
            return
        # Real time on purpose: joining threads happens in real time whatever the
        # pool's clock says.
        end = time.monotonic() + self.config.shutdown_grace_ms / 1000
        for thread in self._threads:
            if thread is threading.current_thread():
                continue
            thread.join(max(0.0, end - time.monotonic()))
        callbacks = []
        with self._lock:
            for job in list(self._running):
                callbacks += self._settle_locked(
                    job,
                    "cancelled",
                    exc=PoolUnavailable("the preparation pool shut down while this job ran"),
                    reason="unavailable",
                )
        self._fire(callbacks)

    def kill_worker_for_testing(self, timeout: float = 10.0) -> str:
        """Test hook: make one idle worker exit as if a ``BaseException`` escaped.

        Returns the name of the thread that died. The pool turns unhealthy.
        """
        with self._lock:
            before = len(self._exited_names)
            self._kill_requests += 1
            self._work.notify()
            if not self._exited.wait_for(lambda: len(self._exited_names) > before, timeout):
                raise TimeoutError("no worker took the kill request")
            name = self._exited_names[before]
        for thread in self._threads:
            if thread.name == name:
                thread.join(timeout)
        return name
