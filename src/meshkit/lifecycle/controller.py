"""
The lifecycle controller
========================

One :class:`Lifecycle` per :class:`~meshkit.Mesh`: what takes time in a worker's
lifecycle (``docs/lifecycle.md``). The state itself (machines, breakers, leases,
the sets placement reads) belongs to the :class:`~meshkit.router.Router`; the
controller holds none and changes it only through the router's methods, so every
check-and-change is one hold of the router's lock.

Drains wait for leases to end, on the caller's thread (or coroutine). Everything
else is a call to a worker, made by one daemon thread running its own asyncio loop
and upstream (:func:`~meshkit.upstream.select.async_upstream`):

* health probes: ``GET lifecycle.health_path`` on every tracked worker each
  ``health_interval_s`` (and at once when a worker is added), plus
  ``GET /is_sleeping`` for ``mesh.sleep_mode=vllm`` workers. A failed worker is
  probed like any other, so a restart at the same address rejoins (smg PR #2468).
  The results of a round are applied together;
* wakes: one ``POST /wake_up`` per wake the router starts;
* sleeps: ``POST /sleep?level=N&mode=wait``, after ``idle_sleep_s`` with no lease
  or when asked (admin).

Being its own thread, it serves every embedding the same way: an ASGI app, a WSGI
app, the sync and async client transports. It starts lazily (first request, or
``Mesh.start_lifecycle()``) and stops with ``Mesh.close()``.

Sleeps and wakes of one worker never overlap (one lock per worker): a wake asked
for while a sleep is in flight is sent when the sleep returns. Probes use fresh
connections (nothing is pooled) so a worker restarted on the same port is seen at
once rather than through a dead pooled connection.

Security: the controller sends the worker's own API key (``Authorization:
Bearer``) and nothing from any client; vLLM's sleep endpoints exist only in its dev
mode and must not be reachable by clients, which meshkit never forwards them to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from meshkit.config import UpstreamConfig
from meshkit.core.engine_load import parse_metrics
from meshkit.core.states import WorkerStates
from meshkit.core.workers import Worker
from meshkit.errors import InvalidRequest
from meshkit.lifecycle.kv import KvSubscribers

if TYPE_CHECKING:
    from meshkit.config import LifecycleConfig
    from meshkit.lifecycle.discovery import Discovery
    from meshkit.router import Router
    from meshkit.upstream.base import AsyncUpstream

__all__ = ["Lifecycle", "SleepGate", "Undo", "WakeGate"]

log = logging.getLogger("meshkit.lifecycle")

T = TypeVar("T")


def _copy_outcome(task: asyncio.Future[T], cfut: concurrent.futures.Future[T]) -> None:
    if cfut.done():
        return
    if task.cancelled():
        cfut.cancel()
    elif task.exception() is not None:
        cfut.set_exception(task.exception())
    else:
        cfut.set_result(task.result())


#: Takes an agreement of a :class:`SleepGate` back.
Undo = Callable[[], Awaitable[None]]


class SleepGate(Protocol):
    """The other processes' say on an idle sleep (``meshkit serve --processes``):
    :meth:`agree` asks each to mark the worker asleep, which one that used it within
    ``idle_s`` (or holds a lease on it) refuses. None is a refusal; an agreement is
    answered with what takes it back when the engine did not go to sleep after
    all, so the gate keeps nothing per worker past the one sleep that asked."""

    async def agree(self, worker: Worker, idle_s: float) -> Undo | None: ...


class WakeGate(Protocol):
    """Who wakes an engine when this process is one of many: :meth:`wake` asks the
    one process that wakes engines for the whole gateway; True or False is its
    answer (ready or not), None that it could not be asked (wake it from here)."""

    async def wake(self, worker: Worker) -> bool | None: ...


class Lifecycle:
    """Drains, wakes, sleeps and probes of one Mesh's workers (see the module docstring)."""

    def __init__(self, router: Router, config: LifecycleConfig) -> None:
        self.router = router
        self.config = config
        router.on_wake = self._wake
        #: start() was called (the thread runs, or was not needed); read per request
        self.started = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up = threading.Event()
        self._stopping = False
        self._stop: asyncio.Event | None = None
        self._kick: asyncio.Event | None = None
        self._upstream: AsyncUpstream | None = None
        self._op_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: when each worker's model list was last read (loop time)
        self._models_at: dict[str, float] = {}
        #: (what, worker) a warning was given for (each is said once)
        self._warned: set[tuple[str, str]] = set()
        #: dns:// entries and the workers file (set by the Mesh; runs on this thread)
        self.discovery: Discovery | None = None
        #: the KV-event subscribers of workers that name a publisher
        self.kv = KvSubscribers(router, router.config.kv)
        #: (serve --processes) False in all but one process: one decides idle sleeps
        self.idle_sleeps = True
        #: (serve --processes) asked before an idle sleep; set before start()
        self.sleep_gate: SleepGate | None = None
        #: (serve --processes, all but one process) wakes engines for this one
        self.wake_gate: WakeGate | None = None
        self._gating: set[str] = set()

    # -- thread control (any thread) ---------------------------------------------------

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive() and not self._stopping

    def start(self) -> None:
        """Start the background thread if there is anything for it to do."""
        if self.started:
            return
        self.started = True
        cfg = self.config
        if (
            cfg.probe
            or cfg.idle_sleep_s is not None
            or any(w.sleep_mode for w in self.router.workers)
            or (self.discovery is not None and self.discovery.needed)
            or self.kv.wanted(self.router.workers)
        ):
            self._start_thread()

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None or self._stopping:
                return
            self._thread = threading.Thread(target=self._run, name="meshkit-lifecycle", daemon=True)
            self._thread.start()
        self._up.wait(10.0)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (its calls in flight are cancelled)."""
        with self._lock:
            self._stopping = True
            thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        if thread is not threading.current_thread():
            thread.join(timeout_s)

    def kick(self) -> None:
        """Probe now (a worker was added)."""
        loop, kick = self._loop, self._kick
        if loop is not None and kick is not None and not self._stopping:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(kick.set)
                loop.call_soon_threadsafe(self.kv.poke)

    def submit(self, factory: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run ``factory()`` on the runner's loop; the coroutine is created there,
        so one that never runs (the thread stopped) is never left unawaited."""
        self._start_thread()
        cfut: concurrent.futures.Future[T] = concurrent.futures.Future()
        loop = self._loop

        def launch() -> None:
            if self._stop is None or self._stop.is_set():
                cfut.cancel()
                return
            task = self.spawn(factory())
            task.add_done_callback(lambda t: _copy_outcome(t, cfut))

        if loop is None or self._stopping:
            cfut.cancel()
            return cfut
        try:
            loop.call_soon_threadsafe(launch)
        except RuntimeError:
            cfut.cancel()
        return cfut

    def _wake(self, worker_id: str) -> None:
        """(router lock) The router moved ``worker_id`` to waking: send the one ``/wake_up``."""
        started = False

        async def call() -> bool:
            nonlocal started
            started = True  # from here on _call_wake's finally ends the wake
            return await self._call_wake(worker_id)

        def not_run(_: concurrent.futures.Future[bool]) -> None:
            # The thread stopped before the wake ran: do not leave it "waking". Once
            # it ran, a second end here (it raised, or was cancelled) would end the
            # next wake of the worker instead, which may have begun meanwhile.
            if not started:
                self.router.do(WorkerStates.wake_done, worker_id, False)

        self.submit(call).add_done_callback(not_run)

    def sleep(self, worker_id: str, level: int) -> concurrent.futures.Future[bool]:
        """Put ``worker_id`` to sleep now (``POST /sleep``), unless it holds a lease."""
        return self.submit(lambda: self._sleep(worker_id, level, strict=True))

    # -- drain (on the caller's thread) ---------------------------------------------------

    def _drain_deadline(self, worker_id: str, timeout_s: float | None) -> float:
        self.router.do(WorkerStates.begin_drain, worker_id)
        wait = self.config.drain_timeout_s if timeout_s is None else timeout_s
        return self.router.clock() + max(0.0, wait)

    def _drained(self, worker_id: str) -> bool | None:
        return self.router.do(WorkerStates.drained, worker_id)

    def _finish_drain(self, worker_id: str, drained: bool) -> bool:
        if drained:
            self.router.do(WorkerStates.finish_drain, worker_id)
        return drained

    def drain(self, worker_id: str, timeout_s: float | None = None) -> bool:
        """Stop placements, wait for the worker's leases to end (bounded)."""
        deadline = self._drain_deadline(worker_id, timeout_s)
        # A placement counts as activity for a grace period before its lease
        # exists, and that expiry wakes nobody: re-check at that pace.
        grace = self.router.states.leases.grace_s
        ok = self.router.wait_sync(lambda: self._drained(worker_id), deadline, poll_s=grace)
        return self._finish_drain(worker_id, ok)

    async def adrain(self, worker_id: str, timeout_s: float | None = None) -> bool:
        deadline = self._drain_deadline(worker_id, timeout_s)
        grace = self.router.states.leases.grace_s
        ok = await self.router.wait_async(
            worker_id, lambda: self._drained(worker_id), deadline, poll_s=grace
        )
        return self._finish_drain(worker_id, ok)

    # -- the loop thread -----------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception:  # pragma: no cover - _main handles its own errors
            log.exception("the lifecycle thread stopped on an error")
        finally:
            self._up.set()
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    def spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        """(the loop) Run ``coro`` as a task the thread cancels when it stops."""
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._kick = asyncio.Event()
        if self._stopping:  # stopped before it started
            self._up.set()
            return
        # Nothing pooled (idle_timeout_s=0): every call on a fresh connection, bounded
        # by its own timeout rather than these. No limit on connections in all: a
        # probe round asks each worker once, a wake or sleep holds one per worker,
        # so the fleet bounds them; a shared cap let a round of hung workers (or of
        # long wakes) hold every slot, and the healthy ones' probes timed out queued.
        most = max(self.config.health_timeout_s, self.config.wake_timeout_s)
        up = UpstreamConfig(most, most, pool_limit=0, idle_timeout_s=0)  # connect, read
        from meshkit.upstream.select import async_upstream  # with the thread, not at import

        self._upstream = async_upstream(up)
        try:
            if self.discovery is not None:
                self.spawn(self.discovery.run())
            self.spawn(self.kv.run())
            if self.config.probe:
                self.spawn(self._probe_loop())
            if self.config.idle_sleep_s is not None and self.idle_sleeps:
                self.spawn(self._idle_loop())
            self._up.set()
            await self._stop.wait()
        finally:
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._upstream.aclose()

    def _op_lock(self, worker_id: str) -> asyncio.Lock:
        lock = self._op_locks.get(worker_id)
        if lock is None:
            self._sweep_op_locks()
            lock = self._op_locks[worker_id] = asyncio.Lock()
        return lock

    def _sweep_op_locks(self) -> None:
        """(the loop) Drop the free locks of removed workers (workers come and go:
        run when a lock is made and at each probe round)."""
        locks = self._op_locks
        if locks:
            router = self.router
            for wid in [w for w, lock in locks.items() if not lock.locked()]:
                if router.get(wid) is None:
                    del locks[wid]

    async def _call(
        self, method: str, worker: Worker, path: str, timeout_s: float, limit: int = 0
    ) -> tuple[int, bytes] | None:
        """One call to a worker, its answer read up to ``limit`` bytes (0:
        ``lifecycle.max_probe_bytes``; the rest is not read); None when it could
        not be reached in time."""
        from meshkit.upstream.base import Call, UpstreamFailure  # loaded with the thread

        upstream = self._upstream
        if upstream is None:  # pragma: no cover - only called from tasks of _main
            return None
        key = worker.api_key
        headers = [(b"authorization", b"Bearer " + key.encode("latin-1"))] if key else []
        try:
            async with asyncio.timeout(timeout_s):
                call = Call(method, worker.url + path, headers, tls=worker.tls)
                exchange = await upstream.asend(call)
                try:
                    # A worker is not trusted to be small.
                    return exchange.status, await exchange.read(
                        limit or self.config.max_probe_bytes
                    )
                finally:
                    await exchange.aclose()
        except (InvalidRequest, TimeoutError, ValueError, UpstreamFailure):
            return None

    # -- probes ---------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        assert self._kick is not None
        interval = max(0.01, self.config.health_interval_s)
        while True:
            try:
                await self._probe_round()
            except asyncio.CancelledError:
                raise
            except Exception:  # pragma: no cover - a bug must not stop the probes
                log.exception("lifecycle probe round failed")
            # not wait_for: on 3.11 it drops a cancel that lands with the wake-up
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._kick.wait()
            self._kick.clear()

    async def _probe_round(self) -> None:
        self._sweep_op_locks()
        targets = self.router.do(WorkerStates.probe_targets)
        if not targets:
            return
        results = await asyncio.gather(*(self._probe(w) for w, _ in targets))
        self.router.do(
            WorkerStates.probed,
            [
                (w, epoch, ok, sleeping)
                for (w, epoch), (ok, sleeping) in zip(targets, results, strict=True)
            ],
        )

    async def _probe(self, worker: Worker) -> tuple[bool, bool | None]:
        cfg = self.config
        path = cfg.health_path if cfg.health_path.startswith("/") else "/" + cfg.health_path
        res = await self._call("GET", worker, path, cfg.health_timeout_s)
        ok = res is not None and 200 <= res[0] < 300
        sleeping = None
        if ok and worker.sleep_mode == "vllm":
            rep = await self._call("GET", worker, "/is_sleeping", cfg.health_timeout_s)
            if rep is not None and rep[0] == 200:
                try:
                    obj = json.loads(rep[1])
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and isinstance(obj.get("is_sleeping"), bool):
                    sleeping = obj["is_sleeping"]
        if ok and worker.models is None and sleeping is not True and self._models_due(worker):
            await self._learn_models(worker)
        if cfg.engine_metrics_path:
            await self._read_load(worker, ok and sleeping is not True)
        return ok, sleeping

    async def _read_load(self, worker: Worker, up: bool) -> None:
        """The engine's own load (all routers' requests), for placement."""
        report = None
        if up:
            cfg = self.config
            path = cfg.engine_metrics_path
            path = path if path.startswith("/") else "/" + path
            limit = cfg.max_metrics_bytes
            res = await self._call("GET", worker, path, cfg.health_timeout_s, limit=limit + 1)
            if res is not None and res[0] == 200:
                if len(res[1]) <= limit:
                    report = parse_metrics(res[1])
                else:  # a cut text may end inside a gauge's value: no load, not a wrong one
                    self._warn_once(
                        "metrics",
                        worker,
                        "the metrics of %s are over lifecycle.max_metrics_bytes (%d bytes); "
                        "its engine load is not read",
                        limit,
                    )
        self.router.engine_report(worker.id, report)

    def _warn_once(self, what: str, worker: Worker, message: str, *args: object) -> None:
        """Log ``message % (worker.url, *args)`` the first time only: a bound a
        worker's answer passes is passed again at every read."""
        key = (what, worker.id)
        if key in self._warned:
            return
        if len(self._warned) >= self.config.max_tracked_workers:
            self._warned.clear()
        self._warned.add(key)
        log.warning(message, worker.url, *args)

    def _models_due(self, worker: Worker) -> bool:
        """At the first good probe, then every ``models_interval_s``: lists change
        when an adapter loads, not every probe, and each read costs the engine."""
        every = self.config.models_interval_s
        if every <= 0:
            return False
        now = asyncio.get_running_loop().time()
        last = self._models_at.get(worker.id)
        if last is not None and now - last < every:
            return False
        if len(self._models_at) >= self.config.max_tracked_workers and last is None:
            self._models_at.clear()  # workers come and go: bounded, re-read once
        self._models_at[worker.id] = now
        return True

    async def _learn_models(self, worker: Worker) -> None:
        """An unlabelled worker's models, from its own list (vLLM lists its LoRA
        adapters there too): requests for a model are then placed among the
        workers that serve it. A worker that does not answer keeps what it had."""
        limit = self.router.capture_limit
        res = await self._call(
            "GET", worker, "/v1/models", self.config.health_timeout_s, limit=limit + 1
        )
        if res is None or res[0] != 200:
            return
        if len(res[1]) > limit:
            # Part of a list is not the list: the models it would leave out would be
            # refused on this worker. Unknown instead: the engine decides.
            self._warn_once(
                "models",
                worker,
                "the model list of %s is over bounds.max_captured_body_bytes (%d bytes); "
                "its models are not known",
                limit,
            )
            self.router.learn_models(worker.id, None)
            return
        try:
            data = json.loads(res[1]).get("data")
        except (ValueError, AttributeError):
            return
        if not isinstance(data, list):
            return
        most = self.config.max_models_per_worker
        if len(data) > most:
            self._warn_once(
                "models",
                worker,
                "%s lists %d models, over lifecycle.max_models_per_worker (%d); "
                "its models are not known",
                len(data),
                most,
            )
            self.router.learn_models(worker.id, None)
            return
        ids = [m.get("id") for m in data if isinstance(m, dict)]
        self.router.learn_models(
            worker.id, frozenset(i for i in ids if isinstance(i, str) and 0 < len(i) <= 512)
        )

    # -- wake and sleep -------------------------------------------------------------------

    async def _call_wake(self, worker_id: str) -> bool:
        ok = False
        try:
            async with self._op_lock(worker_id):
                worker = self.router.do(WorkerStates.wake_target, worker_id)
                if worker is None:
                    return False
                gate = self.wake_gate
                answer = await gate.wake(worker) if gate is not None else None
                if answer is not None:
                    ok = answer  # woken (or not) once, by the process that wakes engines
                    return ok
                self.router.do(WorkerStates.wake_called, worker_id)
                res = await self._call("POST", worker, "/wake_up", self.config.wake_timeout_s)
                ok = res is not None and 200 <= res[0] < 300
                if not ok:
                    log.warning("waking %s failed", worker.url)
                return ok
        finally:
            self.router.do(WorkerStates.wake_done, worker_id, ok)

    async def _sleep(self, worker_id: str, level: int, *, strict: bool) -> bool:
        async with self._op_lock(worker_id):
            worker = self.router.do(WorkerStates.begin_sleep, worker_id, strict=strict)
            if worker is None:
                return False
            ok = False
            try:
                path = f"/sleep?level={int(level)}&mode=wait"
                res = await self._call("POST", worker, path, self.config.wake_timeout_s)
                ok = res is not None and 200 <= res[0] < 300
                if not ok:
                    log.warning("putting %s to sleep failed", worker.url)
                return ok
            finally:
                self.router.do(WorkerStates.sleep_done, worker_id, ok)

    async def _idle_loop(self) -> None:
        idle_s = self.config.idle_sleep_s or 0.0
        period = min(max(idle_s / 4, 0.01), 1.0)
        level = self.config.sleep_level
        while True:
            await asyncio.sleep(period)
            try:
                for wid in self.router.do(WorkerStates.idle_candidates):
                    if wid not in self._gating:
                        self.spawn(self._idle_sleep(wid, level, idle_s))
            except Exception:  # pragma: no cover - a bug must not stop the loop
                log.exception("lifecycle idle check failed")

    async def _idle_sleep(self, worker_id: str, level: int, idle_s: float) -> None:
        gate = self.sleep_gate
        worker = self.router.get(worker_id)
        if gate is None or worker is None:
            await self._sleep(worker_id, level, strict=False)
            return
        self._gating.add(worker_id)
        try:
            undo = await gate.agree(worker, idle_s)
            if undo is None:
                return  # another process used it lately, or could not be asked
            if not await self._sleep(worker_id, level, strict=False):
                await undo()
        finally:
            self._gating.discard(worker_id)
