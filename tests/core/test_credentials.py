"""Table tests for :mod:`meshkit.core.credentials`: credential isolation and hop-by-hop."""

from __future__ import annotations

import pytest

from meshkit.core.credentials import HOP_BY_HOP, request_headers, response_headers, served_headers
from meshkit.core.endpoints import Api

P = pytest.param
H = list[tuple[bytes, bytes]]

CLIENT: H = [
    (b"Authorization", b"Bearer sk-client"),
    (b"X-Api-Key", b"sk-client-x"),
    (b"anthropic-version", b"2023-06-01"),
    (b"User-Agent", b"OpenAI/Python 2.0"),
    (b"X-Stainless-Retry-Count", b"0"),
    (b"Content-Type", b"application/json"),
]


def names(headers: H) -> list[bytes]:
    return [k for k, _ in headers]


def values(headers: H, name: bytes) -> list[bytes]:
    return [v for k, v in headers if k == name]


@pytest.mark.parametrize("api", [P(a, id=a.value) for a in Api if a is not Api.MESSAGES])
def test_worker_key_replaces_client_credentials(api: Api) -> None:
    out = request_headers(CLIENT, api_key="sk-worker", api=api)
    assert values(out, b"authorization") == [b"Bearer sk-worker"]
    assert values(out, b"x-api-key") == []
    assert b"sk-client" not in b"".join(v for _, v in out)
    # everything else passes, lower-cased, in order
    assert out[:4] == [
        (b"anthropic-version", b"2023-06-01"),
        (b"user-agent", b"OpenAI/Python 2.0"),
        (b"x-stainless-retry-count", b"0"),
        (b"content-type", b"application/json"),
    ]


def test_messages_gets_the_key_in_both_headers() -> None:
    out = request_headers(CLIENT, api_key="sk-worker", api=Api.MESSAGES)
    assert values(out, b"authorization") == [b"Bearer sk-worker"]
    assert values(out, b"x-api-key") == [b"sk-worker"]
    assert b"sk-client" not in b"".join(v for _, v in out)


@pytest.mark.parametrize(
    ("client", "api"),
    [
        P([(b"AUTHORIZATION", b"Bearer c")], Api.CHAT, id="upper"),
        P([(b"authorization", b"Bearer c")], Api.CHAT, id="lower"),
        P([(b"aUtHoRiZaTiOn", b"Bearer c"), (b"X-API-KEY", b"c")], Api.MESSAGES, id="mixed"),
        P([(b"x-api-key", b"c"), (b"x-api-key", b"c2")], Api.RESPONSES, id="repeated"),
        P([(b"Api-Key", b"c")], Api.CHAT, id="azure"),
    ],
)
def test_credential_header_names_are_case_insensitive(client: H, api: Api) -> None:
    out = request_headers(client, api_key="sk-w", api=api)
    assert all(v in (b"Bearer sk-w", b"sk-w") for _, v in out)
    assert values(out, b"authorization") == [b"Bearer sk-w"]


@pytest.mark.parametrize("api", [P(Api.CHAT, id="chat"), P(Api.MESSAGES, id="messages")])
@pytest.mark.parametrize("key", [P(None, id="none"), P("", id="empty")])
def test_no_worker_key_keeps_client_credentials(api: Api, key: str | None) -> None:
    out = request_headers(CLIENT, api_key=key, api=api)
    assert values(out, b"authorization") == [b"Bearer sk-client"]
    assert values(out, b"x-api-key") == [b"sk-client-x"]


@pytest.mark.parametrize(
    "name",
    [
        P(b"Connection", id="connection"),
        P(b"Keep-Alive", id="keep-alive"),
        P(b"Proxy-Authorization", id="proxy-authorization"),
        P(b"Proxy-Authenticate", id="proxy-authenticate"),
        P(b"Proxy-Connection", id="proxy-connection"),
        P(b"TE", id="te"),
        P(b"Trailer", id="trailer"),
        P(b"Transfer-Encoding", id="transfer-encoding"),
        P(b"Upgrade", id="upgrade"),
        P(b"Host", id="host"),
        P(b"Content-Length", id="content-length"),
        P(b"Expect", id="expect"),
    ],
)
@pytest.mark.parametrize("key", [P(None, id="no-key"), P("sk-w", id="key")])
def test_dropped_request_headers(name: bytes, key: str | None) -> None:
    out = request_headers([(name, b"x"), (b"accept", b"*/*")], api_key=key, api=Api.CHAT)
    assert name.lower() not in names(out)
    assert (b"accept", b"*/*") in out


