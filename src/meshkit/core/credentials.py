"""
Headers and credentials
=======================

Request headers forwarded to a worker are the client's, minus hop-by-hop headers
and ``host``/``content-length`` (rebuilt by the client library), plus the worker's
credentials.

Credential isolation: when the chosen worker has an API key, the client's
``authorization``, ``x-api-key`` and ``api-key`` (Azure OpenAI clients) are
dropped and the worker key is sent as ``Authorization: Bearer``; for
``/v1/messages`` (Anthropic clients authenticate with ``x-api-key``) in both
headers. Without a worker key, the client's credentials pass through unchanged:
the worker is the one that checks them.

Security: the worker key is only ever placed in outgoing request headers; it is
never copied into a response, an error, a log line or a metric label.

Response headers relayed to the client drop hop-by-hop headers, keep repeated
headers (``set-cookie``) and keep ``content-encoding`` (the body is relayed as
received, still encoded). Where a server writes the response (the middleware, the
gateway) the worker's ``date`` goes too: every server adds its own, and a response
has one (:func:`served_headers`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, cast

from meshkit.core.endpoints import Api
from meshkit.core.unbound import islower, lower
from meshkit.types import Headers

__all__ = [
    "HOP_BY_HOP",
    "header_changes",
    "request_headers",
    "response_headers",
    "served_headers",
]


HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_DROP_SERVED: Final = HOP_BY_HOP | {b"date"}
_DROP_BODILESS: Final = _DROP_SERVED | {b"content-length"}
# The rank header is meshkit's to set (DP-rank append), never the client's.
_DROP_REQUEST: Final = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"x-data-parallel-rank"}
_CREDENTIALS: Final = frozenset({b"authorization", b"x-api-key", b"api-key"})
_DROP_KEYED: Final = _DROP_REQUEST | _CREDENTIALS


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    # Headers named in Connection are hop-by-hop too (RFC 9110 §7.6.1).
    out: set[bytes] = set()
    for k, v in headers:
        if k == b"connection":
            out.update(t.strip().lower() for t in v.split(b","))
    return frozenset(out)


def _dropped(base: frozenset[bytes], items: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """``base``, plus the names a ``Connection`` header lists (rare: no new set then)."""
    for k, _ in items:
        if k == b"connection":
            return base | _connection_tokens(items)
    return base


# The usual Connection values name no other header: no second pass for them.
_PLAIN_CONNECTION: Final = frozenset({b"keep-alive", b"close"})


def _kept(headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]) -> Headers:
    """``headers`` with lower-cased names, minus ``drop`` and the names a
    ``Connection`` header lists (rare: a second pass then)."""
    # Pairs walked as objects: a compiled build unboxes a ``tuple[bytes, bytes]``,
    # and appending it boxes a new tuple (an allocation per header).
    given = cast("list[object]", headers if isinstance(headers, list) else list(headers))
    out: list[object] = []
    for pair in given:
        k, v = cast("tuple[bytes, bytes]", pair)
        if not islower(k):  # servers and ASGI give them lower-cased: no copy then
            k = lower(k)
            pair = (k, v)
        if k not in drop:
            out.append(pair)  # the same pair, not a copy
        elif k == b"connection" and lower(v) not in _PLAIN_CONNECTION:
            items = [(lower(n), w) for n, w in cast("Headers", given)]
            drop = _dropped(drop, items)
            return [(n, w) for n, w in items if n not in drop]
    return cast("Headers", out)


def request_headers(
    client: Iterable[tuple[bytes, bytes]],
    *,
    api_key: str | None,
    api: Api,
    rank: int | None = None,
) -> Headers:
    """Headers to send to the worker. Names are lower-cased."""
    out = _kept(client, _DROP_KEYED if api_key else _DROP_REQUEST)
    if api_key or rank is not None:  # the usual request adds nothing: no call
        out += _added(api_key, api, rank)
    return out


def _added(api_key: str | None, api: Api, rank: int | None) -> Headers:
    out: Headers = []
    if api_key:
        key = api_key.encode("latin-1")
        out.append((b"authorization", b"Bearer " + key))
        if api is Api.MESSAGES:
            out.append((b"x-api-key", key))
    if rank is not None:
        out.append((b"x-data-parallel-rank", str(rank).encode()))
    return out


def header_changes(
    client: Iterable[tuple[bytes, bytes]],
    *,
    api_key: str | None,
    api: Api,
    rank: int | None = None,
) -> tuple[Headers, list[bytes]]:
    """:func:`request_headers` as edits of the client's headers, for a proxy that
    sends them on itself (Envoy, in ext-proc mode): the headers to set (each
    replacing any of its name) and the names to remove. Framing and hop-by-hop
    headers are the proxy's business and left alone."""
    add = _added(api_key, api, rank)
    setting = {k for k, _ in add}
    drop = (_CREDENTIALS if api_key else frozenset()) | {b"x-data-parallel-rank"}
    present = {k.lower() for k, _ in client}
    remove = sorted(n for n in drop & present if n not in setting)
    return add, remove


def response_headers(upstream: Iterable[tuple[bytes, bytes]]) -> Headers:
    """Headers to relay to the client (repeated ones kept, content-encoding kept)."""
    return _kept(upstream, HOP_BY_HOP)


def served_headers(upstream: Iterable[tuple[bytes, bytes]], status: int = 200) -> Headers:
    """:func:`response_headers` for a response a server writes (it adds its own date).

    A response that has no body (1xx, 204, 304) loses a worker's ``content-length``:
    RFC 9110 forbids it on a 204, and a host server that frames by it (uvicorn)
    would wait for a body that never comes."""
    if status >= 200 and status != 204 and status != 304:
        return _kept(upstream, _DROP_SERVED)
    return _kept(upstream, _DROP_BODILESS)
