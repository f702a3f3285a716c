"""
The forward flow: placement, retries and failover as one generator
==================================================================

Written once, driven by every adapter, sync or async (the httpx ``auth_flow``
pattern). The flow *yields* an :class:`Attempt` (where to send, which bytes, which
headers, how long to wait first) and *receives* an :class:`AttemptResult`; it
returns the attempt whose response the adapter must relay::

    flow = mesh.forward(view, headers)
    attempt = next(flow)
    while True:
        result = send(attempt)             # adapter I/O
        try:
            attempt = flow.send(result)    # another worker: close this response
        except StopIteration as stop:
            final = stop.value             # relay this response; its lease is live
            break

A connect error, a reset before any response byte, or a retryable status (408,
429, 500, 502, 503, 504, 529) that the worker did not flag ``x-should-retry:
false`` (the server override both SDKs obey: "do not send this again") moves the
request to another eligible worker, with
the same original bytes and that worker's rank and credentials, up to
``max_attempts`` with jittered backoff. Nothing has reached the client at that
point, so the move is invisible. On the last attempt a worker's retryable
*response* is relayed as is (the client's SDK will retry it); a connect error
becomes 502 ``upstream_error`` and a timeout 504 ``upstream_timeout``.

The flow takes a lease on each attempt's worker before yielding it and releases
it itself when it moves on; the returned attempt's lease belongs to the adapter,
which releases it when the response ends or the client leaves.

Admission (``upstream.max_in_flight_per_worker``, ``upstream.max_in_flight``):
placement leaves out workers at their limit, so a retry never goes to a worker
that is full, and refuses with 503 ``overloaded`` when all are. ``Placer.lease``
checks the limits again under the same lock as it takes the slot (another thread
may have taken the last one since placement): that refusal sends the flow back to
placement once. A pool-acquire timeout in the adapter (``Failure.POOL``: no
connection to the worker became free in time) is no fault of the worker: its lease
is released without a verdict, the request may move to another worker, and the
answer, when none can take it, is 503 ``overloaded``, not 502.

Holding for a wake (``docs/lifecycle.md``): when the placer finds only sleeping or waking
workers it raises :class:`WakePending`; the flow then yields a :class:`Hold`
instead of an attempt. The driver waits (without a lease) until the worker is
ready or the deadline passes and sends back ``AttemptResult.held(ready)``; the
flow places again, or answers 503 ``worker_waking``. A request holds at most once.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Generator
from dataclasses import dataclass
from typing import Final, Protocol

from meshkit.core.credentials import request_headers
from meshkit.core.endpoints import Api, Op
from meshkit.core.payload import RankBase, rank_base, with_rank
from meshkit.core.requests import LocalResponse, RequestView, Timeouts
from meshkit.core.workers import Candidate, Tls
from meshkit.errors import (
    MeshError,
    NoAvailableWorkers,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
    UpstreamTlsError,
    WorkerWaking,
)

__all__ = [
    "RETRYABLE_STATUS",
    "Attempt",
    "AttemptResult",
    "Failure",
    "ForwardFlow",
    "Hold",
    "Leaser",
    "LocalResponse",
    "Pair",
    "PairResult",
    "Placer",
    "ReadinessWaiter",
    "RetryPolicy",
    "WakePending",
    "answered",
    "build_attempt",
    "capture",
    "forward_flow",
    "pool_refusal",
]

RETRYABLE_STATUS: Final = frozenset({408, 429, 500, 502, 503, 504, 529})
_NONE: Final[frozenset[str]] = frozenset()
_CREATE_STATE: Final = Op.CREATE_STATE


class Failure(enum.Enum):
    CONNECT = "connect"  # refused, DNS, reset before a response: safe to move
    TIMEOUT = "timeout"  # no response head in time: the worker may be working on it
    PROTOCOL = "protocol"  # garbage instead of an HTTP response
    POOL = "pool"  # no pooled connection became free in time: nothing was sent
    TLS = "tls"  # the TLS handshake failed: nothing was sent; safe to move


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """What happened to one attempt, as far as the response head.

    ``body`` is filled only when the attempt asked for it (``read_body``): the
    fan-out flows read small error and listing bodies to compare or merge them.
    """

    status: int | None = None
    failure: Failure | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes | None = None
    #: the body was longer than the attempt's ``read_limit``: ``body`` is its head
    truncated: bool = False
    #: the answer to a :class:`Hold`: did the worker become ready in time
    ready: bool | None = None

    @classmethod
    def response(cls, status: int) -> AttemptResult:
        return cls(status=status)

    @classmethod
    def held(cls, ready: bool) -> AttemptResult:
        return cls(ready=ready)

    @classmethod
    def failed(cls, failure: Failure) -> AttemptResult:
        return cls(failure=failure)


def no_replay(headers: tuple[tuple[bytes, bytes], ...]) -> bool:
    """The worker flagged its answer ``x-should-retry: false``: relayed, not retried
    elsewhere (PROTOCOLS.md section 5; the SDKs then do not retry it either)."""
    for name, value in headers:
        if name.lower() == b"x-should-retry":
            return value.strip().lower() == b"false"
    return False


#: the results of plain answers, one per status: an AttemptResult is immutable, so
#: every attempt answered with a status shares it (one object less per request)
_ANSWERED: Final[dict[int, AttemptResult]] = {}


def answered(status: int) -> AttemptResult:
    """``AttemptResult(status=status)``, shared."""
    got = _ANSWERED.get(status)
    if got is None:
        got = AttemptResult(status=status)
        if 100 <= status <= 599:  # bounded by the statuses there are
            _ANSWERED[status] = got
    return got


class Lease(Protocol):
    """A claim on one candidate's capacity; released exactly once."""

    candidate: Candidate
    started: float

    def release(self, *, ok: bool, status: int | None = None) -> None:
        """Release with a verdict on the worker (``status``: its answer, if any)."""
        ...

    def abandon(self) -> None:
        """Release without a verdict on the worker (a pool timeout, a client that left)."""
        ...