def test_headers_named_in_connection_are_dropped() -> None:
    client = [
        (b"Connection", b"keep-alive, X-Hop , x-other"),
        (b"X-Hop", b"1"),
        (b"X-Other", b"2"),
        (b"X-Keep", b"3"),
    ]
    out = request_headers(client, api_key=None, api=Api.CHAT)
    assert out == [(b"x-keep", b"3")]


def test_connection_can_not_smuggle_removal_of_worker_key() -> None:
    # a client naming Authorization in Connection must not strip the worker key
    out = request_headers(
        [(b"Connection", b"authorization, x-api-key")], api_key="sk-w", api=Api.MESSAGES
    )
    assert values(out, b"authorization") == [b"Bearer sk-w"]
    assert values(out, b"x-api-key") == [b"sk-w"]


@pytest.mark.parametrize(
    ("rank", "expected"), [P(None, [], id="none"), P(0, [b"0"], id="0"), P(12, [b"12"], id="12")]
)
def test_rank_header(rank: int | None, expected: list[bytes]) -> None:
    client = [(b"X-Data-Parallel-Rank", b"99"), (b"accept", b"*/*")]
    out = request_headers(client, api_key=None, api=Api.CHAT, rank=rank)
    # the client's own rank header never reaches the worker
    assert values(out, b"x-data-parallel-rank") == expected


def test_hop_by_hop_set_is_lowercase() -> None:
    assert all(h == h.lower() for h in HOP_BY_HOP)


# --------------------------------------------------------------------------------------
# response headers
# --------------------------------------------------------------------------------------


def test_response_headers_keep_repeats_and_encoding() -> None:
    upstream = [
        (b"Content-Type", b"text/event-stream"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
        (b"Content-Encoding", b"gzip"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Connection", b"keep-alive, X-Private"),
        (b"X-Private", b"p"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Request-Id", b"req_1"),
        (b"retry-after", b"3"),
    ]
    out = response_headers(upstream)
    assert out == [
        (b"content-type", b"text/event-stream"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
        (b"content-encoding", b"gzip"),
        (b"x-request-id", b"req_1"),
        (b"retry-after", b"3"),
    ]


@pytest.mark.parametrize("name", sorted(HOP_BY_HOP))
def test_response_hop_by_hop_dropped(name: bytes) -> None:
    out = response_headers([(name.upper(), b"x"), (b"x-a", b"1")])
    assert out == [(b"x-a", b"1")]


@pytest.mark.parametrize("value", [b"keep-alive", b"Keep-Alive", b"close", b"keep-alive, x-hop"])
def test_connection_values_on_the_short_path_and_the_long_one(value: bytes) -> None:
    upstream: H = [
        (b"Connection", value),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Hop", b"1"),
        (b"Content-Type", b"application/json"),
    ]
    kept = names(response_headers(upstream))
    assert b"connection" not in kept and b"keep-alive" not in kept
    assert (b"x-hop" in kept) == (b"x-hop" not in value)
    assert b"content-type" in kept


def test_a_served_response_drops_the_workers_date_a_relayed_one_keeps_it() -> None:
    """The server that writes the response adds its own date (one per response)."""
    upstream = [(b"Date", b"Tue, 01 Dec 2026 00:00:00 GMT"), (b"x-a", b"1")]
    assert names(served_headers(upstream)) == [b"x-a"]
    assert names(response_headers(upstream)) == [b"date", b"x-a"]


def test_kept_pairs_are_the_callers_own_tuples() -> None:
    """A header kept as it came is the caller's pair, not a copy: a compiled build
    unboxes a ``tuple[bytes, bytes]`` and boxed a new tuple per header when it
    appended one (what ``_kept`` now walks as objects); a renamed one is new."""
    given: H = [(b"accept", b"*/*"), (b"User-Agent", b"x"), (b"x-trace", b"1")]
    out = request_headers(given, api_key=None, api=Api.CHAT)
    assert out == [(b"accept", b"*/*"), (b"user-agent", b"x"), (b"x-trace", b"1")]
    assert out[0] is given[0] and out[2] is given[2]
    assert out[1] is not given[1]
