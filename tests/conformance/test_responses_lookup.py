"""A Responses follow-up through a router that did not place the first turn
(issue 17, item 5): it asks the origins once (``GET /v1/responses/{id}``), remembers
the owner, routes there; 501 when nobody holds the id, 502 when the owner is down.
In every mode, and through two transports in two processes (two gateways:
tests/server/test_serve_responses_lookup.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from harness import TransportMode
from meshkit import Mesh, Worker
from meshkit.mock import MockWorkerThread

FIRST = {"model": "m", "input": "hello"}


def _follow(rid: str) -> dict[str, Any]:
    return {"model": "m", "input": "and then?", "previous_response_id": rid}


def _lookups(mocks: list[MockWorkerThread], rid: str) -> int:
    return sum(m.worker.stats.requests_total.get(f"/v1/responses/{rid}", 0) for m in mocks)


def _fleet(mock_factory: Callable[..., MockWorkerThread]) -> list[MockWorkerThread]:
    return [mock_factory(name=f"w{i}") for i in range(3)]


def _first_turn(mesh_factory: Any, urls: list[str]) -> tuple[str, str]:
    """The first turn, placed by a router of its own: (response id, its worker)."""
    router = TransportMode(mesh_factory(workers=urls, lifecycle={"probe": False}))
    try:
        created = router.request("POST", "/v1/responses", json=FIRST)
    finally:
        router.close()
    return created.json()["id"], created.headers["x-mock-worker"]


def test_a_follow_up_through_another_router_finds_its_owner(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory)
    urls = [m.url for m in mocks]
    rid, owner = _first_turn(mesh_factory, urls)
    mesh = mesh_factory(workers=[Worker(u) for u in urls], lifecycle={"probe": False})
    mode = run_mode(mesh)  # a second router: it never saw the first turn
    for _ in range(3):
        nxt = mode.request("POST", "/v1/responses", json=_follow(rid))
        assert nxt.status == 200, nxt.body
        assert nxt.headers["x-mock-worker"] == owner
    # asked once, stopping at the owner; then remembered
    assert 1 <= _lookups(mocks, rid) <= len(mocks)
    assert mesh.affinity.owner(rid, mesh.clock()) is not None
    assert mesh.total_load() == 0


def test_an_id_nobody_holds_is_501_and_asked_once(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory)
    mesh = mesh_factory(workers=[m.url for m in mocks], lifecycle={"probe": False})
    mode = run_mode(mesh)
    for _ in range(2):
        r = mode.request("POST", "/v1/responses", json=_follow("resp_nobody"))
        assert r.status == 501, r.body
        assert r.json()["error"]["code"] == "stateful_routing_unsupported"
    assert _lookups(mocks, "resp_nobody") == len(mocks)  # one round, not two
    assert mesh.total_load() == 0


def test_the_owner_down_is_502_not_a_move(mock_factory: Any, mesh_factory: Any) -> None:
    mocks = _fleet(mock_factory)
    urls = [m.url for m in mocks]
    rid, owner = _first_turn(mesh_factory, urls)
    next(m for m in mocks if m.worker.config.name == owner).kill()
    mode = TransportMode(mesh_factory(workers=urls, lifecycle={"probe": False}))
    try:
        r = mode.request("POST", "/v1/responses", json=_follow(rid))
    finally:
        mode.close()
    assert r.status == 502, r.body
    assert r.json()["error"]["code"] == "upstream_error"


_OTHER_PROCESS = """
import json, sys, httpx2
from meshkit import Mesh, MeshTransport
with Mesh(workers=sys.argv[1:], lifecycle={"probe": False}) as mesh:
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as c:
        r = c.post("/v1/responses", json={"model": "m", "input": "hello"})
        print(json.dumps({"id": r.json()["id"], "owner": r.headers["x-mock-worker"]}))
"""


def test_two_transports_in_two_processes(mock_factory: Any) -> None:
    mocks = _fleet(mock_factory)
    urls = [m.url for m in mocks]
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, *urls],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    first = json.loads(out.stdout.strip().splitlines()[-1])
    with Mesh(workers=urls, lifecycle={"probe": False}) as mesh:
        mode = TransportMode(mesh)
        try:
            r = mode.request("POST", "/v1/responses", json=_follow(first["id"]))
        finally:
            mode.close()
    assert r.status == 200, r.body
    assert r.headers["x-mock-worker"] == first["owner"]


def test_the_miss_is_remembered_for_its_ttl_only(mock_factory: Any) -> None:
    mocks = _fleet(mock_factory)
    now = [1000.0]
    mesh = Mesh(
        workers=[m.url for m in mocks],
        lifecycle={"probe": False},
        routing={"responses_lookup_ttl_s": 30.0},
        clock=lambda: now[0],
    )
    mode = TransportMode(mesh)
    try:
        ask = lambda: mode.request("POST", "/v1/responses", json=_follow("resp_gone")).status  # noqa: E731
        assert ask() == 501 and _lookups(mocks, "resp_gone") == len(mocks)
        now[0] += 29.0
        assert ask() == 501 and _lookups(mocks, "resp_gone") == len(mocks)  # remembered
        now[0] += 2.0
        assert ask() == 501 and _lookups(mocks, "resp_gone") == 2 * len(mocks)  # asked again
    finally:
        mode.close()
        mesh.close()