def pool_refusal() -> Overloaded:
    """The 503 for a ``Failure.POOL``: no pooled connection became free in time."""
    return Overloaded("no connection to a worker became free in time; retry shortly")


class ReadinessWaiter(Protocol):
    """Waits until a held request's worker is ready (the lifecycle implements it).

    ``deadline_s`` is on the mesh's clock. Both return True when the worker became
    ready, False when the deadline passed or the wake failed.
    """

    def wait_sync(self, deadline_s: float) -> bool: ...

    async def wait_async(self, deadline_s: float) -> bool: ...


class WakePending(Exception):
    """Raised by :meth:`Placer.place`: the only eligible workers are asleep or
    waking (a wake is under way); the request may wait for ``worker_id``."""

    def __init__(
        self, worker_id: str, deadline_s: float, waiter: ReadinessWaiter, retry_after_s: float
    ) -> None:
        super().__init__(worker_id)
        self.worker_id = worker_id
        self.deadline_s = deadline_s
        self.waiter = waiter
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Hold:
    """A step of the flow: wait (holding no lease) until ``worker_id`` is ready or
    ``deadline_s`` (mesh clock) passes, then send ``AttemptResult.held(ready)``."""

    worker_id: str
    deadline_s: float
    waiter: ReadinessWaiter


class Leaser(Protocol):
    def lease(self, cand: Candidate, view: RequestView, *, admission: bool = True) -> Lease:
        """A lease on ``cand``; raises :class:`~meshkit.errors.Overloaded` when it is
        (by now) at its admission limit (``admission=False``: not checked)."""
        ...

    @property
    def capture_limit(self) -> int:
        """``bounds.max_captured_body_bytes``: the most of a body :func:`capture` reads."""
        ...


class Placer(Leaser, Protocol):
    def lookup_targets(self, view: RequestView) -> list[Candidate]:
        """Where to ask for the owner of ``view.state_id`` (a response or a
        conversation; one per origin), or nothing when the owner is known or need not be."""
        ...

    def remember_response(self, response_id: str, origin: str) -> None:
        """Responses affinity: the state object ``response_id`` lives on ``origin``."""
        ...

    def remember_missing(self, response_id: str) -> None:
        """No worker holds ``response_id``: do not ask again for a while."""
        ...

    """The stateful side the flow drives (the :class:`~meshkit.router.Router`, under its lock)."""

    def place(self, view: RequestView, *, exclude: frozenset[str], attempt: int) -> Candidate: ...

    def targets(self, view: RequestView) -> list[Candidate]:
        """One candidate per origin that may hold a resource (owner first, healthy first)."""
        ...


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_base_s: float = 0.05
    backoff_max_s: float = 1.0

    def delay(self, retry: int, rng: random.Random) -> float:
        """Jittered exponential backoff before retry number ``retry`` (1-based)."""
        if retry <= 1:
            # The first move goes to another worker: no reason to wait.
            return 0.0
        raw = min(self.backoff_base_s * (2 ** (retry - 2)), self.backoff_max_s)
        return float(raw * (0.5 + rng.random() / 2))


