"""Table tests for :mod:`meshkit.errors`: status/code table, both error shapes, retry hints."""

from __future__ import annotations

import inspect
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshkit import errors
from meshkit.errors import (
    MAX_RETRY_AFTER_S,
    HeadersTooLarge,
    InvalidRequest,
    MeshError,
    MethodNotAllowed,
    ModelNotFound,
    NoAvailableWorkers,
    Overloaded,
    PoolUnavailable,
    PrepareQueueFull,
    PrepareTimeout,
    RequestTooLarge,
    StatefulRoutingUnsupported,
    Unavailable,
    UnknownEndpoint,
    UnsupportedApi,
    UnsupportedApiTopology,
    UnsupportedInExtProc,
    UnsupportedMediaType,
    UpstreamError,
    UpstreamTimeout,
    UpstreamTlsError,
    WorkerWaking,
)

P = pytest.param

# docs/errors.md's table (status, code, type per error class)
TABLE = [
    P(InvalidRequest, 400, "invalid_request", "invalid_request_error", id="400"),
    P(UnknownEndpoint, 404, "unknown_endpoint", "not_found_error", id="404"),
    P(ModelNotFound, 404, "model_not_found", "not_found_error", id="404-model"),
    P(MethodNotAllowed, 405, "method_not_allowed", "invalid_request_error", id="405"),
    P(RequestTooLarge, 413, "request_too_large", "request_too_large", id="413"),
    P(UnsupportedMediaType, 415, "unsupported_media_type", "invalid_request_error", id="415"),
    P(
        HeadersTooLarge,
        431,
        "request_header_fields_too_large",
        "invalid_request_error",
        id="431",
    ),
    P(UnsupportedApi, 501, "unsupported_api", "invalid_request_error", id="501-api"),
    P(
        UnsupportedApiTopology,
        501,
        "unsupported_api_topology",
        "invalid_request_error",
        id="501-topology",
    ),
    P(
        UnsupportedInExtProc,
        501,
        "unsupported_in_ext_proc",
        "invalid_request_error",
        id="501-extproc",
    ),
    P(
        StatefulRoutingUnsupported,
        501,
        "stateful_routing_unsupported",
        "invalid_request_error",
        id="501-stateful",
    ),
    P(UpstreamError, 502, "upstream_error", "api_error", id="502"),
    P(UpstreamTlsError, 502, "upstream_tls_error", "api_error", id="502-tls"),
    P(PrepareQueueFull, 503, "prepare_queue_full", "overloaded_error", id="503-queue"),
    P(NoAvailableWorkers, 503, "no_available_workers", "overloaded_error", id="503-workers"),
    P(WorkerWaking, 503, "worker_waking", "overloaded_error", id="503-waking"),
    P(Overloaded, 503, "overloaded", "overloaded_error", id="503-overloaded"),
    P(PoolUnavailable, 503, "prepare_pool_unavailable", "overloaded_error", id="503-pool"),
    P(PrepareTimeout, 504, "prepare_timeout", "timeout_error", id="504-prepare"),
    P(UpstreamTimeout, 504, "upstream_timeout", "timeout_error", id="504-upstream"),
]
ANTHROPIC_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
    "timeout_error",
}
OPENAI_TYPES = {"invalid_request_error", "server_error"}


def _all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    sub: type
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


def make(cls: type[MeshError], message: str = "it went wrong") -> MeshError:
    return cls(message)


def test_table_covers_every_concrete_subclass() -> None:
    in_table = {p.values[0] for p in TABLE}
    defined = {
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, MeshError) and obj not in (MeshError, Unavailable)
    }
    assert defined == in_table
    assert _all_subclasses(MeshError) - {Unavailable} >= in_table


@pytest.mark.parametrize(("cls", "status", "code", "anthropic_type"), TABLE)
def test_status_and_code(cls: type[MeshError], status: int, code: str, anthropic_type: str) -> None:
    err = make(cls)
    assert (err.status, err.code) == (status, code)
    assert err.anthropic_type == anthropic_type
    assert err.openai_type in OPENAI_TYPES
    assert err.openai_type == (
        "server_error" if status >= 500 and status not in (501,) else "invalid_request_error"
    )
    assert isinstance(err, MeshError)
    assert code in repr(err) and str(status) in repr(err)


@pytest.mark.parametrize(("cls", "status", "code", "anthropic_type"), TABLE)
def test_openai_shape(cls: type[MeshError], status: int, code: str, anthropic_type: str) -> None:
    body = json.loads(make(cls).body("openai"))
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] == "it went wrong"
    assert body["error"]["code"] == code
    assert body["error"]["param"] is None
    assert body["error"]["type"] in OPENAI_TYPES
    assert json.loads(make(cls).body()) == body  # openai is the default


@pytest.mark.parametrize(("cls", "status", "code", "anthropic_type"), TABLE)
def test_anthropic_shape(cls: type[MeshError], status: int, code: str, anthropic_type: str) -> None:
    body = json.loads(make(cls).body("anthropic"))
    error = {"type": anthropic_type, "message": "it went wrong", "code": code}
    assert body == {"type": "error", "error": error}
    assert anthropic_type in ANTHROPIC_TYPES


