"""Every mode takes the same decision for the same request and fleet state."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness import SERVER_MODES, wait_until
from meshkit import Worker

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def _fleet(mock_factory: Any, n: int = 3, **kw: Any) -> list[Any]:
    return [mock_factory(name=f"w{i}", **kw) for i in range(n)]


def test_round_robin_sequence_is_the_same_in_every_mode(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory)
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks], policy="round_robin")
    mode = run_mode(mesh)
    seen = []
    for _ in range(6):
        r = mode.request("POST", "/v1/chat/completions", json=CHAT)
        assert r.status == 200
        seen.append(r.headers["x-mock-worker"])
    assert seen == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert wait_until(lambda: mesh.total_load() == 0)


def _err(reply: Any) -> tuple[int, str | None]:
    body = reply.json()
    if body.get("type") == "error":  # Anthropic shape
        return reply.status, body["error"]["type"]
    return reply.status, body["error"]["code"]


REJECTIONS: list[Any] = [
    pytest.param("POST", "/v1/chat/completionz", CHAT, {}, (404, "unknown_endpoint"), id="404"),
    pytest.param("GET", "/v1/chat/completions", None, {}, (405, "method_not_allowed"), id="405"),
    pytest.param(
        "POST", "/v1/chat/completions", b"{not json", {}, (400, "invalid_request"), id="400-json"
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {"model": 3, "messages": []},
        {},
        (400, "invalid_request"),
        id="400-type",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        b"model=m",
        {"content-type": "text/plain"},
        (415, "unsupported_media_type"),
        id="415-type",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        CHAT,
        {"content-encoding": "gzip"},
        (415, "unsupported_media_type"),
        id="415-encoding",
    ),
    pytest.param(
        "POST",
        "/v1/messages",
        {"model": "m", "max_tokens": 5, "messages": []},
        {},
        (501, "invalid_request_error"),
        id="501-anthropic-shape",
    ),
    pytest.param(
        "POST",
        "/v1/responses",
        {"model": "m", "input": "hi", "previous_response_id": "resp_1"},
        {},
        (501, "stateful_routing_unsupported"),
        id="501-state",
    ),
    pytest.param(
        "POST",
        "/v1/responses",
        {"model": "m", "input": [{"id": "msg_1"}]},
        {},
        (501, "stateful_routing_unsupported"),
        id="501-bare-item-reference",
    ),
    pytest.param(
        "POST",
        "/v1/responses",
        {"model": "m", "input": "hi", "conversation": {"id": "conv_1"}},
        {},
        (501, "stateful_routing_unsupported"),
        id="501-conversation",
    ),
    pytest.param(
        "POST",
        "/v1/responses",
        {"model": "m", "input": "hi", "conversation": "conv_1", "previous_response_id": "r"},
        {},
        (400, "invalid_request"),
        id="400-conversation-and-previous",
    ),
    pytest.param(
        "GET", "/v1/responses/bad%2Fid", None, {}, (400, "invalid_request"), id="400-resource-id"
    ),
    pytest.param(
        "GET",
        "/v1/conversations/bad%2Fid/items",
        None,
        {},
        (400, "invalid_request"),
        id="400-conversation-id",
    ),
    pytest.param(
        "DELETE",
        "/v1/conversations/conv_1/items/a%2E%2E",
        None,
        {},
        (400, "invalid_request"),
        id="400-item-id",
    ),
    pytest.param(
        "GET",
        "/v1/conversations/conv_1/other",
        None,
        {},
        (404, "unknown_endpoint"),
        id="404-conversation-sub",
    ),
    pytest.param(
        "POST", "/v1/chat/completions", b"x" * 5000, {}, (413, "request_too_large"), id="413"
    ),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "expected"), REJECTIONS)
def test_rejections_are_the_same_in_every_mode(
    mock_factory: Any,
    mesh_factory: Any,
    run_mode: Any,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    expected: tuple[int, str],
) -> None:
    mocks = _fleet(mock_factory, 2, apis=frozenset({"chat", "completions", "responses"}))
    labels = {"mesh.apis": "chat,completions,responses"}
    mesh = mesh_factory(
        workers=[Worker(m.url, labels=labels) for m in mocks], bounds={"max_body_bytes": 4096}
    )
    mode = run_mode(mesh)
    kw: dict[str, Any] = {"headers": headers}
    if isinstance(body, bytes):
        kw["content"] = body
        kw["headers"] = {"content-type": "application/json", **headers}
    elif body is not None:
        kw["content"] = json.dumps(body).encode()
        kw["headers"] = {"content-type": "application/json", **headers}
    r = mode.request(method, path, **kw)
    assert _err(r) == expected
    assert all(m.worker.stats.requests_total.get(path, 0) == 0 for m in mocks)
    assert wait_until(lambda: mesh.total_load() == 0)


def test_no_healthy_worker_is_503_with_retry_hints(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory, 2)
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks])
    for w in mesh.workers:
        mesh.set_healthy(w, False)
    mode = run_mode(mesh)
    r = mode.request("POST", "/v1/chat/completions", json=CHAT)
    assert _err(r) == (503, "no_available_workers")
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert int(r.headers["retry-after-ms"]) > 0


def test_forwarded_bytes_credentials_and_dp_rank(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="dp", api_key="worker-secret", dp_size=2)
    mesh = mesh_factory(
        workers=[Worker(mock.url, api_key="worker-secret", labels={"mesh.dp_size": "2"})]
    )
    mode = run_mode(mesh)
    raw = b'{"model":"m",  "messages":[{"role":"user","content":"x"}],"temperature":1.7}'
    ranks = []
    for _ in range(2):
        r = mode.request(
            "POST",
            "/v1/chat/completions",
            content=raw,
            headers={
                "content-type": "application/json",
                "authorization": "Bearer client-secret",
                "x-api-key": "client-secret",
                "x-custom": "kept",
            },
        )
        assert r.status == 200, r.body
        stats = mock.worker.stats
        rank = stats.last_dp_rank
        ranks.append(rank)
        assert stats.last_body == raw[:-1] + b',"data_parallel_rank":' + str(rank).encode() + b"}"
        assert stats.last_header("x-data-parallel-rank") == str(rank)
        assert stats.last_header("authorization") == "Bearer worker-secret"
        assert stats.last_header("x-api-key") is None
        assert stats.last_header("x-custom") == "kept"
        assert "client-secret" not in str(stats.last_headers)
    assert sorted(ranks) == [0, 1]


def test_messages_carry_the_worker_key_in_both_headers(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="k", api_key="wk")
    mesh = mesh_factory(workers=[Worker(mock.url, api_key="wk")])
    mode = run_mode(mesh)
    r = mode.request(
        "POST",
        "/v1/messages",
        json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": "client", "anthropic-version": "2023-06-01"},
    )
    assert r.status == 200, r.body
    assert mock.worker.stats.last_header("x-api-key") == "wk"
    assert mock.worker.stats.last_header("authorization") == "Bearer wk"
    assert mock.worker.stats.last_header("anthropic-version") == "2023-06-01"


def test_stream_is_relayed_intact(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    mock = mock_factory(name="s", output_tokens=12)
    mesh = mesh_factory(workers=[Worker(mock.url)])
    mode = run_mode(mesh)
    req = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with mode.stream("POST", "/v1/chat/completions", json=req) as chunks:
        relayed = b"".join(chunks)
    events = [e for e in relayed.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in payloads if c["choices"])
    assert text.split() == [f"tok{i}" for i in range(12)]
    assert payloads[-1]["usage"]["completion_tokens"] == 12
    assert wait_until(lambda: mesh.total_load() == 0)


def test_disconnect_mid_stream_releases_the_load(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="slow", output_tokens=400, per_token_ms=20)
    mesh = mesh_factory(workers=[Worker(mock.url)])
    mode = run_mode(mesh)
    with mode.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as chunks:
        next(iter(chunks))
        assert mesh.total_load() == 1
    assert wait_until(lambda: mesh.total_load() == 0)
    assert wait_until(lambda: mock.worker.stats.active_streams == 0)
    assert wait_until(lambda: mock.worker.stats.disconnects == 1)


@pytest.mark.not_in_extproc(
    "Envoy sends a request to the one endpoint picked; it cannot move to another worker"
)
def test_a_killed_worker_is_routed_around(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory, 3)
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks])
    mode = run_mode(mesh)
    assert mode.request("POST", "/v1/chat/completions", json=CHAT).status == 200
    mocks[1].kill()
    served = [mode.request("POST", "/v1/chat/completions", json=CHAT) for _ in range(6)]
    assert [r.status for r in served] == [200] * 6
    assert {r.headers["x-mock-worker"] for r in served} == {"w0", "w2"}
    assert wait_until(lambda: mesh.total_load() == 0)


@pytest.mark.not_in_extproc(
    "Envoy sends a request to the one endpoint picked; it cannot move to another worker"
)
def test_retryable_status_moves_to_another_worker(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    bad = mock_factory(name="bad", error_rate=1.0, fail_status=503)
    good = mock_factory(name="good")
    mesh = mesh_factory(workers=[Worker(bad.url), Worker(good.url)])
    mode = run_mode(mesh)
    for _ in range(4):
        r = mode.request("POST", "/v1/chat/completions", json=CHAT)
        assert r.status == 200
        assert r.headers["x-mock-worker"] == "good"
    assert wait_until(lambda: mesh.total_load() == 0)


def test_last_worker_error_is_relayed_as_is(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    bad = mock_factory(name="bad", error_rate=1.0, fail_status=500)
    mesh = mesh_factory(workers=[Worker(bad.url)])
    mode = run_mode(mesh)
    r = mode.request("POST", "/v1/chat/completions", json=CHAT)
    assert r.status == 500
    assert r.headers["x-mock-worker"] == "bad"
    assert wait_until(lambda: mesh.total_load() == 0)


@pytest.mark.not_in_extproc("there is no wrapped app: other paths go to a worker (tests/extproc)")
def test_non_inference_paths_pass_through(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, mode_name: str
) -> None:
    mock = mock_factory(name="p")
    mesh = mesh_factory(workers=[Worker(mock.url)])
    mode = run_mode(mesh)
    r = mode.request("GET", "/health")
    if mode_name in SERVER_MODES:
        assert r.body == b"host app: /health"
    else:  # the transports send it to a healthy worker
        assert r.status == 200
        assert r.headers["x-mock-worker"] == "p"


def test_models_is_the_union_of_the_workers(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    a = mock_factory(name="a", model="model-a")
    b = mock_factory(name="b", model="model-b")
    c = mock_factory(name="c", model="model-a")
    mesh = mesh_factory(workers=[Worker(a.url), Worker(b.url), Worker(c.url)])
    mode = run_mode(mesh)
    r = mode.request("GET", "/v1/models")
    assert r.status == 200
    assert sorted(m["id"] for m in r.json()["data"]) == ["model-a", "model-b"]
    assert wait_until(lambda: mesh.total_load() == 0)


@pytest.mark.not_in_extproc("resource operations are 501 unsupported_in_ext_proc (tests/extproc)")
def test_responses_resource_operations(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    mocks = _fleet(mock_factory, 3)
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks])
    mode = run_mode(mesh)
    created = mode.request("POST", "/v1/responses", json={"model": "m", "input": "hi"})
    assert created.status == 200
    rid = created.json()["id"]
    owner = created.headers["x-mock-worker"]
    got = mode.request("GET", f"/v1/responses/{rid}?include[]=message.output_text.logprobs")
    assert got.status == 200
    assert got.json()["id"] == rid
    assert got.headers["x-mock-worker"] == owner
    items = mode.request("GET", f"/v1/responses/{rid}/input_items?limit=5&order=asc")
    assert items.status == 200
    assert items.json()["object"] == "list"
    owner_mock = next(m for m in mocks if m.worker.config.name == owner)
    assert (
        "limit=5" in owner_mock.worker.stats.last_query
        if hasattr(owner_mock.worker.stats, "last_query")
        else True
    )
    cancel = mode.request("POST", f"/v1/responses/{rid}/cancel")
    assert cancel.status == 400  # only background responses can be cancelled
    gone = mode.request("DELETE", f"/v1/responses/{rid}")
    assert gone.status == 200
    missing = mode.request("GET", f"/v1/responses/{rid}")
    assert _err(missing)[0] == 404
    assert wait_until(lambda: mesh.total_load() == 0)


@pytest.mark.not_in_extproc("resource operations are 501 unsupported_in_ext_proc (tests/extproc)")
def test_conversations_resource_operations(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory, 3)
    urls = [m.url for m in mocks]
    mesh = mesh_factory(workers=[Worker(u) for u in urls])
    mode = run_mode(mesh)
    created = mode.request(
        "POST",
        "/v1/conversations",
        json={"items": [{"role": "user", "content": "hi"}], "metadata": {"k": "v"}},
    )
    assert created.status == 200, created.body
    cid, owner = created.json()["id"], created.headers["x-mock-worker"]
    base = f"/v1/conversations/{cid}"

    def op(method: str, path: str, body: Any = None, status: int = 200) -> Any:
        r = mode.request(method, path, json=body)
        assert r.status == status, (method, path, r.body)
        assert r.headers["x-mock-worker"] == owner  # the owner only: affinity
        return r.json()

    assert op("GET", base)["metadata"] == {"k": "v"}
    assert op("POST", base, {"metadata": {"k": "w"}})["metadata"] == {"k": "w"}
    added = op("POST", base + "/items", {"items": [{"role": "user", "content": "more"}]})
    item_id = added["data"][0]["id"]
    listed = op("GET", base + "/items?order=asc&limit=5")
    assert [i["id"] for i in listed["data"]][-1] == item_id
    assert op("GET", f"{base}/items/{item_id}")["id"] == item_id
    assert op("DELETE", f"{base}/items/{item_id}")["id"] == cid
    op("GET", f"{base}/items/{item_id}", status=404)
    others = [m for m in mocks if m.worker.config.name != owner]
    assert not any(
        p.startswith("/v1/conversations/") for m in others for p in m.worker.stats.requests_total
    )

    # Another router over the same workers finds it by asking each origin in turn.
    other = run_mode(mesh_factory(workers=[Worker(u) for u in urls]))
    got = other.request("GET", base)
    assert got.status == 200 and got.headers["x-mock-worker"] == owner
    gone = other.request("DELETE", base)
    assert gone.json() == {"id": cid, "object": "conversation.deleted", "deleted": True}
    missing = op("GET", base, status=404)
    assert missing["error"]["param"] == "conversation_id"
    assert wait_until(lambda: mesh.total_load() == 0)


def test_a_conversation_follows_its_owner(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory, 3)
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks])
    mode = run_mode(mesh)
    created = mode.request("POST", "/v1/conversations", json={})
    assert created.status == 200, created.body
    cid, owner = created.json()["id"], created.headers["x-mock-worker"]
    for ref in (cid, {"id": cid}, cid):
        nxt = mode.request(
            "POST", "/v1/responses", json={"model": "m", "input": "more", "conversation": ref}
        )
        assert nxt.status == 200, nxt.body
        assert nxt.headers["x-mock-worker"] == owner
        assert nxt.json()["conversation"] == {"id": cid}
    # the answer that created it named its owner: nobody had to be asked
    assert all(m.worker.stats.requests_total.get(f"/v1/conversations/{cid}", 0) == 0 for m in mocks)
    assert wait_until(lambda: mesh.total_load() == 0)


def test_previous_response_id_follows_its_owner(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mocks = _fleet(mock_factory, 3)
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks])
    mode = run_mode(mesh)
    first = mode.request("POST", "/v1/responses", json={"model": "m", "input": "hi"})
    rid, owner = first.json()["id"], first.headers["x-mock-worker"]
    for _ in range(3):
        nxt = mode.request(
            "POST",
            "/v1/responses",
            json={"model": "m", "input": "more", "previous_response_id": rid},
        )
        assert nxt.status == 200, nxt.body
        assert nxt.headers["x-mock-worker"] == owner
