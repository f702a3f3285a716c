"""``GET /v1/models`` and ``GET /v1/models/{model}`` with the real openai SDK, in
every mode: the mesh answers both from the union of its workers' lists (the id is
never forwarded), 404 ``model_not_found`` for a model no worker serves, and the
workers' own refusal when they all refuse the listing."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from harness import AsyncTransportMode, Mode, wait_until
from meshkit import Mesh, Worker


@pytest.fixture
def fleet(mock_factory: Any, mesh_factory: Any) -> tuple[Mesh, list[Any]]:
    mocks = [
        mock_factory(name="a", model="model-a"),
        mock_factory(name="b", model="org/model-b"),
        mock_factory(name="c", model="model-a"),
    ]
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks], lifecycle={"probe": False})
    return mesh, mocks


def _sdk_calls(mode: Mode, model: str) -> dict[str, Any]:
    """``models.list()`` and ``models.retrieve(model)`` with the sync or async SDK."""
    if isinstance(mode, AsyncTransportMode):
        client = mode.async_openai(max_retries=0)

        async def go() -> dict[str, Any]:
            listed = [m.id async for m in client.models.list()]
            try:
                got: Any = await client.models.retrieve(model)
            except openai.APIStatusError as exc:
                got = exc
            return {"listed": listed, "got": got}

        return mode.run(go)  # type: ignore[no-any-return]
    sync = mode.openai(max_retries=0)
    listed = [m.id for m in sync.models.list()]
    try:
        got: Any = sync.models.retrieve(model)
    except openai.APIStatusError as exc:
        got = exc
    return {"listed": listed, "got": got}


@pytest.mark.parametrize("model", ["model-a", "org/model-b"])
def test_openai_sdk_retrieves_a_model_of_the_union(
    fleet: tuple[Mesh, list[Any]], run_mode: Any, model: str
) -> None:
    mesh, mocks = fleet
    out = _sdk_calls(run_mode(mesh), model)
    assert sorted(out["listed"]) == ["model-a", "org/model-b"]
    got = out["got"]
    assert isinstance(got, openai.types.Model), got
    assert got.id == model
    assert got.object == "model"
    # the id was never forwarded: every worker saw the listing only
    for m in mocks:
        seen = m.worker.stats.requests_total
        assert not any(p.startswith("/v1/models/") for p in seen), seen
    assert wait_until(lambda: mesh.total_load() == 0)


def test_openai_sdk_unknown_model_is_404_model_not_found(
    fleet: tuple[Mesh, list[Any]], run_mode: Any
) -> None:
    mesh, _ = fleet
    got = _sdk_calls(run_mode(mesh), "no-such-model")["got"]
    assert isinstance(got, openai.NotFoundError), got
    assert got.status_code == 404
    assert got.code == "model_not_found"
    assert got.param == "model"
    assert "x-mock-worker" not in got.response.headers  # meshkit's own answer
    assert (
        mesh.metrics.registry.get_sample_value(
            "mesh_router_rejections_total", {"code": "model_not_found"}
        )
        == 1.0
    )
    assert wait_until(lambda: mesh.total_load() == 0)


def test_retrieve_relays_the_workers_refusal(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    keyed = mock_factory(name="k", api_key="right")
    mesh = mesh_factory(workers=[Worker(keyed.url)], lifecycle={"probe": False})
    mode = run_mode(mesh)
    r = mode.request("GET", "/v1/models/mock-model", headers={"authorization": "Bearer wrong"})
    assert r.status == 401
    assert r.headers["x-mock-worker"] == "k"
    r = mode.request("GET", "/v1/models/mock-model", headers={"authorization": "Bearer right"})
    assert r.status == 200
    assert r.json()["id"] == "mock-model"
    assert wait_until(lambda: mesh.total_load() == 0)


def test_a_model_list_over_the_capture_bound_is_a_502_not_a_shorter_list(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    """A worker's list is read whole (bounds.max_captured_body_bytes): one past the
    bound is refused, not silently left out of the union."""
    mocks = [mock_factory(name="a", model="model-a"), mock_factory(name="b", model="m" * 200)]
    mesh = mesh_factory(
        workers=[Worker(m.url) for m in mocks],
        lifecycle={"probe": False},
        bounds={"max_captured_body_bytes": 180},
    )
    r = run_mode(mesh).request("GET", "/v1/models")
    assert r.status == 502, r.body
    error = r.json()["error"]
    assert error["code"] == "upstream_error"
    assert "bounds.max_captured_body_bytes (180 bytes)" in error["message"]
    assert wait_until(lambda: mesh.total_load() == 0)
