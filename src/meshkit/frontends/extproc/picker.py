"""
The endpoint picker of one request
==================================

:class:`Picker` is what ``meshkit extproc`` does with one Envoy ext_proc stream,
in plain Python types (the protobuf side is :mod:`meshkit.frontends.extproc.wire`).
It takes the same steps as every other mode, with Envoy carrying the bytes:

1. **Decide** once the request is whole (its headers with end of stream, or its
   body's end): ``mesh.resolve``, ``mesh.prepare_async`` and ``mesh.forward`` with
   one attempt (Envoy's ORIGINAL_DST cluster sends to one endpoint and cannot
   move the request to another), a wake hold included. The answer is a
   :class:`Route` (the worker's ``IP:port``, the credential and rank header edits,
   the body when the DP-rank append changed it) or an :class:`Answer` (status,
   headers and body exactly as the HTTP modes answer).
2. **Keep the books from the response side**: the response headers give the status
   (the flow's result, so the breaker and the policy hear of it), the response
   body goes through the same :class:`~meshkit.core.relay.Relay` as in every mode
   (TTFT, usage, error events that end the stream, the lease held until the end).
3. **Close**: the gRPC stream ended, with or without the response's end (a client
   that left): everything still held is released, once.

Not inference (``mesh.resolve`` gives None): the request goes to a healthy worker
as it is, like the client transports' pass-through. ``GET /v1/models`` is answered
here, the union of the workers' lists as in the HTTP modes. Responses and
Conversations resource operations and prefill/decode pairs need meshkit to call
workers itself: 501 ``unsupported_in_ext_proc``. The lookup of a referenced
response or conversation that this process did not place is meshkit's own
question to the workers (probe attempts), asked before Envoy gets the route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from meshkit.accounting import Accounting
from meshkit.core.credentials import header_changes
from meshkit.core.endpoints import Api, Match, shape_for_path
from meshkit.core.forward import Attempt, AttemptResult, Failure, ForwardFlow, Hold
from meshkit.core.relay import Relay
from meshkit.core.requests import RequestView, check_declared, head_error
from meshkit.errors import (
    ErrorShape,
    MeshError,
    NoAvailableWorkers,
    Overloaded,
    PrepareQueueFull,
    UnsupportedInExtProc,
    UpstreamError,
    body_over,
)
from meshkit.frontends.routed import error_reply
from meshkit.mesh import Mesh
from meshkit.types import Headers
from meshkit.upstream.base import AsyncExchange
from meshkit.upstream.drive import Answered, drive_async, leg_steps, run_async

__all__ = ["DESTINATION", "Answer", "Picker", "Route"]

#: the header (and ``envoy.lb`` metadata key) that names the chosen endpoint (GIE)
DESTINATION = b"x-gateway-destination-endpoint"

#: what Envoy adds to every request: not the client's, so not held to its bounds
_PROXY_ADDED = frozenset({b"x-request-id", b"x-forwarded-proto", b"x-envoy-expected-rq-timeout-ms"})

Resolve = Callable[[str, int], Awaitable[str]]
Send = Callable[[Attempt], Awaitable[AsyncExchange]]


@dataclass(slots=True)
class Route:
    """Send the request to ``endpoint`` (``IP:port``) with these header edits."""

    endpoint: str
    set_headers: Headers
    remove_headers: list[bytes] = field(default_factory=list)
    #: the body to send instead of the client's (the DP-rank append); None: as is
    body: bytes | None = None


@dataclass(slots=True)
class Answer:
    """Answer the client at once (an Envoy ``ImmediateResponse``): a refusal, or a
    response meshkit builds itself."""

    status: int
    headers: Headers
    body: bytes


class Picker:
    """One request's placement and books (see the module docstring)."""

    def __init__(self, mesh: Mesh, resolve: Resolve, send: Send) -> None:
        self.mesh = mesh
        self._resolve = resolve
        self._send = send
        self.max_body = mesh.config.bounds.max_body_bytes
        self.method = "GET"
        self.path = "/"
        self.query = ""
        self.headers: Headers = []
        self._body = bytearray()
        self.match: Match | None = None
        self._shape: ErrorShape = "openai"
        self.view: RequestView | None = None
        self._flow: ForwardFlow | None = None
        self.attempt: Attempt | None = None
        self.relay: Relay | None = None
        self.closed = False
        #: the proxy's subset hint: the endpoints (``IP:port``) it may go to; None: any
        self.subset: list[str] | None = None

    @property
    def body(self) -> bytes:
        """The request body as the client sent it."""
        return bytes(self._body)

    # -- the request ----------------------------------------------------------------

    def request_headers(self, headers: Headers) -> Answer | None:
        """The request head (pseudo-headers included); a refusal when it is bad."""
        kept: Headers = []
        target = b"/"
        lines = 0  # the head as an HTTP/1.1 client wrote it: ``:authority`` is ``host``
        for k, v in headers:
            if k == b":method":
                self.method = v.decode("latin-1")
            elif k == b":path":
                target = v
            elif k == b":authority":
                lines += 4 + len(v) + 4
            elif not k.startswith(b":"):
                kept.append((k, v))
                if k not in _PROXY_ADDED:
                    lines += len(k) + len(v) + 4
        self.headers = kept
        path, _, query = target.decode("latin-1").partition("?")
        self.path, self.query = path, query
        # A refusal before the endpoint is known (404, 405) is in the shape of the
        # API the path belongs to, as the HTTP modes answer it (Anthropic's under
        # /v1/messages).
        self._shape = shape_for_path(path)
        try:
            match = self.match = self.mesh.resolve(self.method, path)
            if match is not None:
                self._shape = match.endpoint.shape
                bounds = self.mesh.config.bounds
                count = 1 + sum(k not in _PROXY_ADDED for k, _ in kept)  # 1: host
                error = head_error(
                    count, lines, max_bytes=bounds.max_header_bytes, max_count=bounds.max_headers
                )
                if error is not None:
                    raise error
                check_declared(kept, self.max_body)
        except MeshError as exc:
            return self._refuse(exc)
        return None

    def request_body(self, chunk: bytes) -> Answer | None:
        """A chunk of the request body (bounded by ``bounds.max_body_bytes``)."""
        if len(self._body) + len(chunk) > self.max_body:
            return self._refuse(body_over(self.max_body))
        self._body += chunk
        return None

    async def decide(self) -> Route | Answer:
        """The request is whole: where it goes, or the answer."""
        try:
            return await self._decide()
        except MeshError as exc:
            return self._refuse(exc)

    async def _decide(self) -> Route | Answer:
        mesh = self.mesh
        match = self.match
        if match is None:
            return await self._pass_through()
        ep = match.endpoint
        if ep.is_resource:
            raise UnsupportedInExtProc(
                "Responses and Conversations resource operations need a direct "
                "connection to the worker; send them to meshkit serve or a worker"
            )
        body = bytes(self._body)
        view = self.view = await mesh.prepare_async(match, body, self.headers, self.query)
        if self.subset is not None:
            view.only = await self._allowed(self.subset)
        if view.local is None and ep.api is not Api.MODELS and mesh.router.disaggregated(view):
            raise UnsupportedInExtProc("prefill/decode disaggregation needs meshkit serve")
        flow = mesh.forward(view, self.headers, self.method, attempts=1)
        if view.local is not None or ep.api is Api.MODELS:
            return await self._answer_here(flow)
        self._flow = flow
        step = next(flow)
        while isinstance(step, Hold) or (isinstance(step, Attempt) and step.probe):
            if isinstance(step, Hold):
                ready = await step.waiter.wait_async(step.deadline_s)
                step = flow.send(AttemptResult.held(ready))
            else:  # where a referenced response or conversation lives: asked by meshkit
                try:
                    asked = await run_async(leg_steps(step), self._send)
                except BaseException:
                    step.lease.abandon()  # Envoy reset the stream meanwhile (a cancel)
                    raise
                step = flow.send(asked)
        if not isinstance(step, Attempt):  # pragma: no cover - pairs are refused above
            raise UpstreamError("no single worker for this request")
        self.attempt = step
        worker = step.candidate.worker
        try:
            endpoint = await self._resolve(worker.host, worker.port)
        except OSError:
            self._settle_flow(AttemptResult.failed(Failure.CONNECT))
            raise UpstreamError("the worker's host name did not resolve") from None
        sets, removes = header_changes(
            self.headers, api_key=worker.api_key, api=view.api, rank=_rank_of(step)
        )
        sets = [*sets, *_path_edit(step, self.path, self.query)]
        changed = None if step.body is view.body else step.body
        return Route(endpoint, sets, removes, changed)

    async def _allowed(self, subset: list[str]) -> frozenset[str]:
        """The workers at the endpoints of the proxy's subset hint (GIE: none of them
        eligible, or an empty list, is a 503)."""
        wanted = set(subset)
        ids = set()
        for w in self.mesh.workers:
            try:
                if await self._resolve(w.host, w.port) in wanted:
                    ids.add(w.id)
            except OSError:
                continue
        if not ids:
            raise NoAvailableWorkers(
                "none of the endpoints the proxy allows is a worker of this fleet",
                retry_after_s=1.0,
            )
        return frozenset(ids)

    async def _pass_through(self) -> Route:
        cand = self.mesh.router.pass_through()
        worker = cand.worker
        endpoint = await self._resolve(worker.host, worker.port)
        sets, removes = header_changes(self.headers, api_key=worker.api_key, api=Api.MODELS)
        return Route(endpoint, sets, removes)

    async def _answer_here(self, flow: ForwardFlow) -> Answer:
        """A response meshkit builds itself (the model list, a local answer): those
        flows end in a :class:`LocalResponse`, whose bytes the driver read up to
        ``bounds.max_captured_body_bytes``, as in every other mode."""
        final = await drive_async(flow, self._send)
        if not isinstance(final, Answered):  # pragma: no cover - not by construction
            await final.exchange.aclose()
            final.attempt.lease.abandon()
            raise UpstreamError("a worker's answer was not one meshkit builds")
        local = final.local
        assert self.view is not None
        self.mesh.account_local(self.view, final.attempt, local)
        return Answer(local.status, list(local.headers), local.body)

    # -- the response ---------------------------------------------------------------

    def response_headers(self, status: int, end_of_stream: bool, *, proxy: bool) -> Answer | None:
        """The response head: the attempt's result. ``proxy``: Envoy wrote it itself
        (no worker response reached it): a 503 is a worker that could not be
        reached, a 504 one that did not answer in time, and the client gets
        meshkit's error for it, in the API's shape, as in every other mode."""
        attempt = self.attempt
        if attempt is None or self.relay is not None or self.view is None:
            return None
        if proxy and status in (502, 503, 504):
            failure = Failure.TIMEOUT if status == 504 else Failure.CONNECT
            try:
                self._settle_flow(AttemptResult.failed(failure), raising=True)
            except MeshError as exc:
                self.attempt = None  # the flow released its lease
                return self._refuse(exc)
        self._settle_flow(AttemptResult.response(status))
        books: Accounting = self.mesh.account(self.view, attempt.lease, status)
        self.relay = Relay(books, self.view)
        if end_of_stream:
            self.relay.end()
        return None

    def response_body(self, chunk: bytes, end_of_stream: bool) -> tuple[bytes, bool]:
        """A chunk of the response body: the bytes to pass on now, and whether the
        client's body ends with them (the worker's end, or its stream's error event)."""
        relay = self.relay
        if relay is None:
            return chunk, end_of_stream
        if relay.finished:
            return b"", True
        out = relay.chunk(chunk)
        if end_of_stream:
            out += relay.end()
        return out, end_of_stream or relay.finished

    def response_end(self) -> bytes:
        """The response ended without a last body chunk (trailers): the rest to send."""
        relay = self.relay
        if relay is None or relay.finished:
            return b""
        return relay.end()

    def close(self) -> None:
        """The gRPC stream is over: release what is still held, once."""
        if self.closed:
            return
        self.closed = True
        if self.relay is not None:
            self.relay.close()
            return
        if self._flow is not None:
            self._flow.close()
            self._flow = None
        if self.attempt is not None:
            # No response reached us: the client left (or Envoy gave up) first.
            self.attempt.lease.abandon()

    # -- helpers --------------------------------------------------------------------

    def _settle_flow(self, result: AttemptResult, *, raising: bool = False) -> None:
        """Tell the flow how its one attempt went (the breaker and the policy
        learn it); ``raising``: its verdict on a failure is raised."""
        flow = self._flow
        if flow is None:
            return
        self._flow = None
        try:
            flow.send(result)
        except StopIteration:
            return
        except MeshError:
            if raising:
                raise
            return
        flow.close()  # pragma: no cover - one attempt never yields a second

    def refuse(self, exc: MeshError) -> Answer:
        """``exc`` as the client's answer, in the API's shape (counted)."""
        return self._refuse(exc)

    def _refuse(self, exc: MeshError) -> Answer:
        status, headers, body = error_reply(self.mesh, exc, self._shape)
        # Load shed (the workers or the prepare pool full): 429, as the GIE's picker
        # protocol answers a request it drops; the body and retry hints are the same.
        if isinstance(exc, Overloaded | PrepareQueueFull):
            status = 429
        return Answer(status, headers, body)


def _rank_of(attempt: Attempt) -> int | None:
    """The rank the flow chose to send (it adds the header only when it does)."""
    for k, v in attempt.headers:
        if k == b"x-data-parallel-rank":
            return int(v)
    return None


def _path_edit(attempt: Attempt, path: str, query: str) -> Headers:
    """A worker URL with a path prefix (``http://h:8000/prefix``) moves ``:path``."""
    want = urlsplit(attempt.url)
    full = want.path + ("?" + want.query if want.query else "")
    if full == path + ("?" + query if query else ""):
        return []
    return [(b":path", full.encode("latin-1"))]
