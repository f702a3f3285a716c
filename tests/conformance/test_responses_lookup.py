"""A Responses follow-up through a router that did not place the first turn
(issue 17, item 5): it asks the origins once (``GET /v1/responses/{id}``), remembers
the owner, routes there; 501 when nobody holds the id, 502 when the owner is down.
A ``conversation`` is looked up the same way (``GET /v1/conversations/{id}``): a
conversation created through one router is continued through another.
In every mode, and through two transports in two processes (two gateways:
tests/server/test_serve_responses_lookup.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import generate_latest

from harness import AsyncTransportMode, Mode, TransportMode
from meshkit import Mesh, Worker
from meshkit.mock import MockWorkerThread

FIRST = {"model": "m", "input": "hello"}
#: what a follow-up names: the response it continues, or its conversation
KINDS = pytest.mark.parametrize("kind", ["previous_response_id", "conversation"])
#: where each kind is created, and where a router asks for it
CREATE = {"previous_response_id": "/v1/responses", "conversation": "/v1/conversations"}
LOOKUP = {"previous_response_id": "/v1/responses/", "conversation": "/v1/conversations/"}
CREATE_BODY = {
    "previous_response_id": FIRST,
    "conversation": {"items": [{"role": "user", "content": "hello"}]},
}


def _follow(rid: str, kind: str = "previous_response_id") -> dict[str, Any]:
    return {"model": "m", "input": "and then?", kind: rid}


def _lookups(mocks: list[MockWorkerThread], rid: str, kind: str = "previous_response_id") -> int:
    path = LOOKUP[kind] + rid
    return sum(m.worker.stats.requests_total.get(path, 0) for m in mocks)


def _fleet(mock_factory: Callable[..., MockWorkerThread]) -> list[MockWorkerThread]:
    return [mock_factory(name=f"w{i}") for i in range(3)]


def _first_turn(
    mesh_factory: Any, urls: list[str], kind: str = "previous_response_id"
) -> tuple[str, str]:
    """The first turn (or the conversation), placed by a router of its own: (its id,
    its worker)."""
    router = TransportMode(mesh_factory(workers=urls, lifecycle={"probe": False}))
    try:
        created = router.request("POST", CREATE[kind], json=CREATE_BODY[kind])
    finally:
        router.close()
    assert created.status == 200, created.body
    return created.json()["id"], created.headers["x-mock-worker"]


@KINDS
def test_a_follow_up_through_another_router_finds_its_owner(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, kind: str
) -> None:
    mocks = _fleet(mock_factory)
    urls = [m.url for m in mocks]
    rid, owner = _first_turn(mesh_factory, urls, kind)
    mesh = mesh_factory(workers=[Worker(u) for u in urls], lifecycle={"probe": False})
    mode = run_mode(mesh)  # a second router: it never saw the first turn
    asked = []
    for _ in range(3):
        nxt = mode.request("POST", "/v1/responses", json=_follow(rid, kind))
        assert nxt.status == 200, nxt.body
        assert nxt.headers["x-mock-worker"] == owner
        asked.append(_lookups(mocks, rid, kind))
    # asked once, stopping at the owner; then remembered
    assert 1 <= asked[0] <= len(mocks)
    assert asked == [asked[0]] * 3
    assert mesh.affinity.owner(rid, mesh.clock()) is not None
    assert mesh.total_load() == 0


@KINDS
def test_an_id_nobody_holds_is_501_and_asked_once(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, kind: str
) -> None:
    mocks = _fleet(mock_factory)
    mesh = mesh_factory(workers=[m.url for m in mocks], lifecycle={"probe": False})
    mode = run_mode(mesh)
    nobody = "resp_nobody" if kind == "previous_response_id" else "conv_nobody"
    for _ in range(2):
        r = mode.request("POST", "/v1/responses", json=_follow(nobody, kind))
        assert r.status == 501, r.body
        error = r.json()["error"]
        assert error["code"] == "stateful_routing_unsupported"
        # it says what happened (nobody holds it), not what to do instead
        assert "no worker holds" in error["message"], error
        assert nobody not in error["message"]
    assert _lookups(mocks, nobody, kind) == len(mocks)  # one round, not two
    assert sum(m.worker.stats.requests_total.get("/v1/responses", 0) for m in mocks) == 0
    assert mesh.total_load() == 0


@KINDS
def test_the_owner_down_is_502_not_a_move(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, kind: str
) -> None:
    mocks = _fleet(mock_factory)
    urls = [m.url for m in mocks]
    rid, owner = _first_turn(mesh_factory, urls, kind)
    # Killed, its port stays bound and refuses connections (MockWorkerThread.kill):
    # no other test's server can answer in its place.
    next(m for m in mocks if m.worker.config.name == owner).kill()
    mesh = mesh_factory(workers=urls, lifecycle={"probe": False})
    mode = run_mode(mesh)
    r = mode.request("POST", "/v1/responses", json=_follow(rid, kind))
    assert r.status == 502, r.body
    assert r.json()["error"]["code"] == "upstream_error"
    # the others were asked, and none was given the request
    assert _lookups(mocks, rid, kind) == len(mocks) - 1
    assert sum(m.worker.stats.requests_total.get("/v1/responses", 0) for m in mocks) == (
        1 if kind == "previous_response_id" else 0  # the first turn itself
    )
    assert mesh.affinity.owner(rid, mesh.clock()) is None
    assert mesh.total_load() == 0


def _sdk_turns(mode: Mode, conv_id: str, texts: list[str]) -> list[tuple[str, Any]]:
    """(worker, Response) of each turn, sent by ``mode``'s own openai client."""
    if isinstance(mode, AsyncTransportMode):
        aclient = mode.async_openai(max_retries=0)

        async def turns() -> list[tuple[str, Any]]:
            out = []
            for text in texts:
                r = await aclient.responses.with_raw_response.create(
                    model="m", input=text, conversation=conv_id
                )
                out.append((r.headers["x-mock-worker"], r.parse()))
            return out

        return mode.run(turns)  # type: ignore[no-any-return]
    client = mode.openai(max_retries=0)
    out = []
    for text in texts:
        r = client.responses.with_raw_response.create(model="m", input=text, conversation=conv_id)
        out.append((r.headers["x-mock-worker"], r.parse()))
    return out