def test_param_is_rendered() -> None:
    body = json.loads(InvalidRequest("bad", param="messages").body())
    assert body["error"]["param"] == "messages"


def test_message_is_json_escaped() -> None:
    msg = 'quote " backslash \\ newline \n unicode é'
    assert json.loads(InvalidRequest(msg).body())["error"]["message"] == msg
    assert json.loads(InvalidRequest(msg).body("anthropic"))["error"]["message"] == msg


# --------------------------------------------------------------------------------------
# retry hints
# --------------------------------------------------------------------------------------

UNAVAILABLE = [
    P(c, id=c.code)
    for c in (PrepareQueueFull, NoAvailableWorkers, WorkerWaking, PoolUnavailable, Overloaded)
]


def test_overloaded_is_a_no_available_workers() -> None:
    """The lifecycle treats it as "nobody can take it now" (it may wake a sleeping
    worker, and tries unverified ones); its own code tells clients it is load."""
    err = Overloaded("full", retry_after_s=0.375)
    assert isinstance(err, NoAvailableWorkers)
    assert (err.status, err.code) == (503, "overloaded")
    headers = dict(err.headers())
    assert (headers[b"retry-after"], headers[b"retry-after-ms"]) == (b"1", b"375")
    assert json.loads(err.body())["error"]["code"] == "overloaded"
    assert json.loads(err.body("anthropic"))["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("cls", UNAVAILABLE)
def test_503_carries_retry_after(cls: type[Unavailable]) -> None:
    headers = dict(cls("busy").headers())
    assert headers[b"content-type"] == b"application/json"
    secs = int(headers[b"retry-after"])
    ms = int(headers[b"retry-after-ms"])
    assert 1 <= secs <= 60
    assert 1 <= ms <= 60_000
    assert secs == 1 and ms == 1000  # the default hint


@pytest.mark.parametrize(
    ("hint", "secs", "ms"),
    [
        P(0.2, b"1", b"200", id="sub-second"),
        P(1.0, b"1", b"1000", id="one"),
        P(1.5, b"2", b"1500", id="rounded-up"),
        P(5.0, b"5", b"5000", id="five"),
        P(59.999, b"60", b"59999", id="just-under"),
        P(60.0, b"60", b"60000", id="max"),
        P(61.0, b"60", b"60000", id="clamped"),
        P(3600.0, b"60", b"60000", id="hour-clamped"),
        P(math.inf, b"60", b"60000", id="inf-clamped"),
        P(0.0, b"1", b"1", id="zero"),
        P(-5.0, b"1", b"1", id="negative"),
    ],
)
def test_retry_hint_rendering(hint: float, secs: bytes, ms: bytes) -> None:
    err = NoAvailableWorkers("busy", retry_after_s=hint)
    headers = dict(err.headers())
    assert (headers[b"retry-after"], headers[b"retry-after-ms"]) == (secs, ms)
    assert err.retry_after_s is not None
    assert 0 < err.retry_after_s <= MAX_RETRY_AFTER_S == 60.0


@given(hint=st.floats(allow_nan=False))
def test_retry_after_always_in_bounds(hint: float) -> None:
    headers = dict(WorkerWaking("waking", retry_after_s=hint).headers())
    assert 1 <= int(headers[b"retry-after"]) <= 60
    assert 1 <= int(headers[b"retry-after-ms"]) <= 60_000


def test_nan_retry_hint_renders_bounded_headers() -> None:
    headers = dict(WorkerWaking("waking", retry_after_s=math.nan).headers())
    assert 1 <= int(headers[b"retry-after"]) <= 60


@pytest.mark.parametrize(("cls", "status", "code", "anthropic_type"), TABLE)
def test_should_retry_says_what_the_sdks_may_retry(
    cls: type[MeshError], status: int, code: str, anthropic_type: str
) -> None:
    """Permanent refusals (4xx, 501) say ``x-should-retry: false`` with no hint; the
    ones a later attempt may pass (502-504) say ``true``, 503 and 504 with a hint."""
    headers = dict(cls("x").headers())
    retry = status >= 500 and status != 501
    assert headers[b"x-should-retry"] == (b"true" if retry else b"false")
    assert (b"retry-after" in headers) == (status in (503, 504))
    assert (b"retry-after-ms" in headers) == (status in (503, 504))


def test_method_not_allowed_allow_header() -> None:
    err = MethodNotAllowed("no", allowed=("DELETE", "GET"))
    assert (b"allow", b"DELETE, GET") in err.headers()
    assert b"allow" not in dict(MethodNotAllowed("no").headers())


def test_base_mesh_error_is_500() -> None:
    err = MeshError("boom")
    assert (err.status, err.code) == (500, "internal_error")
    assert set(json.loads(err.body())["error"]) == {"message", "type", "param", "code"}
