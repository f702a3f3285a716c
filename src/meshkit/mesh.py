"""
The Mesh
========

The object users build and every front end holds: a facade over the
:class:`~meshkit.router.Router` (routing state and its lock), the
:class:`~meshkit.prepare.pipeline.Preparer` (parse, prefix ids, the bounded pool),
the :class:`~meshkit.lifecycle.controller.Lifecycle` (probes, wakes, sleeps,
drains) and the metrics. Front ends call, in order::

    match = mesh.resolve(method, path)                  # None: not ours, pass through
    view = mesh.prepare(match, body, headers, query)    # or await prepare_async(...)
    flow = mesh.forward(view, headers, method)          # the retry/failover generator
    ...                                                 # drive it, relay the response
    acct = mesh.account(view, final_attempt.lease, status)

The admin verbs (add, remove, drain, sleep, wake a worker) are here too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Final

from meshkit.accounting import Accounting
from meshkit.config import MeshConfig
from meshkit.core.credentials import request_headers
from meshkit.core.endpoints import Api, Match, resolve
from meshkit.core.fanout import models_flow, resource_flow
from meshkit.core.forward import Attempt, ForwardFlow, Lease, RetryPolicy, forward_flow
from meshkit.core.pd import pd_flow
from meshkit.core.policies.affinity import ResponsesAffinity
from meshkit.core.policies.base import Policy
from meshkit.core.requests import LocalResponse, RequestView
from meshkit.core.workers import Fleet, Worker
from meshkit.errors import MeshError
from meshkit.lifecycle.controller import Lifecycle
from meshkit.lifecycle.discovery import Discovery
from meshkit.lifecycle.kv import KvSubscribers, require_zmq
from meshkit.metrics import KvCollector, LifecycleCollector, RouterMetrics
from meshkit.prepare.pipeline import Preparer
from meshkit.prepare.pool import PreparePool
from meshkit.prepare.tokenizers import TokenizerRegistry
from meshkit.reload import Reload
from meshkit.router import Router
from meshkit.types import Headers

__all__ = ["Mesh"]

log = logging.getLogger("meshkit.kv")

#: what a request matched on the tree instead of the KV events misses (warned once each)
_UNMATCHED: Final = {
    "no_tokenizer": "a request's model has no tokenizer (set tokenizer or tokenizers to "
    "the model's own)",
    "too_large": "a prompt is over prepare.max_tokenize_bytes",
    "unrendered": "a prompt could not be rendered as the engine renders it",
}

_MODELS: Final = Api.MODELS


def _worker_id(worker: Worker | str) -> str:
    return worker.id if isinstance(worker, Worker) else Worker(worker).id


def _local_flow(local: LocalResponse) -> ForwardFlow:
    return local
    yield  # pragma: no cover - makes this a generator


class _NoLease:
    """Pass-through requests hold no capacity."""

    __slots__ = ("candidate", "started")

    def __init__(self, cand: Any) -> None:
        self.candidate = cand
        self.started = 0.0

    def release(self, *, ok: bool, status: int | None = None) -> None:
        return None

    def abandon(self) -> None:
        return None


class Mesh:
    """Routes inference requests over a fleet of workers.

    :param workers: :class:`Worker` objects, URLs, or worker tables.
    :param policy: a built-in or plugin policy name, or a :class:`Policy` instance.
    :param tokenizer: path to a ``tokenizer.json`` for the default model.
    :param kwargs: the other :class:`~meshkit.config.MeshConfig` keys and sections.

    .. code-block:: python

        mesh = Mesh(workers=[Worker("http://127.0.0.1:8001")], policy="round_robin")
    """

    def __init__(
        self,
        workers: Iterable[Worker | str | Mapping[str, Any]] = (),
        policy: str | Policy = "round_robin",
        tokenizer: str | None = None,
        *,
        config: MeshConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ) -> None:
        if config is None:
            config = MeshConfig.build(
                workers=list(workers), policy=policy, tokenizer=tokenizer, **kwargs
            )
        self.config = config
        self.clock = clock
        self.metrics = RouterMetrics()
        #: the fleet, the policy, worker states and leases, behind one lock
        self.router = Router(config, clock=clock, metrics=self.metrics)
        self.metrics.series.load = self.router.loads
        #: probes, wakes, sleeps, drains; its runner thread starts with the first
        #: request (or start_lifecycle()) and stops with close()
        self.lifecycle = Lifecycle(self.router, config.lifecycle)
        # Before the pool starts: a workers file that does not load fails here.
        self.lifecycle.discovery = Discovery(self.router, self.lifecycle, config)
        if KvSubscribers.wanted(self.router.workers):
            require_zmq()  # a clear start-up error without meshkit[kv]
        pc = config.prepare
        self.pool = PreparePool(pc, registry=self.metrics.registry)
        self.tokenizers = TokenizerRegistry(
            workers_per_tokenizer=pc.workers_per_tokenizer,
            fast_tokenizer=pc.fast_tokenizer,
            prefix_cache_entries=pc.prefix_cache_entries,
        )
        if config.tokenizer:
            self.tokenizers.register(None, config.tokenizer)
        for model, path in config.tokenizers.items():
            self.tokenizers.register(model, path)
        router = self.router
        self.preparer = Preparer(
            config,
            self.pool,
            self.tokenizers,
            router.needs,
            lambda: router.kv_sizes,
            lambda model: router.fleet.kv.root(model),
            self._kv_unmatched,
        )
        self.retry = RetryPolicy(
            max_attempts=max(1, config.upstream.max_attempts),
            backoff_base_s=config.upstream.backoff_base_s,
            backoff_max_s=config.upstream.backoff_max_s,
        )
        #: the flow of a front end that cannot move a request once sent (ext-proc)
        self._one_try = replace(self.retry, max_attempts=1)
        self.metrics.registry.register(LifecycleCollector(router))
        self.metrics.registry.register(KvCollector(router))
        self._legs: ThreadPoolExecutor | None = None
        self._legs_lock = threading.Lock()
        self._closed = False
        self._unmatched_warned: set[str] = set()

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **overrides: Any) -> Mesh:
        """Build a Mesh from a TOML file (see ``examples/meshkit.toml``)."""
        return cls(config=MeshConfig.from_file(path), **overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Mesh:
        """``MESHKIT_CONFIG`` (a TOML path) and/or ``MESHKIT_WORKERS`` (comma list of URLs)."""
        return cls(config=MeshConfig.from_env(environ))

    def __repr__(self) -> str:
        return f"Mesh(workers={len(self.router.workers)}, policy={self.policy.name!r})"

    @property
    def policy(self) -> Policy:
        """The placement policy (it may be replaced at runtime)."""
        return self.router.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.router.policy = policy

    @property
    def fleet(self) -> Fleet:
        """The workers and their load (read-only: change it through the Mesh's methods)."""
        return self.router.fleet

    @property
    def affinity(self) -> ResponsesAffinity:
        return self.router.affinity

    @property
    def workers(self) -> tuple[Worker, ...]:
        return self.router.workers

    # -- the request path ---------------------------------------------------------------

    def resolve(self, method: str, path: str) -> Match | None:
        """The endpoint for a request line; None when meshkit does not own the path."""
        return resolve(method, path)

    def prepare(
        self,
        match: Match,
        body: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        query: str = "",
        within_s: float | None = None,
    ) -> RequestView:
        """Parse and prepare a request, blocking only the calling thread.

        :param within_s: the client's own bound on the wait for the prepare pool and
            the work there (None: ``[prepare]``'s alone).
        :raises ~meshkit.core.requests.ClientTimeout: ("pool") ``within_s`` ran out.
        """
        return self.preparer.prepare(match, body, headers, query, within_s)

    async def prepare_async(
        self,
        match: Match,
        body: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        query: str = "",
        within_s: float | None = None,
    ) -> RequestView:
        """Parse and prepare a request without blocking the event loop (see
        :meth:`prepare`)."""
        return await self.preparer.prepare_async(match, body, headers, query, within_s)

    def forward(
        self,
        view: RequestView,
        headers: Headers,
        method: str = "POST",
        *,
        attempts: int | None = None,
    ) -> ForwardFlow:
        """The flow for a prepared request: forward with retries, fan out, or answer locally.

        :param attempts: at most this many workers (default ``upstream.max_attempts``);
            1 for a front end that cannot move a request once it is sent (ext-proc).
        """
        if not self.lifecycle.started:
            self.lifecycle.start()  # probes and wakes run on their own thread
        if view.local is not None:
            return _local_flow(view.local)
        router = self.router
        ep = view.match.endpoint
        if ep.is_resource:
            return resource_flow(router, view, headers, method=method)
        if ep.api is _MODELS:  # the list, or one model of it
            return models_flow(router, view, headers)
        if router.disaggregated(view):
            return pd_flow(
                router, view, headers, method=method, protocol=router.pd_protocol, rng=router.rng
            )
        retry = self.retry
        if attempts is not None and attempts != retry.max_attempts:
            retry = self._one_try if attempts == 1 else replace(retry, max_attempts=attempts)
        return forward_flow(router, view, headers, method=method, retry=retry, rng=router.rng)

    def pass_through(
        self, method: str, path: str, query: str, headers: Headers, body: bytes
    ) -> Attempt:
        """An attempt that sends a non-inference request to a healthy worker, as is.

        Used by the client transports, whose base URL names no real host.
        """
        cand = self.router.pass_through()
        worker = cand.worker
        return Attempt(
            number=0,
            candidate=cand,
            lease=_NoLease(cand),
            method=method,
            url=worker.url + path + ("?" + query if query else ""),
            headers=request_headers(headers, api_key=worker.api_key, api=_MODELS),
            body=body,
        )

    def account(self, view: RequestView, lease: Lease, status: int) -> Accounting:
        """Accounting for the response of the final attempt."""
        return Accounting(self.router, view, lease, status)

    def account_local(
        self, view: RequestView, attempt: Attempt | None, local: LocalResponse
    ) -> None:
        """Account for a response meshkit built itself (a merged or captured body)."""
        if attempt is not None:
            acct = Accounting(self.router, view, attempt.lease, local.status)
            acct.feed(local.body)
            acct.end()

    def reject(self, error: MeshError) -> None:
        """Count a refusal meshkit answered itself."""
        self.metrics.rejections.labels(error.code).inc()

    def legs(self) -> ThreadPoolExecutor:
        """Threads for the prefill legs of sync callers (bounded; made on first use,
        shut down with the Mesh)."""
        legs = self._legs
        if legs is None:
            with self._legs_lock:
                legs = self._legs
                if legs is None:
                    legs = self._legs = ThreadPoolExecutor(
                        max_workers=self.config.pd.sync_leg_threads,
                        thread_name_prefix="meshkit-pd-leg",
                    )
        return legs

    # -- the fleet ----------------------------------------------------------------------

    def add_worker(self, worker: Worker | str) -> Worker:
        """Add a worker at runtime: ``unverified`` until its first probe (which
        runs at once), or ``ready`` with ``lifecycle.probe = false``."""
        w = Worker(worker) if isinstance(worker, str) else worker
        self.router.add(w)
        self.lifecycle.kick()
        return w

    def remove_worker(
        self, worker: Worker | str, *, timeout_s: float | None = None
    ) -> Worker | None:
        """Drain ``worker`` (up to ``timeout_s``, default ``lifecycle.drain_timeout_s``),
        then remove it. Blocks: from a coroutine use :meth:`aremove_worker`."""
        wid = _worker_id(worker)
        if self.router.get(wid) is not None:
            self.lifecycle.drain(wid, timeout_s)
        return self.router.remove(wid)

    async def aremove_worker(
        self, worker: Worker | str, *, timeout_s: float | None = None
    ) -> Worker | None:
        """:meth:`remove_worker` without blocking the event loop."""
        wid = _worker_id(worker)
        if self.router.get(wid) is not None:
            await self.lifecycle.adrain(wid, timeout_s)
        return self.router.remove(wid)

    def drain(self, worker: Worker | str, timeout_s: float | None = None) -> bool:
        """Stop new placements on ``worker`` and wait for its leases to end.

        :returns: True when drained, False when ``timeout_s`` (default
            ``lifecycle.drain_timeout_s``) passed first. Draining is one-way:
            remove the worker, or add it again, to route to it again.
        """
        return self.lifecycle.drain(_worker_id(worker), timeout_s)

    async def adrain(self, worker: Worker | str, timeout_s: float | None = None) -> bool:
        """:meth:`drain` without blocking the event loop."""
        return await self.lifecycle.adrain(_worker_id(worker), timeout_s)

    def _kv_unmatched(self, reason: str) -> None:
        """(prepare threads) A request KV events could have placed got no block keys:
        counted, and the first of each reason logged."""
        self.router.metrics.kv_unmatched.labels(reason).inc()
        if reason not in self._unmatched_warned:
            self._unmatched_warned.add(reason)
            log.warning(
                "kv events: %s; such requests are matched on the approximate tree "
                '(mesh_kv_unmatched_total{reason="%s"})',
                _UNMATCHED.get(reason, reason),
                reason,
            )

    def _wait_s(self, timeout_s: float | None) -> float:
        return timeout_s if timeout_s is not None else self.config.lifecycle.wake_timeout_s

    def _check_open(self) -> None:
        # The lifecycle thread that sends /sleep and /wake_up is gone: the call
        # would be cancelled (a sleep) or wait its whole timeout for nothing (a wake).
        if self._closed:
            raise RuntimeError("the mesh is closed")

    def _sleep(self, worker: Worker | str, level: int | None) -> Any:
        self._check_open()
        level = level if level is not None else self.config.lifecycle.sleep_level
        return self.lifecycle.sleep(_worker_id(worker), level)

    def sleep(
        self, worker: Worker | str, *, level: int | None = None, timeout_s: float | None = None
    ) -> bool:
        """Put a ``mesh.sleep_mode=vllm`` worker to sleep now (``POST /sleep``).

        :returns: True when it sleeps; False when the call failed.
        :raises ~meshkit.core.lifecycle.LifecycleError: it holds a lease, is not
            ready, or has no sleep mode.
        :raises TimeoutError: ``timeout_s`` (default ``lifecycle.wake_timeout_s``)
            passed first. The sleep goes on: the worker takes no new requests, and
            is asleep once the engine answers (the built-in ``TimeoutError``, which
            ``concurrent.futures.TimeoutError`` is since Python 3.11).
        :raises RuntimeError: the mesh is closed.
        """
        return bool(self._sleep(worker, level).result(self._wait_s(timeout_s)))

    async def asleep(
        self, worker: Worker | str, *, level: int | None = None, timeout_s: float | None = None
    ) -> bool:
        """:meth:`sleep` without blocking the event loop (the same answers and errors)."""
        fut = asyncio.wrap_future(self._sleep(worker, level))
        async with asyncio.timeout(self._wait_s(timeout_s)):  # not wait_for: see Router
            return bool(await fut)

    def wake(self, worker: Worker | str, *, timeout_s: float | None = None) -> bool:
        """Wake a sleeping worker (one ``POST /wake_up``) and wait until it is ready.

        :returns: True when ready; False when the wake failed, or ``timeout_s``
            (default ``lifecycle.wake_timeout_s``) passed first (the wake goes on).
        :raises ~meshkit.core.lifecycle.LifecycleError: no sleep mode, or a state
            that cannot be woken (failed, draining, unverified).
        :raises RuntimeError: the mesh is closed.
        """
        self._check_open()
        wid = _worker_id(worker)
        self.router.ask_wake(wid)
        deadline = self.clock() + self._wait_s(timeout_s)
        return self.router.readiness(wid).wait_sync(deadline)

    async def awake(self, worker: Worker | str, *, timeout_s: float | None = None) -> bool:
        """:meth:`wake` without blocking the event loop."""
        self._check_open()
        wid = _worker_id(worker)
        self.router.ask_wake(wid)
        deadline = self.clock() + self._wait_s(timeout_s)
        return await self.router.readiness(wid).wait_async(deadline)

    def reconfigure(self, config: MeshConfig, *, timeout_s: float = 30.0) -> Reload:
        """Apply a new configuration's workers, ``dns://`` entries, workers file,
        policy and policy options without a restart (``meshkit serve`` does this on
        SIGHUP): workers that left are drained, then removed, in the background.

        :returns: what changed, and the keys that differ but need a restart.
        :raises ConfigError: nothing was changed (a policy or workers file that
            does not load).
        """
        from meshkit.reload import reconfigure

        return reconfigure(self, config, timeout_s=timeout_s)

    def start_lifecycle(self) -> None:
        """Start probing now rather than at the first request."""
        self.lifecycle.start()

    def set_healthy(self, worker: Worker, healthy: bool) -> None:
        """An operator's health verdict, kept apart from (and over) the probes'."""
        self.router.set_healthy(worker.id, healthy)

    def load_of(self, worker: Worker) -> int:
        return self.router.load_of(worker)

    def total_load(self) -> int:
        return self.router.total_load()

    def health(self) -> dict[str, Any]:
        """A summary for health endpoints; no credentials, no failure text.

        ``pool`` is ``"ok"``, ``"failed"`` (a prepare thread died: restart the
        process) or ``"closed"`` (shut down). A sleeping or waking worker counts
        as healthy: a fully idle-slept fleet must stay "ready", or a load balancer
        would never send the request that wakes it. ``verified_workers`` are the
        healthy ones a probe has answered (all of them when probing is off): a
        worker not yet probed is routable, but not a reason to say "ready".
        """
        workers, healthy, verified, in_flight = self.router.health()
        pool = self.pool
        state = "ok" if pool.healthy else ("failed" if pool.failure is not None else "closed")
        return {
            "pool": state,
            "workers": workers,
            "healthy_workers": healthy,
            "verified_workers": verified,
            "in_flight": in_flight,
        }

    # -- shutdown -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the lifecycle thread, the prepare pool (bounded by
        ``prepare.shutdown_grace_ms``) and the PD leg threads."""
        if self._closed:
            return
        self._closed = True
        self.lifecycle.close()
        self.pool.shutdown(wait=True)
        if self._legs is not None:
            self._legs.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