def test_a_conversation_across_two_routers_with_the_openai_sdk(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory)
    urls = [m.url for m in mocks]
    one = TransportMode(mesh_factory(workers=urls, lifecycle={"probe": False}))
    mesh = mesh_factory(workers=urls, lifecycle={"probe": False})
    two = run_mode(mesh)
    try:
        first = one.openai(max_retries=0)
        raw = first.conversations.with_raw_response.create(
            items=[{"role": "user", "content": "one two three"}]
        )
        conv = raw.parse()
        owner = raw.headers["x-mock-worker"]
        # the router that created it knows its owner: it was in the answer
        assert one.mesh.affinity.owner(conv.id, one.mesh.clock()) is not None
        placed = _sdk_turns(two, conv.id, ["four", "five"])
        assert [worker for worker, _ in placed] == [owner, owner]
        turns = [t for _, t in placed]
        assert all(t.conversation is not None and t.conversation.id == conv.id for t in turns)
        # the owner prepended the conversation and appended each turn to it
        assert [t.usage.input_tokens for t in turns if t.usage] == [3 + 1, 3 + 1 + 8 + 1]
        assert 1 <= _lookups(mocks, conv.id, "conversation") <= len(mocks)  # the second's
        items = first.conversations.items.list(conv.id, order="asc")
        assert [i.type for i in items.data] == ["message"] * 5
        # conversation calls are counted as their own API, apart from Responses
        counted = generate_latest(one.mesh.metrics.registry).decode()
        assert 'mesh_router_requests_total{api="conversations",status="200"} 2.0' in counted
        assert 'api="responses"' not in counted
    finally:
        one.close()
    assert mesh.total_load() == 0


