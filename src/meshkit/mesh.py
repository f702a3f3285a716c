"""
The Mesh
========

The one object every adapter holds: the fleet and its policy, the prepare pool
and tokenizers, Responses affinity, response accounting and metrics. Adapters
call, in order::

    match = mesh.resolve(method, path)          # None: not ours, pass through
    view = mesh.prepare(match, body, headers, query)   # or await prepare_async(...)
    flow = mesh.forward(view, headers, method)  # the retry/failover generator
    ...                                         # drive it, then relay the response
    acct = mesh.account(view, final_attempt, status)
    acct.feed(chunk) ... acct.end() / acct.abort()

State changes (placement, leases, releases) are serialised by one lock, so WSGI
threads, sync transports and an event loop may share a Mesh. Preparation runs
outside the lock: it is pure.

Worker lifecycle (health probes, breakers, sleep/wake, drain, leases keyed by
``Idempotency-Key``; ``docs/lifecycle.md``) lives in :attr:`Mesh.lifecycle`; the
Mesh hands it placement and every lease under the same lock.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from meshkit.config import MeshConfig
from meshkit.core.credentials import request_headers
from meshkit.core.endpoints import Api, Match, Op, resolve
from meshkit.core.fanout import models_flow, resource_flow
from meshkit.core.forward import (
    Attempt,
    ForwardFlow,
    Lease,
    LocalResponse,
    RetryPolicy,
    forward_flow,
)
from meshkit.core.lifecycle import LeaseEntry, LeaseKind, Verdict
from meshkit.core.pd import PairLease, pd_flow
from meshkit.core.placement import admission_refusal, configured_for
from meshkit.core.policies.affinity import ResponsesAffinity
from meshkit.core.policies.base import BasePolicy, Completion, Policy
from meshkit.core.policies.registry import create_policy
from meshkit.core.requests import RequestView, check_media, parse_request
from meshkit.core.streams import StreamAccountant
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import InvalidRequest, MeshError, NoAvailableWorkers, RequestTooLarge
from meshkit.lifecycle.controller import IDEMPOTENCY_KEY, NO_WAIT, Lifecycle
from meshkit.lifecycle.metrics import LifecycleCollector
from meshkit.metrics import RouterMetrics
from meshkit.pd_router import PdRouter
from meshkit.prepare.jobs import detokenize_job, tokenize_job
from meshkit.prepare.pool import PoolConfig, PreparePool
from meshkit.prepare.tokenizers import TokenizerRegistry

__all__ = ["Accounting", "Mesh", "MeshLease"]

Headers = list[tuple[bytes, bytes]]
#: Idempotency-Key values longer than this are ignored (the lease table is bounded).
_MAX_IDEMPOTENCY_KEY = 256
_JSON = ((b"content-type", b"application/json"),)
# Enum members used per request: a module global is read ~4x faster than
# the member's class attribute.
_TOKENIZE, _MODELS, _RESPONSES = Api.TOKENIZE, Api.MODELS, Api.RESPONSES
_SUCCESS, _FAILURE, _JOINED = Verdict.SUCCESS, Verdict.FAILURE, LeaseKind.JOINED
#: request headers prepare reads (besides routing.session_header)
_WANTED_HEADERS = (b"content-type", b"content-encoding", b"idempotency-key", b"x-mesh-wait")


class _Heads:
    """The header values prepare found (raw), for the view."""

    __slots__ = ("idempotency", "session", "wait")

    def __init__(self) -> None:
        self.session: bytes | None = None
        self.idempotency: bytes | None = None
        self.wait: bytes | None = None


def _worker_id(worker: Worker | str) -> str:
    return worker.id if isinstance(worker, Worker) else Worker(worker).id


def _hears_completions(policy: Policy) -> bool:
    """Whether ``policy.on_complete`` may do something (BasePolicy's is a no-op)."""
    return getattr(policy.on_complete, "__func__", None) is not BasePolicy.on_complete


def _local_flow(local: LocalResponse) -> ForwardFlow:
    return local
    yield  # pragma: no cover - makes this a generator


class _NoLease:
    """Pass-through requests hold no capacity."""

    __slots__ = ("candidate", "started")

    def __init__(self, cand: Candidate) -> None:
        self.candidate = cand
        self.started = 0.0

    def release(self, *, ok: bool, status: int | None = None) -> None:
        return None


class MeshLease:
    """A claim on a candidate's capacity, released exactly once.

    It holds one reference to a lifecycle lease (``entry``): requests that join
    a running twin by ``Idempotency-Key`` share that lease, and the capacity is
    given back when the last reference ends. The release is also the request's
    verdict for the worker's circuit breaker.
    """

    __slots__ = ("_mesh", "_released", "candidate", "entry", "started", "weight")

    def __init__(
        self, mesh: Mesh, cand: Candidate, weight: int, started: float, entry: LeaseEntry
    ) -> None:
        self._mesh = mesh
        self.candidate = cand
        self.weight = weight
        self.started = started
        self.entry = entry
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self, *, ok: bool, status: int | None = None) -> None:
        # No status: the attempt failed before an answer (connect, protocol,
        # timeout) or mid-body; a 5xx is a failure too; any other answer is a success.
        if self._released:  # set once, under the lock: no need to take it to see it
            return
        if status is None:
            verdict = _SUCCESS if ok else _FAILURE
        else:
            verdict = _FAILURE if status >= 500 else _SUCCESS
        # _settle inlined: this runs once per request.
        mesh = self._mesh
        now = mesh.clock()
        with mesh._lock:
            if self._released:
                return
            self._released = True
            if mesh.lifecycle.released(self.entry, verdict, now):
                mesh.fleet.release(self.candidate, self.entry.weight, now - self.started)

    def abandon(self) -> None:
        """Release without a verdict on the worker (the client left first)."""
        self._settle(Verdict.NEUTRAL)

    def _settle(self, verdict: Verdict) -> None:
        mesh = self._mesh
        now = mesh.clock()
        with mesh._lock:
            if self._released:
                return
            self._released = True
            if mesh.lifecycle.released(self.entry, verdict, now):
                mesh.fleet.release(self.candidate, self.entry.weight, now - self.started)