class Attempt:
    """One try: where to send which bytes.

    A plain class made per request (``docs/architecture.md``, "Compiled and
    interpreted": a dataclass's generated ``__init__`` is never compiled).
    """

    __slots__ = (
        "answer",
        "body",
        "candidate",
        "delay_s",
        "headers",
        "history",
        "lease",
        "method",
        "number",
        "probe",
        "read_body",
        "read_limit",
        "timeout",
        "url",
    )

    def __init__(
        self,
        number: int,
        candidate: Candidate,
        lease: Lease,
        method: str,
        url: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        delay_s: float = 0.0,
        history: list[tuple[str, AttemptResult]] | None = None,
        read_body: str = "never",
        probe: bool = False,
        timeout: Timeouts | None = None,
    ) -> None:
        self.number = number
        self.candidate = candidate
        self.lease = lease
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.delay_s = delay_s
        self.history: list[tuple[str, AttemptResult]] = [] if history is None else history
        #: "never", "errors" (non-2xx) or "always": read the body into the result
        #: (set with :func:`capture`, which sets ``read_limit`` too)
        self.read_body = read_body
        #: the most of that body read (a longer one is marked ``truncated``)
        self.read_limit = 0
        #: what to answer with instead of the captured body (a flow rewrote it, as
        #: the PD flow merges logprobs); the returned attempt's worker answered it
        self.answer: LocalResponse | None = None
        #: a question to a worker (where a referenced response lives), never the
        #: answer: a front end that does not send attempts itself (ext-proc) sends these
        self.probe = probe
        #: the client's own timeouts (its request's, :attr:`RequestView.timeout`)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Attempt(number={self.number}, {self.method} {self.url})"

    @property
    def tls(self) -> Tls | None:
        """The worker's TLS settings (None: the defaults)."""
        return self.candidate.worker.tls


@dataclass(slots=True)
class Pair:
    """A step of the flow: send both attempts at once (prefill/decode legs).

    The driver reads the ``prefill`` leg's whole body and sends back a
    :class:`PairResult`: the ``decode`` leg's result with the prefill's beside it.
    """

    prefill: Attempt
    decode: Attempt


@dataclass(frozen=True, slots=True)
class PairResult(AttemptResult):
    prefill: AttemptResult | None = None


ForwardFlow = Generator["Attempt | Hold | Pair", AttemptResult, "Attempt | LocalResponse"]


def _sends_rank(cand: Candidate, api: Api) -> bool:
    if cand.rank is None:
        return False
    # Messages and Responses take the rank only where the worker declares them
    # explicitly: an OpenAI-compatible server may reject unknown fields.
    if api in (Api.MESSAGES, Api.RESPONSES):
        return cand.worker.declares(api)
    return True


def capture(attempt: Attempt, placer: Leaser, when: str = "always") -> Attempt:
    """Have the driver read ``attempt``'s body into its result (``when``: "always"
    or "errors"), at most ``bounds.max_captured_body_bytes`` of it."""
    attempt.read_body = when
    attempt.read_limit = placer.capture_limit
    return attempt


def build_attempt(
    placer: Leaser,
    view: RequestView,
    cand: Candidate,
    client_headers: list[tuple[bytes, bytes]],
    method: str,
    number: int,
    body: bytes,
    rank: int | None = None,
    *,
    admission: bool = True,
) -> Attempt:
    """An attempt on ``cand`` with its credentials, rank header and a fresh lease
    (``admission``: the lease checks the admission limits again)."""
    query = ("?" + view.query) if view.query else ""
    headers = request_headers(client_headers, api_key=cand.worker.api_key, api=view.api, rank=rank)
    return Attempt(
        number=number,
        candidate=cand,
        lease=placer.lease(cand, view, admission=admission),
        method=method,
        url=cand.worker.url + view.match.path + query,
        headers=headers,
        body=body,
        timeout=view.timeout,
    )


def _find_owner(
    placer: Placer,
    view: RequestView,
    client_headers: list[tuple[bytes, bytes]],
    targets: list[Candidate],
) -> Generator[Attempt, AttemptResult, None]:
    """Another process created the referenced response or conversation: ask each
    origin once (``view.state_path``: ``GET /v1/responses/{id}`` or
    ``GET /v1/conversations/{id}``) and remember who has it, so placement goes there.

    :raises UpstreamError: nobody answered that they have it and some origin could
        not be asked (the owner may be down: a conversation never moves silently).
    """
    rid, path = view.state_id, view.state_path
    assert rid is not None
    assert path is not None
    unreachable = False
    for number, cand in enumerate(targets):
        attempt = build_attempt(
            placer, view, cand, client_headers, "GET", number, b"", admission=False
        )
        attempt.url = cand.worker.url + path
        capture(attempt, placer)
        attempt.probe = True
        result = yield attempt
        status = result.status
        if status is None or status >= 500:
            attempt.lease.release(ok=False, status=status)
            unreachable = True
            continue
        attempt.lease.release(ok=True, status=status)
        if status == 200:
            placer.remember_response(rid, cand.origin)
            return
    if unreachable:
        raise UpstreamError(
            "the worker that may hold the referenced response or conversation "
            "could not be asked; retry"
        )
    placer.remember_missing(rid)


