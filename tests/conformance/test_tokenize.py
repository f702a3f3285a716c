"""Preparation through every mode: tokenize endpoints, prefix hashing on tokens."""

from __future__ import annotations

from typing import Any

from harness import wait_until
from meshkit import Worker
from meshkit.demo import TOKENIZER

TINY = str(TOKENIZER / "tokenizer.json")


def test_tokenize_and_detokenize_are_answered_by_the_mesh(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="t")
    mesh = mesh_factory(workers=[Worker(mock.url)], tokenizer=TINY)
    mode = run_mode(mesh)
    tok = mode.request("POST", "/v1/tokenize", json={"prompt": "hello world hello"})
    assert tok.status == 200, tok.body
    body = tok.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert "max_model_len" in body
    back = mode.request("POST", "/detokenize", json={"tokens": body["tokens"]})
    assert back.status == 200
    assert "hello" in back.json()["prompt"]
    assert mock.worker.stats.requests_total.get("/v1/tokenize", 0) == 0
    assert mock.worker.stats.requests_total.get("/detokenize", 0) == 0


def test_tokenize_over_the_bound_is_413(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="t")
    mesh = mesh_factory(
        workers=[Worker(mock.url)], tokenizer=TINY, prepare={"max_tokenize_bytes": 1000}
    )
    mode = run_mode(mesh)
    r = mode.request("POST", "/v1/tokenize", json={"prompt": "word " * 400})
    assert r.status == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_without_a_tokenizer_a_worker_answers_tokenize(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="t")
    mesh = mesh_factory(workers=[Worker(mock.url)])
    mode = run_mode(mesh)
    r = mode.request("POST", "/v1/tokenize", json={"prompt": "a b c"})
    assert r.status == 200
    assert r.headers["x-mock-worker"] == "t"


def test_prefix_hash_on_tokens_agrees_across_modes_and_meshes(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = [mock_factory(name=f"w{i}") for i in range(4)]
    workers = [Worker(m.url) for m in mocks]
    # The ring alone: with the traffic-share plan (tests/core/policies/test_shares.py)
    # a tenant with 1/6 of these 18 requests is above its owner's cap, and its
    # new conversations (one per request here) would partly go to the pool.
    mesh = mesh_factory(
        workers=workers,
        policy="prefix_hash",
        policies={"prefix_hash": {"owner_share": 0}},
        tokenizer=TINY,
    )
    mode = run_mode(mesh)
    system = "you are a careful assistant " * 40
    placed: dict[int, set[str]] = {}
    for tenant in range(6):
        for turn in range(3):
            body = {
                "model": "m",
                "messages": [
                    {"role": "system", "content": f"tenant {tenant} {system}"},
                    {"role": "user", "content": f"question {turn}"},
                ],
            }
            r = mode.request("POST", "/v1/chat/completions", json=body)
            assert r.status == 200
            placed.setdefault(tenant, set()).add(r.headers["x-mock-worker"])
    # every turn of a tenant lands on one worker (nothing else is in flight)
    assert all(len(ws) == 1 for ws in placed.values())
    # the tenants do not all pile onto one worker
    assert len({next(iter(ws)) for ws in placed.values()}) > 1
    assert wait_until(lambda: mesh.total_load() == 0)