class Accounting:
    """Follows one relayed response: TTFT, usage, errors; releases its lease once."""

    __slots__ = (
        "_acct",
        "_done",
        "_failed",
        "_mesh",
        "_rid_pending",
        "attempt_lease",
        "status",
        "view",
    )

    def __init__(self, mesh: Mesh, view: RequestView, lease: Lease, status: int) -> None:
        self._mesh = mesh
        self.view = view
        self.attempt_lease = lease
        self.status = status
        streaming = view.stream and status < 400
        self._acct = StreamAccountant(
            view.match.endpoint.stream_format,
            streaming=streaming,
            started_at=lease.started,
            max_line_bytes=mesh.config.bounds.max_sse_line_bytes,
        )
        self._done = False
        # A streamed Response names its id in its first event: remember the owner
        # then, not at the end, so a follow-up can use it while this one streams.
        self._rid_pending = view.stream and view.api is _RESPONSES
        self._failed = False

    @property
    def accountant(self) -> StreamAccountant:
        return self._acct

    def feed(self, chunk: bytes) -> None:
        if chunk:
            acct = self._acct
            acct.feed(chunk, self._mesh.clock())
            if self._rid_pending and acct.response_id is not None:
                self._rid_pending = False
                self._mesh.remember_response(acct.response_id, self.attempt_lease.candidate.origin)

    def end(self) -> None:
        """The body ended normally."""
        self._close(completed=True)

    def abort(self, *, client_left: bool = True) -> None:
        """The client went away, or the upstream failed mid-body."""
        if client_left and not self._done:
            self._mesh.metrics.disconnects.inc()
        # The worker failed mid-body: its breaker hears of it (no status = failure).
        self._failed = not client_left
        self._close(completed=False)

    def _close(self, *, completed: bool) -> None:
        if self._done:
            return
        self._done = True
        mesh = self._mesh
        now = mesh.clock()
        acct = self._acct
        if completed:
            acct.finish(now)
        ok = completed and self.status < 400 and acct.error is None
        lease = self.attempt_lease
        lease.release(ok=ok, status=None if self._failed else self.status)
        api = self.view.api.value
        m = mesh.metrics
        usage = acct.usage
        ttft = acct.ttft
        duration = now - lease.started
        m.series.finished(
            api,
            str(self.status) if completed else "cancelled",
            duration,
            ttft,
            None
            if usage is None
            else (usage.input_tokens, usage.output_tokens, usage.cached_tokens),
        )
        if ttft is not None and isinstance(lease, PairLease):
            mesh.pd.ttft.observe(ttft)
        if acct.error is not None:
            m.stream_errors.labels(api).inc()
        if acct.overflow:
            m.stream_overflows.labels(api).inc()
        rid = acct.response_id
        # Nothing to remember and nobody listening: no Completion, no lock.
        if not (rid and ok) and not mesh._policy_listens:
            return
        done = Completion(
            status=self.status,
            ok=ok,
            ttft=ttft,
            duration=duration,
            input_tokens=usage.input_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            response_id=rid,
        )
        mesh._completed(lease.candidate, self.view, done, now)


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
        self._lock = threading.RLock()
        seed = config.routing.seed
        self.rng = random.Random(seed)
        up = config.upstream
        self.fleet = Fleet(
            config.workers,
            max_in_flight=up.in_flight_limit,
            max_in_flight_per_worker=up.in_flight_limit_per_worker,
        )
        opts = config.policies.get(config.policy, {}) if isinstance(config.policy, str) else {}
        self.policy = create_policy(config.policy, opts)
        self.affinity = ResponsesAffinity(
            max_entries=config.routing.responses_affinity_max,
            ttl_s=config.routing.responses_affinity_ttl_s,
        )
        self.metrics = RouterMetrics()
        self.metrics.series.load = self._load_snapshot
        pc = config.prepare
        self.pool = PreparePool(
            PoolConfig(
                workers=pc.workers or max(1, (os.cpu_count() or 2) // 2),
                queue_capacity=pc.queue_capacity,
                queue_timeout_ms=pc.queue_timeout_ms,
                timeout_ms=pc.timeout_ms,
                shutdown_grace_ms=pc.shutdown_grace_ms,
                inline_threshold_bytes=pc.inline_threshold_bytes,
                max_tokenize_bytes=pc.max_tokenize_bytes,
                workers_per_tokenizer=pc.workers_per_tokenizer,
            ),
            registry=self.metrics.registry,
        )
        self.tokenizers = TokenizerRegistry(
            workers_per_tokenizer=pc.workers_per_tokenizer, fast_tokenizer=pc.fast_tokenizer
        )
        if config.tokenizer:
            self.tokenizers.register(None, config.tokenizer)
        for model, path in config.tokenizers.items():
            self.tokenizers.register(model, path)
        self.pd = PdRouter(self)
        self.retry = RetryPolicy(
            max_attempts=max(1, config.upstream.max_attempts),
            backoff_base_s=config.upstream.backoff_base_s,
            backoff_max_s=config.upstream.backoff_max_s,
        )
        self._session_header = (
            config.routing.session_header.lower().encode()
            if config.routing.session_header
            else None
        )
        self._header_lens = frozenset(
            len(n) for n in (*_WANTED_HEADERS, self._session_header) if n is not None
        )
        #: lifecycle gate: False for a worker that must not take new requests
        self.admit: Callable[[Worker], bool] | None = None
        self._closed = False
        #: worker states, breakers, leases; its runner thread starts with the first
        #: request (or start_lifecycle()) and stops with close()
        self.lifecycle = Lifecycle(self)
        self.metrics.registry.register(LifecycleCollector(self.lifecycle))

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **overrides: Any) -> Mesh:
        """Build a Mesh from a TOML file (see ``examples/meshkit.toml``)."""
        return cls(config=MeshConfig.from_file(path), **overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Mesh:
        """``MESHKIT_CONFIG`` (a TOML path) and/or ``MESHKIT_WORKERS`` (comma list of URLs)."""
        return cls(config=MeshConfig.from_env(environ))

    def __repr__(self) -> str:
        return f"Mesh(workers={len(self.fleet.workers)}, policy={self.policy.name!r})"

    @property
    def policy(self) -> Policy:
        """The placement policy (it may be replaced at runtime)."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._policy = policy
        #: whether completions must be built for it (read once per request)
        self._policy_listens = _hears_completions(policy)

    # -- the request path -------------------------------------------------------

    def resolve(self, method: str, path: str) -> Match | None:
        """The endpoint for a request line; None when meshkit does not own the path."""
        return resolve(method, path)

    def _needs_pool(self, match: Match, body: bytes) -> bool:
        if match.endpoint.api is _TOKENIZE and self.tokenizers.has_any():
            return True
        return len(body) > self.config.prepare.inline_threshold_bytes

    def _prepare_job(self, match: Match, body: bytes) -> RequestView:
        if match.endpoint.api is _TOKENIZE and self.tokenizers.has_any():
            return self._tokenize_job(match, body)
        view = self._parse(match, body)
        self._prefix(view, fast_only=False)
        return view

    def _parse(self, match: Match, body: bytes) -> RequestView:
        needs = self.policy.needs
        want_text = needs.text or needs.prefix_tokens is not None
        depth = self.config.bounds.max_json_depth
        return parse_request(match, body, want_text=want_text, max_depth=depth)

    def _prefix(self, view: RequestView, *, fast_only: bool) -> bool:
        """The prefix token ids the policy reads, when it reads some.

        :param fast_only: only through tiktoken (``prefix_ids_fast``), as on the
            calling thread: a prefix of a few hundred ids costs tens of µs there,
            less than the hop to a pool thread and back. False when a piece needs
            ``tokenizers`` (slower): then the caller runs this on the pool.
        """
        n = self.policy.needs.prefix_tokens
        if not n or view.token_ids is not None or not view.routing_text:
            return True
        tok = self.tokenizers.get(view.model)
        if tok is None:
            return True
        if len(view.body) > self.config.prepare.max_tokenize_bytes:
            raise RequestTooLarge("the prompt is larger than prepare.max_tokenize_bytes allows")
        if not fast_only:
            view.token_ids = tok.prefix_ids(view.routing_text, n)
            return True
        ids = tok.prefix_ids_fast(view.routing_text, n)
        if ids is None:
            return False
        view.token_ids = ids
        return True

    def _tokenize_job(self, match: Match, body: bytes) -> RequestView:
        """/v1/tokenize and /v1/detokenize answered by the mesh in the vLLM shapes."""
        view = parse_request(match, body, max_depth=self.config.bounds.max_json_depth)
        if self.tokenizers.get(view.model) is None:
            return view  # no tokenizer for this model: a worker answers
        try:
            obj = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            raise InvalidRequest("request body is not valid JSON") from None
        if not isinstance(obj, dict):
            raise InvalidRequest("request body must be a JSON object")
        limit = self.config.prepare.max_tokenize_bytes
        metrics = self.pool.metrics
        if match.endpoint.op is Op.TOKENIZE:
            out = tokenize_job(
                self.tokenizers, view.model, obj, max_tokenize_bytes=limit, metrics=metrics
            )
        else:
            out = detokenize_job(
                self.tokenizers, view.model, obj, max_tokenize_bytes=limit, metrics=metrics
            )
        view.extra["local"] = LocalResponse(200, _JSON, msgspec.json.encode(out))
        return view

    def _read_headers(self, match: Match, headers: Iterable[tuple[bytes, bytes]]) -> _Heads:
        """One pass over the request headers: the media check (415) now, the
        values the view takes later. A name is lower-cased only when its length
        is that of a wanted name (ASGI's are lower-case already, httpx's not)."""
        ctype = cenc = None
        got = _Heads()
        session = self._session_header
        lens = self._header_lens
        for k, v in headers:
            if len(k) not in lens:
                continue
            lk = k.lower()
            if lk == b"content-type":
                ctype = v
            elif lk == b"content-encoding":
                cenc = v
            if lk == session and v:
                got.session = v
                session = None  # the first one counts
            elif lk == b"idempotency-key" and 0 < len(v) <= _MAX_IDEMPOTENCY_KEY:
                got.idempotency = v
            elif lk == b"x-mesh-wait":
                got.wait = v
        ep = match.endpoint
        # The usual JSON content type needs no parsing.
        if (cenc is not None or (ctype is not None and ctype != b"application/json")) and (
            ep.has_body and ep.op is not Op.CANCEL
        ):
            check_media(
                None if ctype is None else ctype.decode("latin-1"),
                None if cenc is None else cenc.decode("latin-1"),
            )
        return got

    def _finish_view(self, view: RequestView, heads: _Heads, query: str) -> RequestView:
        view.query = query
        if heads.session is not None:
            view.routing_key = heads.session.decode("latin-1")
        if heads.idempotency is not None:
            # Scoped by path: the same key on two endpoints is two requests.
            view.extra[IDEMPOTENCY_KEY] = (
                view.match.path + " " + heads.idempotency.decode("latin-1")
            )
        if heads.wait is not None:
            # x-mesh-wait: false: answer 503 worker_waking at once instead of
            # holding the request while a sleeping worker wakes.
            view.extra[NO_WAIT] = heads.wait.strip().lower() in (b"false", b"0", b"no")
        return view

    def prepare(
        self, match: Match, body: bytes, headers: Iterable[tuple[bytes, bytes]], query: str = ""
    ) -> RequestView:
        """Parse and prepare a request, blocking only the calling thread."""
        heads = self._read_headers(match, headers)
        if self._needs_pool(match, body):
            view = self.pool.run(lambda: self._prepare_job(match, body))
        else:
            view = self._parse(match, body)
            if not self._prefix(view, fast_only=True):
                self.pool.run(lambda: self._prefix(view, fast_only=False))
        return self._finish_view(view, heads, query)

    async def prepare_async(
        self, match: Match, body: bytes, headers: Iterable[tuple[bytes, bytes]], query: str = ""
    ) -> RequestView:
        """Parse and prepare a request without blocking the event loop."""
        heads = self._read_headers(match, headers)
        if self._needs_pool(match, body):
            view = await self.pool.run_async(lambda: self._prepare_job(match, body))
        else:
            view = self._parse(match, body)
            if not self._prefix(view, fast_only=True):
                await self.pool.run_async(lambda: self._prefix(view, fast_only=False))
        return self._finish_view(view, heads, query)

    def forward(self, view: RequestView, headers: Headers, method: str = "POST") -> ForwardFlow:
        """The flow for a prepared request: forward with retries, fan out, or answer locally."""
        if not self.lifecycle.started:
            self.lifecycle.start()  # probes and wakes run on their own thread
        local = view.extra.get("local")
        if isinstance(local, LocalResponse):
            return _local_flow(local)
        ep = view.match.endpoint
        if ep.is_resource:
            return resource_flow(self, view, headers, method=method)
        if ep.api is _MODELS:  # the list, or one model of it
            return models_flow(self, view, headers)
        if self.pd.applies(view):
            return pd_flow(
                self.pd, view, headers, method=method, protocol=self.pd.protocol, rng=self.rng
            )
        return forward_flow(self, view, headers, method=method, retry=self.retry, rng=self.rng)

    def pass_through(
        self, method: str, path: str, query: str, headers: Headers, body: bytes
    ) -> Attempt:
        """An attempt that sends a non-inference request to a healthy worker, as is.

        Used by the client transports, whose base URL names no real host.
        """
        with self._lock:
            healthy = [w for w in self.fleet.workers if self.fleet.healthy(w)]
            if not healthy:
                raise NoAvailableWorkers("no healthy worker is available")
            worker = healthy[self.rng.randrange(len(healthy))]
            cand = self.fleet.candidates_of(worker)[0]
        return Attempt(
            number=0,
            candidate=cand,
            lease=_NoLease(cand),
            method=method,
            url=worker.url + path + ("?" + query if query else ""),
            headers=request_headers(headers, api_key=worker.api_key, api=Api.MODELS),
            body=body,
        )

    def targets(self, view: RequestView) -> list[Candidate]:
        """One candidate per origin for fan-out: the known owner only, else healthy first."""
        now = self.clock()
        with self._lock:
            workers = configured_for(self.fleet, view)
            if view.match.resource_id:
                owner = self.affinity.owner(view.match.resource_id, now)
                if owner is not None and any(w.origin == owner for w in workers):
                    workers = [w for w in workers if w.origin == owner]
            by_origin: dict[str, Candidate] = {}
            for w in sorted(workers, key=lambda w: not self.fleet.healthy(w)):
                cands = self.fleet.candidates_of(w)
                if cands and w.origin not in by_origin:
                    by_origin[w.origin] = cands[0]
            return list(by_origin.values())

    def account(self, view: RequestView, lease: Lease, status: int) -> Accounting:
        """Accounting for the response of the final attempt."""
        return Accounting(self, view, lease, status)

    def account_local(
        self, view: RequestView, attempt: Attempt | None, local: LocalResponse
    ) -> None:
        """Account for a response meshkit built itself (a merged or captured body)."""
        if attempt is not None:
            acct = self.account(view, attempt.lease, local.status)
            acct.feed(local.body)
            acct.end()

    def reject(self, error: MeshError) -> None:
        """Count a refusal meshkit answered itself."""
        self.metrics.rejections.labels(error.code).inc()

    # -- Placer (called by the forward flow) ------------------------------------

    def place(self, view: RequestView, *, exclude: frozenset[str], attempt: int) -> Candidate:
        if attempt:
            self.metrics.retries.labels("failover").inc()
        now = self.clock()
        with self._lock:
            owner = None
            if view.previous_response_id:
                owner = self.affinity.owner(view.previous_response_id, now)
            # placement.place() with worker states, breakers, joins and wakes; may
            # raise WakePending (the flow holds the request) or WorkerWaking.
            cand = self.lifecycle.place(
                view, exclude=exclude, attempt=attempt, owner=owner, now=now
            )
            self.policy.on_placed(cand, view, now)
            return cand

    def lease(self, cand: Candidate, view: RequestView, *, admission: bool = True) -> MeshLease:
        """A lease on ``cand`` (its slot is taken).

        :param admission: check the admission limits again, under the lock that
            takes the slot (another thread may have taken the last one since
            placement). False for prefill/decode legs: the pair is admitted when
            placed, and a refused second leg would strand the first.
        :raises Overloaded: ``cand``'s worker, or the fleet, is at its limit.
        """
        now = self.clock()
        fleet = self.fleet
        weight = view.prompt_weight
        with self._lock:
            if admission and fleet.at_limit(cand.worker):
                refusal = admission_refusal(fleet, cand.worker)
                if refusal is not None and not self._breaker_trial(cand):
                    raise refusal
            # Lifecycle.take(), inlined: the lease table keyed by Idempotency-Key.
            entry, kind = self.lifecycle.leases.start(
                cand.worker.id, cand.key, now, key=view.extra.get(IDEMPOTENCY_KEY), weight=weight
            )
            if kind is not _JOINED:  # a join shares its twin's capacity
                fleet.acquire(cand, weight)
        return MeshLease(self, cand, weight, now, entry)

    def _breaker_trial(self, cand: Candidate) -> bool:
        """(lock) Whether ``cand`` carries the one trial request of a half-open
        breaker, already placed: refused, it would never end and the breaker would
        wait for it forever (so it may go at most one over the limit)."""
        wid = cand.worker.id
        lc = self.lifecycle
        if wid not in lc.breaker_dirty:
            return False
        m = lc.machines.get(wid)
        return m is not None and bool(m.trial)

    def remember_response(self, response_id: str, origin: str) -> None:
        """Responses affinity: ``response_id`` lives on ``origin``."""
        now = self.clock()
        with self._lock:
            self.affinity.remember(response_id, origin, now)

    def _load_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.fleet.load)

    def _completed(self, cand: Candidate, view: RequestView, done: Completion, now: float) -> None:
        with self._lock:
            if done.response_id and done.ok:
                self.affinity.remember(done.response_id, cand.origin, now)
            self.policy.on_complete(cand, view, done, now)

    # -- fleet management -------------------------------------------------------

    @property
    def workers(self) -> tuple[Worker, ...]:
        return self.fleet.workers

    def add_worker(self, worker: Worker | str) -> Worker:
        """Add a worker at runtime: ``unverified`` until its first probe (which
        runs at once), or ``ready`` with ``lifecycle.probe = false``."""
        w = Worker(worker) if isinstance(worker, str) else worker
        with self._lock:
            self.fleet.add(w)
            self.lifecycle.track(w, self.clock())
        self.lifecycle.kick()
        return w

    def remove_worker(
        self, worker: Worker | str, *, timeout_s: float | None = None
    ) -> Worker | None:
        """Drain ``worker`` (up to ``timeout_s``, default ``lifecycle.drain_timeout_s``),
        then remove it. Blocks: from a coroutine use :meth:`aremove_worker`."""
        wid = _worker_id(worker)
        if self.fleet.get(wid) is not None:
            self.lifecycle.drain(wid, timeout_s)
        return self._remove(wid)

    async def aremove_worker(
        self, worker: Worker | str, *, timeout_s: float | None = None
    ) -> Worker | None:
        """:meth:`remove_worker` without blocking the event loop."""
        wid = _worker_id(worker)
        if self.fleet.get(wid) is not None:
            await self.lifecycle.adrain(wid, timeout_s)
        return self._remove(wid)

    def _remove(self, wid: str) -> Worker | None:
        with self._lock:
            removed = self.fleet.remove(wid)
            if removed is not None:
                self.policy.on_removed(removed)
                self.affinity.forget_origin(removed.origin)
                self.lifecycle.forget(wid)
        return removed

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

    def sleep(
        self, worker: Worker | str, *, level: int | None = None, timeout_s: float | None = None
    ) -> bool:
        """Put a ``mesh.sleep_mode=vllm`` worker to sleep now (``POST /sleep``).

        :returns: True when it sleeps; False when the call failed.
        :raises ~meshkit.core.lifecycle.LifecycleError: it holds a lease, is not
            ready, or has no sleep mode.
        """
        fut = self.lifecycle.runner().submit_sleep(
            _worker_id(worker), level if level is not None else self.config.lifecycle.sleep_level
        )
        return fut.result(
            timeout_s if timeout_s is not None else self.config.lifecycle.wake_timeout_s
        )

    async def asleep(
        self, worker: Worker | str, *, level: int | None = None, timeout_s: float | None = None
    ) -> bool:
        """:meth:`sleep` without blocking the event loop."""
        fut = self.lifecycle.runner().submit_sleep(
            _worker_id(worker), level if level is not None else self.config.lifecycle.sleep_level
        )
        wait = timeout_s if timeout_s is not None else self.config.lifecycle.wake_timeout_s
        return await asyncio.wait_for(asyncio.wrap_future(fut), wait)

    def wake(self, worker: Worker | str, *, timeout_s: float | None = None) -> bool:
        """Wake a sleeping worker (one ``POST /wake_up``) and wait until it is ready.

        :raises ~meshkit.core.lifecycle.LifecycleError: no sleep mode, or a state
            that cannot be woken (failed, draining, unverified).
        """
        wid = _worker_id(worker)
        lc = self.lifecycle
        with self._lock:
            lc.start_wake(wid)
        wait = timeout_s if timeout_s is not None else self.config.lifecycle.wake_timeout_s
        return lc.readiness(wid).wait_sync(self.clock() + wait)

    async def awake(self, worker: Worker | str, *, timeout_s: float | None = None) -> bool:
        """:meth:`wake` without blocking the event loop."""
        wid = _worker_id(worker)
        lc = self.lifecycle
        with self._lock:
            lc.start_wake(wid)
        wait = timeout_s if timeout_s is not None else self.config.lifecycle.wake_timeout_s
        return await lc.readiness(wid).wait_async(self.clock() + wait)

    def start_lifecycle(self) -> None:
        """Start probing now rather than at the first request."""
        self.lifecycle.start()

    def set_healthy(self, worker: Worker, healthy: bool) -> None:
        """An operator's health verdict, kept apart from (and over) the probes'."""
        with self._lock:
            self.lifecycle.set_manual(worker.id, healthy)

    def load_of(self, worker: Worker) -> int:
        with self._lock:
            return sum(self.fleet.load.get(c.key, 0) for c in self.fleet.candidates_of(worker))

    def total_load(self) -> int:
        with self._lock:
            return sum(self.fleet.load.values())

    def health(self) -> dict[str, Any]:
        """A summary for health endpoints; no credentials, no failure text.

        ``pool`` is ``"ok"``, ``"failed"`` (a prepare thread died: restart the
        process) or ``"closed"`` (shut down).
        """
        with self._lock:
            workers = self.fleet.workers
            # A sleeping or waking worker is out of placement (fleet.unhealthy) but
            # serves after a wake: a fully idle-slept fleet must stay "ready", or a
            # load balancer would never send the request that wakes it.
            lc = self.lifecycle
            healthy = sum(
                1
                for w in workers
                if self.fleet.healthy(w) or (w.id in lc.sleepy and w.id not in lc.manual)
            )
            in_flight = sum(self.fleet.load.values())
        pool = self.pool
        state = "ok" if pool.healthy else ("failed" if pool.failure is not None else "closed")
        return {
            "pool": state,
            "workers": len(workers),
            "healthy_workers": healthy,
            "in_flight": in_flight,
        }

    # -- shutdown ---------------------------------------------------------------

    def close(self) -> None:
        """Stop the prepare pool (bounded by ``prepare.shutdown_grace_ms``)."""
        if self._closed:
            return
        self._closed = True
        self.lifecycle.close()  # the probe/wake/sleep thread
        self.pool.shutdown(wait=True)

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
