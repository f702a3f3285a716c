"""
Fan-out flows: Responses resource operations and the model list
================================================================

Retrieve, delete, cancel and input_items name a stored Response; retrieve,
update, delete and the items operations of ``/v1/conversations/{id}`` a stored
Conversation. When meshkit knows which origin created it (Responses affinity) it
asks that origin only;
otherwise it asks each candidate origin in turn (DP ranks of one origin once) and
relays the first success, or else the most specific error: a 404 says the others
do not have it, which is truer than a 5xx or an unreachable worker.

``GET /v1/models`` asks every origin and answers the union of their lists;
``GET /v1/models/{model}`` answers that model's entry of the same union, or 404
``model_not_found``. When no origin answered with a list but some answered with
an error (a 401 for a client key the workers refuse), that error is relayed, a
4xx before a 5xx: it is the client's answer, not a gateway failure. 502
``upstream_error`` only when every attempt failed before an answer.

Admission: a target at its limit (``Placer.lease`` raises
:class:`~meshkit.errors.Overloaded`) or a pool-acquire timeout
(``Failure.POOL``) is not the worker's fault: the lease is released without a
verdict. A model listing is not answered incompletely: the refusal (503
``overloaded``) stands. A resource operation goes on to the other origins; with
no success, the refusal beats their errors (the full worker may hold the Response).

Both are generators of the same shape as :func:`meshkit.core.forward.forward_flow`,
so every adapter drives them with the same loop.
"""

from __future__ import annotations

from collections.abc import Generator

import msgspec

from meshkit.core.endpoints import Op
from meshkit.core.forward import (
    Attempt,
    AttemptResult,
    Failure,
    ForwardFlow,
    LocalResponse,
    Placer,
    build_attempt,
    capture,
    pool_refusal,
)
from meshkit.core.requests import RequestView
from meshkit.errors import ModelNotFound, Overloaded, UnsupportedApi, UpstreamError

__all__ = ["models_flow", "resource_flow"]

_JSON = ((b"content-type", b"application/json"),)


def _rank(status: int) -> int:
    """Which error to relay when no origin succeeded: lower is more specific."""
    if status == 404:
        return 0
    if 400 <= status < 500:
        return 1
    return 2


def resource_flow(
    placer: Placer,
    view: RequestView,
    client_headers: list[tuple[bytes, bytes]],
    *,
    method: str,
) -> ForwardFlow:
    targets = placer.targets(view)
    if not targets:
        # targets() includes unhealthy workers: empty means none is configured.
        raise UnsupportedApi(f"no configured worker serves {view.match.endpoint.template}")
    best: AttemptResult | None = None
    refused: Overloaded | None = None
    for number, cand in enumerate(targets):
        try:
            attempt = build_attempt(placer, view, cand, client_headers, method, number, view.body)
        except Overloaded as exc:
            refused = exc
            continue
        # Errors are read (small JSON) so the best one can be relayed after the
        # other origins were asked; a success is relayed as it streams.
        capture(attempt, placer, "errors")
        result = yield attempt
        status = result.status
        if status is not None and status < 400:
            rid = view.match.resource_id
            if len(targets) > 1 and rid and view.match.endpoint.op is not Op.DELETE:
                # Found by asking: the next operation on it (the items listed after
                # a turn through another router) goes to this origin only.
                placer.remember_response(rid, cand.origin)
            return attempt
        if result.failure is Failure.POOL:
            attempt.lease.abandon()
            refused = pool_refusal()
            continue
        attempt.lease.release(ok=False, status=status)
        if status is not None and (best is None or _rank(status) < _rank(best.status or 0)):
            best = result
    if refused is not None:
        raise refused
    if best is not None and best.status is not None:
        return LocalResponse(best.status, best.headers, best.body or b"")
    raise UpstreamError("no worker holding this response or conversation could be reached")


def _refusal_rank(status: int) -> int:
    """Which worker error to relay for the model list: the client's 4xx first."""
    return 0 if status < 500 else 1


def models_flow(
    placer: Placer,
    view: RequestView,
    client_headers: list[tuple[bytes, bytes]],
) -> Generator[Attempt, AttemptResult, Attempt | LocalResponse]:
    """``GET /v1/models`` (the union of every origin's list) and
    ``GET /v1/models/{model}`` (one entry of it)."""
    targets = placer.targets(view)
    if not targets:
        raise UnsupportedApi(f"no configured worker serves {view.match.endpoint.template}")
    seen: dict[str, object] = {}
    answered = False
    refusal: AttemptResult | None = None
    pool_timeout = False
    for number, cand in enumerate(targets):
        # May raise Overloaded: a listing without that worker's models would be wrong.
        attempt = build_attempt(placer, view, cand, client_headers, "GET", number, b"")
        result = yield capture(attempt, placer)
        status = result.status
        if result.failure is Failure.POOL:
            attempt.lease.abandon()
            pool_timeout = True
            continue
        attempt.lease.release(ok=status == 200, status=status)
        if status == 200 and result.truncated:
            # A list without that worker's models would be wrong, as above.
            raise UpstreamError(
                f"a worker's model list is over bounds.max_captured_body_bytes "
                f"({placer.capture_limit} bytes)"
            )
        if status is not None and status != 200:
            if status >= 400 and (
                refusal is None or _refusal_rank(status) < _refusal_rank(refusal.status or 0)
            ):
                refusal = result
            continue
        if status != 200 or not result.body:
            continue
        try:
            listing = msgspec.json.decode(result.body)
        except msgspec.DecodeError:
            continue
        data = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(data, list):
            continue
        answered = True
        for item in data:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                seen.setdefault(item["id"], item)
    if pool_timeout:
        raise pool_refusal()
    if not answered:
        if refusal is not None and refusal.status is not None:
            return LocalResponse(refusal.status, refusal.headers, refusal.body or b"")
        raise UpstreamError("no worker answered the model list")
    model = view.match.model
    if model is not None:
        item = seen.get(model)
        if item is None:
            raise ModelNotFound(
                f"The model `{model}` does not exist or no worker serves it", param="model"
            )
        return LocalResponse(200, _JSON, msgspec.json.encode(item))
    body = msgspec.json.encode({"object": "list", "data": list(seen.values())})
    return LocalResponse(200, _JSON, body)
