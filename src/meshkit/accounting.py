"""
Accounting
==========

The books of one response: its stream accountant (time to first token, usage,
error events), the metrics it ends with, what Responses affinity and the policy
learn from it, and the release of its lease, exactly once. The relay
(:mod:`meshkit.core.relay`) decides *when* the books close; this module is what
closing them does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit.core.endpoints import Api
from meshkit.core.forward import Lease
from meshkit.core.pd import PairLease
from meshkit.core.policies.base import Completion
from meshkit.core.requests import RequestView
from meshkit.core.streams import StreamAccountant

if TYPE_CHECKING:
    from meshkit.router import Router

__all__ = ["Accounting"]

_RESPONSES = Api.RESPONSES


class Accounting:
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
        api = self.view.match.endpoint.label
        m = router.metrics
        usage = acct.usage
        ttft = acct.ttft
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
        elif usage is None and ok and self.view.stream:
            m.streams_without_usage.labels(api).inc()
        rid = acct.response_id
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