def forward_flow(
    placer: Placer,
    view: RequestView,
    client_headers: list[tuple[bytes, bytes]],
    *,
    method: str,
    retry: RetryPolicy,
    rng: random.Random,
) -> ForwardFlow:
    """The flow for one request (see the module docstring)."""
    if view.state_id:
        targets = placer.lookup_targets(view)
        if targets:
            yield from _find_owner(placer, view, client_headers, targets)
    api = view.api
    # A stored object (a conversation) belongs to the server, not to one of its
    # ranks, and its body takes no inference fields.
    ranked = view.match.endpoint.op is not _CREATE_STATE
    base: RankBase | None = None
    tried: set[str] = set()
    history: list[tuple[str, AttemptResult]] = []
    last_error: MeshError | None = None
    # An attempt whose worker answered with a retryable status: relayed as is when
    # no other worker can take the request.
    pending: Attempt | None = None
    pending_status = 0
    held = False
    for number in range(max(1, retry.max_attempts)):
        raced = False
        while True:
            wake: WakePending | None = None
            try:
                cand = placer.place(
                    view, exclude=frozenset(tried) if tried else _NONE, attempt=number
                )
            except MeshError as exc:
                # Whatever stops a retry, a worker's own answer beats meshkit's.
                if pending is not None:
                    return pending
                # After a failed attempt, "nobody else is available" is that
                # failure; "the others are full" is a 503 worth retrying later.
                if (
                    isinstance(exc, NoAvailableWorkers)
                    and not isinstance(exc, Overloaded)
                    and last_error is not None
                ):
                    raise last_error from None
                raise
            except WakePending as exc:
                wake = exc
            if wake is None:
                body = view.body
                rank = cand.rank if ranked and _sends_rank(cand, api) else None
                if rank is not None and view.match.endpoint.has_body and body:
                    if base is None:
                        base = rank_base(body, has_rank=view.has_dp_rank)
                    body = with_rank(base, rank)
                try:
                    attempt = build_attempt(
                        placer, view, cand, client_headers, method, number, body, rank
                    )
                except Overloaded:
                    # The last slot went to another request since placement: place
                    # again (once), now that the fleet shows it.
                    if pending is not None:
                        return pending
                    if raced:
                        raise
                    raced = True
                    continue
                break
            if pending is not None:
                # A worker already answered (retryably): relay that rather than
                # hold (the driver closes a response it is not told to relay).
                return pending
            if held:
                raise WorkerWaking(
                    "the worker is waking up; retry shortly", retry_after_s=wake.retry_after_s
                )
            held = True
            answer = yield Hold(wake.worker_id, wake.deadline_s, wake.waiter)
            if not answer.ready:
                raise WorkerWaking(
                    "the worker is still waking up; retry shortly",
                    retry_after_s=wake.retry_after_s,
                )
        if pending is not None:
            pending.lease.release(ok=False, status=pending_status)
            pending = None
        attempt.delay_s = retry.delay(number, rng)
        attempt.history = history
        result = yield attempt
        last = number + 1 >= retry.max_attempts
        history.append((cand.key, result))
        tried.add(cand.key)
        if result.failure is None:
            status = result.status or 0
            if status not in RETRYABLE_STATUS or last or no_replay(result.headers):
                return attempt
            pending, pending_status = attempt, status
            last_error = None
            continue
        if result.failure is Failure.POOL:
            # Nothing was sent: the worker is busy, not failing.
            attempt.lease.abandon()
            last_error = pool_refusal()
            if last:
                raise last_error
            continue
        attempt.lease.release(ok=False)
        if result.failure is Failure.TIMEOUT:
            # The worker may be running it: do not duplicate the work elsewhere.
            raise UpstreamTimeout("the worker did not answer in time")
        if result.failure is Failure.TLS:
            last_error = UpstreamTlsError(
                "the TLS handshake with the worker failed (check its tls_* settings)"
            )
        else:
            last_error = UpstreamError("the worker could not be reached")
        if last:
            raise last_error
    raise UpstreamError("no attempt left")  # pragma: no cover - the loop returns or raises