_OTHER_PROCESS = """
import json, sys, httpx2
from meshkit import Mesh, MeshTransport
path, body = sys.argv[1], json.loads(sys.argv[2])
with Mesh(workers=sys.argv[3:], lifecycle={"probe": False}) as mesh:
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as c:
        r = c.post(path, json=body)
        print(json.dumps({"id": r.json()["id"], "owner": r.headers["x-mock-worker"]}))
"""


@KINDS
def test_two_transports_in_two_processes(mock_factory: Any, kind: str) -> None:
    mocks = _fleet(mock_factory)
    urls = [m.url for m in mocks]
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, CREATE[kind], json.dumps(CREATE_BODY[kind]), *urls],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    first = json.loads(out.stdout.strip().splitlines()[-1])
    with Mesh(workers=urls, lifecycle={"probe": False}) as mesh:
        mode = TransportMode(mesh)
        try:
            r = mode.request("POST", "/v1/responses", json=_follow(first["id"], kind))
        finally:
            mode.close()
    assert r.status == 200, r.body
    assert r.headers["x-mock-worker"] == first["owner"]


@KINDS
def test_the_miss_is_remembered_for_its_ttl_only(mock_factory: Any, kind: str) -> None:
    mocks = _fleet(mock_factory)
    now = [1000.0]
    mesh = Mesh(
        workers=[m.url for m in mocks],
        lifecycle={"probe": False},
        routing={"responses_lookup_ttl_s": 30.0},
        clock=lambda: now[0],
    )
    mode = TransportMode(mesh)
    gone = "gone_1"
    try:

        def ask() -> int:
            return mode.request("POST", "/v1/responses", json=_follow(gone, kind)).status

        assert ask() == 501 and _lookups(mocks, gone, kind) == len(mocks)
        now[0] += 29.0
        assert ask() == 501 and _lookups(mocks, gone, kind) == len(mocks)  # remembered
        now[0] += 2.0
        assert ask() == 501 and _lookups(mocks, gone, kind) == 2 * len(mocks)  # asked again
    finally:
        mode.close()
        mesh.close()


@pytest.mark.not_in_extproc("resource operations are 501 unsupported_in_ext_proc (tests/extproc)")
@KINDS
def test_an_owner_found_by_a_resource_call_is_remembered(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, kind: str
) -> None:
    mocks = _fleet(mock_factory)
    # created on the last worker, the one a router asks last
    rid, owner = _first_turn(mesh_factory, [mocks[-1].url], kind)
    mesh = mesh_factory(workers=[m.url for m in mocks], lifecycle={"probe": False})
    mode = run_mode(mesh)
    path = (
        "/v1/responses/{}/input_items"
        if kind == "previous_response_id"
        else "/v1/conversations/{}/items"
    ).format(rid)

    def asked() -> list[int]:
        return [m.worker.stats.requests_total.get(path, 0) for m in mocks]

    first = mode.request("GET", path)
    assert first.status == 200, first.body
    assert first.headers["x-mock-worker"] == owner
    assert asked() == [1, 1, 1]  # the others answered 404 first
    again = mode.request("GET", path)
    assert again.status == 200, again.body
    assert asked() == [1, 1, 2]  # the owner only, now
    assert mesh.total_load() == 0


@KINDS
@pytest.mark.parametrize("rid", ["../etc", "resp 1", "résp", "a" * 257, "resp_1?x=2"])
def test_an_id_that_no_stored_object_can_have_is_refused_before_any_lookup(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, kind: str, rid: str
) -> None:
    # As the same id in a path is (docs/errors.md): 400, not a lookup on every
    # origin ending in 501.
    mocks = _fleet(mock_factory)
    mode = run_mode(mesh_factory(workers=[m.url for m in mocks], lifecycle={"probe": False}))
    r = mode.request("POST", "/v1/responses", json=_follow(rid, kind))
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_request", kind)
    assert sum(sum(m.worker.stats.requests_total.values()) for m in mocks) == 0
