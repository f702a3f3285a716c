"""The per-request shortcuts of the routing core behave as the long way round."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest

from meshkit import Mesh
from meshkit.core.credentials import request_headers, response_headers
from meshkit.core.endpoints import Api, resolve
from meshkit.core.forward import Attempt
from meshkit.core.placement import configured_for, eligible
from meshkit.core.policies.base import Completion, PlacementContext
from meshkit.core.policies.simple import RoundRobin
from meshkit.core.requests import RequestView, parse_request
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import UnsupportedMediaType

BODY = b'{"model":"m","prompt":"hi"}'
URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


@pytest.fixture
def mesh() -> Any:
    m = Mesh(workers=URLS, lifecycle={"probe": False}, routing={"session_header": "X-Session"})
    yield m
    m.close()


def _prepare(mesh: Mesh, headers: list[tuple[bytes, bytes]]) -> RequestView:
    match = mesh.resolve("POST", "/v1/completions")
    assert match is not None
    return mesh.prepare(match, BODY, iter(headers))


@pytest.mark.parametrize("upper", [False, True])
def test_prepare_reads_its_headers_in_any_case(mesh: Mesh, upper: bool) -> None:
    headers = [
        (b"content-type", b"Application/JSON; charset=utf-8"),
        (b"x-session", b""),  # empty: the next one counts
        (b"x-session", b"s1"),
        (b"x-session", b"s2"),
        (b"idempotency-key", b"k1"),
        (b"idempotency-key", b"k2"),
        (b"x-mesh-wait", b" False "),
        (b"content-length", b"27"),
    ]
    if upper:
        headers = [(k.upper(), v) for k, v in headers]
    view = _prepare(mesh, headers)
    assert view.routing_key == "s1"
    assert view.idempotency_key == "/v1/completions k2"
    assert view.no_wait is True


@pytest.mark.parametrize(
    "header",
    [(b"Content-Type", b"text/plain"), (b"CONTENT-ENCODING", b"gzip")],
)
def test_prepare_still_refuses_other_media(mesh: Mesh, header: tuple[bytes, bytes]) -> None:
    with pytest.raises(UnsupportedMediaType):
        _prepare(mesh, [header])


def test_prepare_accepts_identity_encoding_and_no_content_type(mesh: Mesh) -> None:
    view = _prepare(mesh, [(b"Content-Encoding", b"identity")])
    assert view.routing_key is None
    assert view.idempotency_key is None and view.no_wait is False


def _one(mesh: Mesh, rid_body: bytes | None = None) -> None:
    match = mesh.resolve("POST", "/v1/responses" if rid_body else "/v1/completions")
    assert match is not None
    body = b'{"model":"m","input":"hi"}' if rid_body else BODY
    view = mesh.prepare(match, body, [])
    flow = mesh.forward(view, [])
    attempt = cast(Attempt, next(flow))  # no worker sleeps, none is a pair: an Attempt
    flow.close()
    acct = mesh.account(view, attempt.lease, 200)
    acct.feed(rid_body or b'{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1}}')
    acct.end()


def test_completions_reach_a_policy_that_listens(mesh: Mesh) -> None:
    heard: list[Completion] = []

    class Listening(RoundRobin):
        def on_complete(
            self, cand: Candidate, view: RequestView, done: Completion, now: float
        ) -> None:
            heard.append(done)

    mesh.policy = Listening()
    _one(mesh)
    assert [(d.status, d.ok, d.input_tokens) for d in heard] == [(200, True, 1)]


def test_placements_reach_a_policy_that_hears_them_and_only_then(mesh: Mesh) -> None:
    placed: list[str] = []

    class Hearing(RoundRobin):
        def on_placed(self, cand: Candidate, view: RequestView, now: float) -> None:
            placed.append(cand.key)

    mesh.policy = Hearing()
    assert mesh.router.hears_placed
    _one(mesh)
    _one(mesh)
    assert len(placed) == 2 and set(placed) <= set(URLS)
    # A policy with BasePolicy's no-op hook is not called into for it at all.
    mesh.policy = RoundRobin()
    assert not mesh.router.hears_placed
    _one(mesh)
    assert len(placed) == 2


def test_response_ids_are_remembered_without_a_listening_policy(mesh: Mesh) -> None:
    _one(mesh, b'{"id":"resp_1","output":[{"type":"message"}]}')
    assert mesh.affinity.owner("resp_1", mesh.clock()) == URLS[0]


def test_only_a_background_response_asks_whether_its_usage_was_counted(mesh: Mesh) -> None:
    # The memory of counted background responses is behind the router's lock: a
    # create that is not a background Response's never goes near it. (Read from the
    # memory itself: a compiled Router's methods cannot be patched.)
    counted = mesh.router.counted
    usage = b'"usage":{"input_tokens":2,"output_tokens":1}'
    _one(mesh)  # completions
    _one(mesh, b'{"id":"resp_1","status":"completed","background":false,' + usage + b"}")
    _one(mesh, b'{"id":"resp_2","status":"queued","background":true,"usage":null}')
    assert len(counted) == 0
    _one(mesh, b'{"id":"resp_3","status":"completed","background":true,' + usage + b"}")
    assert len(counted) == 1 and "resp_3" in counted


def test_eligibility_follows_workers_added_and_removed() -> None:
    a = Worker("http://a:1")
    fleet = Fleet([a])
    view = _view(Api.CHAT)
    assert configured_for(fleet, view) == [a]
    b = Worker("http://b:1", labels={"mesh.dp_size": "2"})
    fleet.add(b)
    assert [c.key for c in eligible(fleet, view)] == [
        "http://a:1",
        "http://b:1#dp0",
        "http://b:1#dp1",
    ]
    fleet.remove(a.id)
    assert configured_for(fleet, view) == [b]


def _view(api: Api) -> RequestView:
    match = resolve("POST", "/v1/chat/completions")
    assert match is not None and match.endpoint.api is api
    return parse_request(match, b'{"messages":[]}')


def test_round_robin_walks_past_an_ineligible_cursor() -> None:
    fleet = Fleet([Worker("http://a:1"), Worker("http://b:1"), Worker("http://c:1")])
    view = _view(Api.CHAT)
    rr = RoundRobin()
    rng = random.Random(0)
    picks = []
    for i in range(6):
        cands = [c for c in fleet.candidates if i < 3 or c.worker.host != "b"]
        ctx = PlacementContext(cands, view, fleet.load, fleet.weight, rng, fleet.candidates)
        picks.append(rr.select(ctx).worker.host)
    assert picks == ["a", "b", "c", "a", "c", "a"]


@pytest.mark.parametrize("late", [False, True])
def test_connection_named_headers_dropped_from_any_iterable(late: bool) -> None:
    headers = [(b"X-Hop", b"1"), (b"Accept", b"*/*"), (b"Host", b"h")]
    conn = (b"Connection", b"x-hop")
    headers = [*headers, conn] if late else [conn, *headers]
    assert request_headers(iter(headers), api_key=None, api=Api.CHAT) == [(b"accept", b"*/*")]
    assert response_headers(iter(headers)) == [(b"accept", b"*/*"), (b"host", b"h")]
