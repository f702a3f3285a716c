"""
Accounting
==========

The books of one response: its stream accountant (time to first token, usage,
error events), the metrics it ends with, what Responses affinity and the policy
learn from it, and the release of its lease, exactly once. The relay
(:mod:`meshkit.core.relay`) decides *when* the books close; this module is what
closing them does.

Reads are not generations. An operation on a stored Response or Conversation
(``GET /v1/responses/{id}``, streamed or not, its cancel, input items, the
Conversations resource calls) is counted in ``mesh_router_requests_total`` and
timed in ``mesh_router_request_duration_seconds``, but observes no time to first
token, and the usage of the Response it answers is not counted again: it was
counted when the Response was created, by whichever router relayed the create.
Except for a Response generated in the background: its create answers
``queued``, without usage, so its tokens are only ever seen by a read. The first
read (or cancel) that finds it ended (``background: true``, status completed,
incomplete, failed or cancelled, with usage) counts them; this process remembers
its id (:class:`CountedResponses`, ``routing.responses_counted_max`` ids) and no
later read counts them again. A background create that is streamed carries its
usage in its terminal event and is counted there, unless a read counted it
first, and remembered the same way.
Another router process does not know what this one counted: a background
Response read through two routers is counted by each (``docs/metrics.md``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Final

from meshkit.core.endpoints import Api
from meshkit.core.forward import Lease
from meshkit.core.pd import PairLease
from meshkit.core.policies.base import Completion
from meshkit.core.relay import Books
from meshkit.core.requests import RequestView
from meshkit.core.streams import StreamAccountant

if TYPE_CHECKING:
    from meshkit.router import Router

__all__ = ["Accounting", "CountedResponses"]

_RESPONSES: Final = Api.RESPONSES


class CountedResponses:
    """The ids of the background Responses whose usage this process counted: the
    ``max_entries`` most recently counted or read (least recently used go first;
    one forgotten is counted again if it is read again).

    Pure and unlocked: the router calls it under its lock.
    """

    __slots__ = ("_ids", "max_entries")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._ids: OrderedDict[str, None] = OrderedDict()

    def first(self, response_id: str) -> bool:
        """True the first time ``response_id`` is given (it is remembered then),
        False while it is remembered."""
        ids = self._ids
        if response_id in ids:
            ids.move_to_end(response_id)
            return False
        ids[response_id] = None
        if len(ids) > self.max_entries:
            ids.popitem(last=False)
        return True

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class Accounting(Books):
    """Follows one relayed response: TTFT, usage, errors; releases its lease once."""

    __slots__ = (
        "_acct",
        "_done",
        "_failed",
        "_rid_pending",
        "_router",
        "attempt_lease",
        "max_event_bytes",
        "status",
        "stopped",
        "view",
    )

    def __init__(self, router: Router, view: RequestView, lease: Lease, status: int) -> None:
        self._router = router
        self.view = view
        self.attempt_lease = lease
        self.status = status
        #: the most of a stream's unfinished event its relay holds back
        self.max_event_bytes = limit = router.config.bounds.max_sse_line_bytes
        self._acct = StreamAccountant(
            view.match.endpoint.stream_format,
            streaming=view.stream and status < 400,
            started_at=lease.started,
            max_line_bytes=limit,
            state_ids=view.match.endpoint.answers_state,
        )
        self._done = False
        # A streamed Response names its id in its first event: remember the owner
        # then, not at the end, so a follow-up can use it while this one streams.
        self._rid_pending = view.stream and view.api is _RESPONSES
        self._failed = False
        #: the stream reported its own failure (an error event): the books closed
        #: there, and the relay ends the client's stream without waiting for more
        self.stopped = False

    @property
    def done(self) -> bool:
        """The books are closed, or the stream already carried its terminal event."""
        return self._done or self._acct.done

    def feed(self, chunk: bytes) -> None:
        if chunk:
            acct = self._acct
            acct.feed(chunk, self._router.clock())
            if self._rid_pending and acct.response_id is not None:
                self._rid_pending = False
                origin = self.attempt_lease.candidate.origin
                self._router.remember_response(acct.response_id, origin)
            if acct.error is not None and not self._done:
                # An engine that reported an error may keep the stream open; the
                # lease (and the worker's load) must not wait for it to close.
                self.stopped = True
                self._close(completed=True)

    def end(self) -> None:
        """The body ended normally."""
        self._close(completed=True)

    def abort(self, *, client_left: bool = True) -> None:
        """The client went away, or the upstream failed mid-body."""
        if client_left and not self._done:
            self._router.metrics.disconnects.inc()
        # The worker failed mid-body: its breaker hears of it (no status = failure).
        self._failed = not client_left
        self._close(completed=False)

    def _close(self, *, completed: bool) -> None:
        if self._done:
            return
        self._done = True
        router = self._router
        now = router.clock()
        acct = self._acct
        if completed:
            acct.finish(now)
        ok = completed and self.status < 400 and acct.error is None
        lease = self.attempt_lease
        lease.release(ok=ok, status=None if self._failed else self.status)
        match = self.view.match
        api = match.endpoint.label
        m = router.metrics
        usage = acct.usage
        ttft = acct.ttft
        rid = acct.response_id
        # An operation on a stored object (a resource id in the path) is a read.
        read = match.endpoint.is_resource
        if read:
            ttft = None  # no generation: its latency is no time to first token
            if usage is not None and not (
                acct.background_ended and rid and router.count_usage_once(rid)
            ):
                usage = None  # counted at its create, or by an earlier read
        elif (
            rid is not None
            and usage is not None
            and acct.background_ended
            and not router.count_usage_once(rid)
        ):
            # A streamed background create, whose books closed after a read's that
            # counted it (the client read it back the moment its stream ended).
            usage = None
        duration = now - lease.started
        if not completed:
            outcome = "cancelled"
        elif acct.error is not None and self.status < 400:
            outcome = "error"  # a 200 whose stream (or body) reported a failure
        else:
            outcome = str(self.status)
        m.series.finished(
            api,
            outcome,
            duration,
            ttft,
            None
            if usage is None
            else (usage.input_tokens, usage.output_tokens, usage.cached_tokens),
        )
        if ttft is not None and isinstance(lease, PairLease):
            m.pd_ttft.observe(ttft)
        if acct.error is not None:
            m.stream_errors.labels(api).inc()
        if acct.overflow:
            m.stream_overflows.labels(api).inc()
        elif usage is None and ok and self.view.stream and not read:
            m.streams_without_usage.labels(api).inc()
        # Nothing to remember and nobody listening: no Completion, no lock.
        if not (rid and ok) and not router.listens:
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
        router.completed(lease.candidate, self.view, done)
