"""
Fan-out flows: Responses resource operations and the model list
================================================================

Retrieve, delete, cancel and input_items name a stored Response. When meshkit
knows which origin created it (Responses affinity) it asks that origin only;
otherwise it asks each candidate origin in turn (DP ranks of one origin once) and
relays the first success, or else the most specific error: a 404 says the others
do not have it, which is truer than a 5xx or an unreachable worker.

``GET /v1/models`` asks every origin and answers the union of their lists.

Both are generators of the same shape as :func:`meshkit.core.forward.forward_flow`,
so every adapter drives them with the same loop.
"""

from __future__ import annotations

from collections.abc import Generator

import msgspec

from meshkit.core.forward import (
    Attempt,
    AttemptResult,
    ForwardFlow,
    LocalResponse,
    Placer,
    build_attempt,
)
from meshkit.core.requests import RequestView
from meshkit.errors import UnsupportedApi, UpstreamError

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
    for number, cand in enumerate(targets):
        attempt = build_attempt(placer, view, cand, client_headers, method, number, view.body)
        # Errors are read (small JSON) so the best one can be relayed after the
        # other origins were asked; a success is relayed as it streams.
        attempt.read_body = "errors"
        result = yield attempt
        status = result.status
        if status is not None and status < 400:
            return attempt
        attempt.lease.release(ok=False, status=status)
        if status is not None and (best is None or _rank(status) < _rank(best.status or 0)):
            best = result
    if best is not None and best.status is not None:
        return LocalResponse(best.status, best.headers, best.body or b"")
    raise UpstreamError("no worker holding this response could be reached")


def models_flow(
    placer: Placer,
    view: RequestView,
    client_headers: list[tuple[bytes, bytes]],
) -> Generator[Attempt, AttemptResult, Attempt | LocalResponse]:
    targets = placer.targets(view)
    if not targets:
        raise UnsupportedApi(f"no configured worker serves {view.match.endpoint.template}")
    seen: dict[str, object] = {}
    answered = False
    for number, cand in enumerate(targets):
        attempt = build_attempt(placer, view, cand, client_headers, "GET", number, b"")
        attempt.read_body = "always"
        result = yield attempt
        attempt.lease.release(ok=result.status == 200, status=result.status)
        if result.status != 200 or not result.body:
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
    if not answered:
        raise UpstreamError("no worker answered the model list")
    body = msgspec.json.encode({"object": "list", "data": list(seen.values())})
    return LocalResponse(200, _JSON, body)
