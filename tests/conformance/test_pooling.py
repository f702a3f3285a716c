"""The pooling endpoints are placed like inference requests, in every mode."""

from __future__ import annotations

from typing import Any

import pytest

from harness import AsyncTransportMode
from meshkit import Mesh, Worker

POOLING = [
    pytest.param("/v1/embeddings", "embeddings", {"input": ["a b c", "d e"]}, id="embeddings"),
    pytest.param("/v1/rerank", "rerank", {"query": "q", "documents": ["x", "y z"]}, id="rerank"),
    pytest.param("/rerank", "rerank", {"query": "q", "documents": ["x"]}, id="rerank-bare"),
    pytest.param("/v2/rerank", "rerank", {"query": "q", "documents": ["x"]}, id="rerank-v2"),
    pytest.param("/v1/score", "score", {"text_1": "a", "text_2": ["b", "c"]}, id="score"),
    pytest.param("/score", "score", {"text_1": "a", "text_2": "b"}, id="score-bare"),
    pytest.param("/pooling", "pooling", {"input": "a b"}, id="pooling"),
    pytest.param("/classify", "classify", {"input": ["good", "bad"]}, id="classify"),
]


@pytest.fixture
def split(mock_factory: Any, mesh_factory: Any) -> Mesh:
    """A chat worker and a keyed pooling worker: each API has one place to go."""
    chat = mock_factory(name="chat", apis=frozenset({"chat"}))
    pool = mock_factory(
        name="pool",
        api_key="pk",
        apis=frozenset({"embeddings", "rerank", "score", "pooling", "classify"}),
    )
    labels = {"mesh.apis": "embeddings,rerank,score,pooling,classify"}
    return mesh_factory(  # type: ignore[no-any-return]
        workers=[
            Worker(chat.url, labels={"mesh.apis": "chat"}),
            Worker(pool.url, api_key="pk", labels=labels),
        ]
    )


@pytest.mark.parametrize(("path", "api", "body"), POOLING)
def test_a_pooling_request_goes_to_a_worker_that_serves_it(
    split: Mesh, run_mode: Any, path: str, api: str, body: dict[str, Any]
) -> None:
    mode = run_mode(split)
    sample = split.metrics.registry.get_sample_value
    before = sample("mesh_router_tokens_total", {"kind": "input"}) or 0.0
    for _ in range(3):
        r = mode.request(
            "POST", path, json={"model": "m", **body}, headers={"authorization": "Bearer client"}
        )
        assert r.status == 200, r.body
        assert r.headers["x-mock-worker"] == "pool"  # with the worker's key, not the client's
    assert sample("mesh_router_requests_total", {"api": api, "status": "200"}) == 3.0
    assert (sample("mesh_router_tokens_total", {"kind": "input"}) or 0.0) > before
    assert split.total_load() == 0


def test_the_openai_sdk_embeds_through_the_mesh(split: Mesh, run_mode: Any) -> None:
    mode = run_mode(split)
    if isinstance(mode, AsyncTransportMode):

        async def embed() -> Any:
            client = mode.async_openai(max_retries=0)
            return await client.embeddings.create(model="m", input=["hello world", "bye"])

        out = mode.run(embed)
    else:
        client = mode.openai(max_retries=0)
        out = client.embeddings.create(model="m", input=["hello world", "bye"])
    assert [d.index for d in out.data] == [0, 1]
    assert len(out.data[0].embedding) == 8
    assert out.usage.prompt_tokens > 0


def test_no_worker_for_a_pooling_api_is_a_501(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="chat")
    mesh = mesh_factory(workers=[Worker(mock.url, labels={"mesh.apis": "chat"})])
    r = run_mode(mesh).request("POST", "/v1/embeddings", json={"model": "m", "input": "x"})
    assert r.status == 501
    assert r.headers["x-should-retry"] == "false"
