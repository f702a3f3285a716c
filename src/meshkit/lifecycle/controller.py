"""
The lifecycle controller
========================

One :class:`Lifecycle` per :class:`~meshkit.Mesh`: what takes time in a worker's
lifecycle (``docs/lifecycle.md``). Drains wait for leases to end; wakes and sleeps
are calls to the worker, made by the background
:class:`~meshkit.lifecycle.runner.Runner`; probes run on its interval. The state
itself (machines, breakers, leases, the sets placement reads) belongs to the
:class:`~meshkit.router.Router`: the controller holds none and changes it only
through the router's methods, so every check-and-change is one hold of the
router's lock.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshkit.config import LifecycleConfig
    from meshkit.lifecycle.runner import Runner
    from meshkit.router import Router

__all__ = ["Lifecycle"]


class Lifecycle:
    """Drains, wakes, sleeps and probes of one Mesh's workers (see the module docstring)."""

    def __init__(self, router: Router, config: LifecycleConfig) -> None:
        self.router = router
        self.config = config
        self._runner: Runner | None = None
        self._closed = False
        #: the runner was started (or found unnecessary); read per request
        self.started = False
        router.on_wake = self._wake

    # -- wakes and sleeps ---------------------------------------------------------------

    def _wake(self, worker_id: str) -> None:
        """(router lock) The router moved ``worker_id`` to waking: send the one ``/wake_up``."""
        fut = self.runner().submit_wake(worker_id)
        fut.add_done_callback(lambda f: self._wake_not_run(worker_id, f))

    def _wake_not_run(self, worker_id: str, fut: concurrent.futures.Future[bool]) -> None:
        # The runner stopped before performing the wake: do not leave it "waking".
        if fut.cancelled() or fut.exception() is not None:
            self.router.wake_done(worker_id, False)

    def sleep(self, worker_id: str, level: int) -> concurrent.futures.Future[bool]:
        """Put ``worker_id`` to sleep now (``POST /sleep``), unless it holds a lease."""
        return self.runner().submit_sleep(worker_id, level)

    # -- drain --------------------------------------------------------------------------

    def _drain_deadline(self, worker_id: str, timeout_s: float | None) -> float:
        self.router.begin_drain(worker_id)
        wait = self.config.drain_timeout_s if timeout_s is None else timeout_s
        return self.router.clock() + max(0.0, wait)

    def drain(self, worker_id: str, timeout_s: float | None = None) -> bool:
        """Stop placements, wait for the worker's leases to end (bounded)."""
        router = self.router
        deadline = self._drain_deadline(worker_id, timeout_s)
        # A placement counts as activity for a grace period before its lease
        # exists, and that expiry wakes nobody: re-check at that pace.
        grace = router.states.leases.grace_s
        ok = router.wait_sync(lambda: router.drained(worker_id), deadline, poll_s=grace)
        return router.finish_drain(worker_id, ok)

    async def adrain(self, worker_id: str, timeout_s: float | None = None) -> bool:
        router = self.router
        deadline = self._drain_deadline(worker_id, timeout_s)
        grace = router.states.leases.grace_s
        ok = await router.wait_async(
            worker_id, lambda: router.drained(worker_id), deadline, poll_s=grace
        )
        return router.finish_drain(worker_id, ok)

    # -- the runner ---------------------------------------------------------------------

    def runner(self) -> Runner:
        if self._runner is None:
            from meshkit.lifecycle.runner import Runner  # its upstream: imported when needed

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
            or any(w.sleep_mode for w in self.router.workers)
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
