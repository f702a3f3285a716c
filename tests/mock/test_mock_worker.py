"""Tests for meshkit.mock: every endpoint, the real SDKs, faults, cache and sleep models."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import anthropic
import httpx2
import openai
import pytest

from meshkit.mock import MockConfig, MockWorker, MockWorkerThread, run_mock_worker
from meshkit.mock.cache import PrefixCache
from meshkit.mock.tokens import prompt_tokens

if TYPE_CHECKING:
    from openai.types.responses import (
        ResponseCompletedEvent,
        ResponseCreatedEvent,
        ResponseInProgressEvent,
        ResponseQueuedEvent,
    )

PROMPT = " ".join(f"word{i}" for i in range(40))  # 40 tokens


# -- helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mock() -> Iterator[MockWorkerThread]:
    with MockWorkerThread(MockConfig(name="main", cache_tokens=4096)) as m:
        yield m


@pytest.fixture
def spawn() -> Iterator[Callable[..., MockWorkerThread]]:
    started: list[MockWorkerThread] = []

    def make(**kw: Any) -> MockWorkerThread:
        m = MockWorkerThread(MockConfig(**kw))
        m.start()
        started.append(m)
        return m

    yield make
    for m in started:
        m.stop()


@pytest.fixture
def http() -> Iterator[httpx2.Client]:
    with httpx2.Client(timeout=10) as c:
        yield c


def sse(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) pairs of an SSE body."""
    out: list[tuple[str | None, str]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name = None
        data = []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        out.append((name, "\n".join(data)))
    return out


def raw_http(url: str, payload: bytes, *, timeout: float = 5.0) -> bytes:
    """Send raw bytes, read until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(payload)
        chunks = []
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def oai(url: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", http_client=httpx2.Client(), **kw)


# -- OpenAI chat / completions ------------------------------------------------------------


def test_chat_non_stream(mock: MockWorkerThread, http: httpx2.Client) -> None:
    r = http.post(
        mock.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "a b c"}]},
    )
    assert r.status_code == 200
    assert r.headers["x-mock-worker"] == "main"
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-main-")
    assert body["model"] == "m1"
    assert body["system_fingerprint"] == "fp_mock_main"
    assert body["choices"][0]["message"]["content"] == "".join(f"tok{i} " for i in range(8))
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    r2 = http.post(mock.url + "/v1/chat/completions", json={"messages": [], "max_tokens": 2})
    assert r2.json()["id"] != body["id"]
    assert r2.json()["choices"][0]["finish_reason"] == "length"
    assert r2.json()["usage"]["completion_tokens"] == 2
    assert mock.worker.stats.last_path == "/v1/chat/completions"
    assert json.loads(mock.worker.stats.last_body)["max_tokens"] == 2


def test_chat_stream_raw(mock: MockWorkerThread, http: httpx2.Client) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x y"}]}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = http.post(mock.url + "/v1/chat/completions", json=body)
    assert r.headers["transfer-encoding"] == "chunked"
    assert r.headers["content-type"] == "text/event-stream"
    events = sse(r.text)
    assert all(name is None for name, _ in events)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" in c for c in chunks)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens"] == 2
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == "".join(f"tok{i} " for i in range(8))


def test_completions_stream_without_usage(mock: MockWorkerThread, http: httpx2.Client) -> None:
    r = http.post(mock.url + "/v1/completions", json={"prompt": "p q", "stream": True})
    chunks = [json.loads(d) for _, d in sse(r.text)[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(chunks) == 9


def test_openai_sdk_chat_and_completions(mock: MockWorkerThread) -> None:
    client = oai(mock.url)
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi there"}]
    )
    assert r.choices[0].message.content == "".join(f"tok{i} " for i in range(8))
    assert r.usage is not None
    assert r.usage.prompt_tokens == 2
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        else:
            usage = chunk.usage
    assert "".join(pieces).startswith("tok0 tok1")
    assert usage is not None
    assert usage.completion_tokens == 8
    assert usage.prompt_tokens_details is not None
    c = client.completions.create(model="m", prompt="one two three", max_tokens=3)
    assert c.choices[0].text == "tok0 tok1 tok2 "
    assert c.choices[0].finish_reason == "length"
    assert c.usage is not None
    assert c.usage.prompt_tokens == 3
    headers = dict(mock.worker.stats.last_headers)
    assert headers["authorization"] == "Bearer k"


# -- Anthropic -------------------------------------------------------------------------


def test_messages_raw_stream_sequence(mock: MockWorkerThread, http: httpx2.Client) -> None:
    body = {
        "model": "claude",
        "max_tokens": 100,
        "system": [{"type": "text", "text": "sys prompt"}],
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
    }
    events = sse(http.post(mock.url + "/v1/messages", json=body).text)
    names = [n for n, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 8,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for name, data in events:
        assert json.loads(data)["type"] == name
    start = json.loads(events[0][1])["message"]
    assert start["usage"]["input_tokens"] == 3
    assert start["usage"]["cache_read_input_tokens"] == 0
    delta = json.loads(events[-2][1])
    assert delta["usage"]["output_tokens"] == 8
    assert delta["delta"]["stop_reason"] == "end_turn"


def test_anthropic_sdk(mock: MockWorkerThread) -> None:
    client = anthropic.Anthropic(base_url=mock.url, api_key="ak")
    msg = client.messages.create(
        model="claude", max_tokens=5, messages=[{"role": "user", "content": "a b c d"}]
    )
    assert msg.content[0].type == "text"
    assert msg.content[0].text == "tok0 tok1 tok2 tok3 tok4 "
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.input_tokens == 4
    headers = dict(mock.worker.stats.last_headers)
    assert "ak" in (
        headers.get("x-api-key"),
        headers.get("authorization", "").removeprefix("Bearer "),
    )
    assert "anthropic-version" in headers
    with client.messages.stream(
        model="claude",
        max_tokens=100,
        system="be brief",
        messages=[{"role": "user", "content": "q"}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(f"tok{i} " for i in range(8))
    assert final.usage.output_tokens == 8
    assert final.usage.input_tokens == 3
    count = client.messages.count_tokens(
        model="claude", system="s t", messages=[{"role": "user", "content": "u v w"}]
    )
    assert count.input_tokens == 5


# -- Responses --------------------------------------------------------------------------


def test_responses_sdk_lifecycle(mock: MockWorkerThread) -> None:
    client = oai(mock.url)
    r = client.responses.create(model="m", input="first question", instructions="be nice")
    assert r.id.startswith("resp_")
    assert r.status == "completed"
    assert r.output_text == "".join(f"tok{i} " for i in range(8))
    assert r.usage is not None
    assert r.usage.input_tokens == 4
    got = client.responses.retrieve(r.id, include=["message.output_text.logprobs"])
    assert got.id == r.id
    assert got.output_text == r.output_text
    assert mock.worker.stats.last_path == f"/v1/responses/{r.id}"
    assert "include" in mock.worker.stats.last_query
    # a follow-up carries the previous context (2 input + 8 output + 1 new word)
    with client.responses.stream(model="m", input="again", previous_response_id=r.id) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    assert final.usage is not None
    assert final.usage.input_tokens == 11
    items = list(client.responses.input_items.list(final.id))
    assert len(items) == 1
    assert items[0].type == "message"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_responses_create_stream_events(mock: MockWorkerThread) -> None:
    client = oai(mock.url)
    events = list(client.responses.create(model="m", input="x", stream=True))
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 8,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = cast("ResponseCompletedEvent", events[-1]).response  # the types, as asserted
    assert final.usage is not None
    assert final.usage.input_tokens_details.cached_tokens == 0
    assert client.responses.retrieve(final.id).status == "completed"


def test_responses_raw_resources(mock: MockWorkerThread, http: httpx2.Client) -> None:
    url = mock.url + "/v1/responses"
    r = http.post(
        url, json={"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    )
    rid = r.json()["id"]
    items = http.get(f"{url}/{rid}/input_items", params={"order": "asc", "limit": 1}).json()
    assert items["object"] == "list"
    assert items["has_more"] is True
    assert items["first_id"] == items["last_id"] == items["data"][0]["id"]
    rest = http.get(f"{url}/{rid}/input_items", params={"order": "asc", "after": items["last_id"]})
    assert rest.json()["has_more"] is False
    assert len(rest.json()["data"]) == 1
    assert mock.worker.stats.last_query_params["after"] == [items["last_id"]]
    # replay as a stream, resuming after sequence number 3
    replay = sse(http.get(f"{url}/{rid}", params={"stream": "true", "starting_after": 3}).text)
    assert json.loads(replay[0][1])["sequence_number"] == 4
    assert replay[-1][0] == "response.completed"
    # only background responses can be cancelled
    assert http.post(f"{url}/{rid}/cancel").status_code == 400
    deleted = http.delete(f"{url}/{rid}").json()
    assert deleted == {"id": rid, "object": "response", "deleted": True}
    missing = http.get(f"{url}/{rid}")
    assert missing.status_code == 404
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    # previous_response_id from another worker → 404
    r = http.post(url, json={"input": "x", "previous_response_id": "resp_elsewhere"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"
    # store=false: nothing to retrieve
    rid2 = http.post(url, json={"input": "x", "store": False}).json()["id"]
    assert http.get(f"{url}/{rid2}").status_code == 404


def test_responses_background_cancel(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(first_token_ms=2000)
    url = m.url + "/v1/responses"
    r = http.post(url, json={"input": "x", "background": True})
    assert r.json()["status"] == "queued"
    rid = r.json()["id"]
    cancelled = http.post(f"{url}/{rid}/cancel").json()
    assert cancelled["status"] == "cancelled"
    assert http.get(f"{url}/{rid}").json()["status"] == "cancelled"


def test_a_background_response_is_queued_then_read_back_with_its_usage(
    spawn: Callable[..., MockWorkerThread],
) -> None:
    # As the API: the create answers "queued" without usage; polling the stored
    # response finds it ended, its usage on the completed object.
    m = spawn(output_tokens=5, first_token_ms=50)
    client = openai.OpenAI(base_url=m.url + "/v1", api_key="k", max_retries=0)
    created = client.responses.create(model="m", input="a b c", background=True)
    assert (created.status, created.background, created.usage) == ("queued", True, None)
    assert created.output == []
    seen = {created.status}
    deadline = time.monotonic() + 30
    got = client.responses.retrieve(created.id)
    while got.status in ("queued", "in_progress") and time.monotonic() < deadline:
        seen.add(got.status)
        time.sleep(0.01)
        got = client.responses.retrieve(created.id)
    assert got.status == "completed"
    assert seen <= {"queued", "in_progress"}
    assert got.background is True
    assert got.usage is not None
    assert (got.usage.input_tokens, got.usage.output_tokens) == (3, 5)
    assert got.output_text


def test_a_streamed_background_response_is_queued_first_and_streams_while_generating(
    spawn: Callable[..., MockWorkerThread],
) -> None:
    m = spawn(output_tokens=4, first_token_ms=1000)
    client = openai.OpenAI(base_url=m.url + "/v1", api_key="k", max_retries=0)
    # Streamed: created and queued (status queued), then in_progress, as the API.
    events = list(client.responses.create(model="m", input="a b", background=True, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    firsts = cast(
        "list[ResponseCreatedEvent | ResponseQueuedEvent | ResponseInProgressEvent]", events[:3]
    )
    assert [e.response.status for e in firsts] == ["queued", "queued", "in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Not streamed: a retrieve with stream=true while it generates streams it from
    # the start at its pace, to its usage (not the in-progress object as JSON).
    created = client.responses.create(model="m", input="a b c", background=True)
    assert created.status == "queued"
    assert client.responses.retrieve(created.id).status in ("queued", "in_progress")
    got = list(client.responses.retrieve(created.id, stream=True))
    assert got[0].type == "response.created"
    assert got[-1].type == "response.completed"
    final = got[-1].response
    assert final.usage is not None and final.usage.output_tokens == 4
    assert final.output_text
    # Resumed past an event: the rest only.
    again = list(client.responses.retrieve(created.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in again] == [e.sequence_number for e in got[3:]]


# -- SGLang / vLLM extras ------------------------------------------------------------------


def test_generate(mock: MockWorkerThread, http: httpx2.Client) -> None:
    url = mock.url + "/generate"
    body = http.post(
        url, json={"text": "a b c", "sampling_params": {"max_new_tokens": 3}, "rid": "r1"}
    ).json()
    assert body["text"] == "tok0 tok1 tok2 "
    assert len(body["output_ids"]) == 3
    meta = body["meta_info"]
    assert meta["id"] == "r1"
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 3, 0)
    body = http.post(url, json={"input_ids": [1, 2, 3, 4]}).json()
    assert body["meta_info"]["prompt_tokens"] == 4
    assert body["meta_info"]["finish_reason"]["type"] == "stop"
    batch = http.post(url, json={"text": ["a", "b c"]}).json()
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [1, 2]
    events = sse(http.post(url, json={"text": "a", "stream": True}).text)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert [c["text"] for c in chunks][:2] == ["tok0 ", "tok0 tok1 "]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_tokenize_detokenize(mock: MockWorkerThread, http: httpx2.Client) -> None:
    for prefix in ("", "/v1"):
        tok = http.post(mock.url + prefix + "/tokenize", json={"prompt": "hello big world"}).json()
        assert tok["count"] == 3
        assert len(tok["tokens"]) == 3
        assert tok["max_model_len"] > 0
        detok = http.post(mock.url + prefix + "/detokenize", json={"tokens": tok["tokens"]}).json()
        assert detok == {"prompt": "hello big world"}
    chat = http.post(
        mock.url + "/tokenize", json={"messages": [{"role": "user", "content": "x y"}]}
    ).json()
    assert chat["count"] == 2


def test_probe_endpoints(mock: MockWorkerThread, http: httpx2.Client) -> None:
    health = http.get(mock.url + "/health")
    assert health.status_code == 200
    assert health.content == b""
    assert health.headers["x-mock-worker"] == "main"
    models = http.get(mock.url + "/v1/models").json()
    assert models == {
        "object": "list",
        "data": [{"id": "mock-model", "object": "model", "created": 0, "owned_by": "meshkit-mock"}],
    }
    for path in ("/model_info", "/server_info", "/version"):
        r = http.get(mock.url + path)
        assert r.status_code == 200
        assert isinstance(r.json(), dict)
    metrics = http.get(mock.url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "vllm:num_requests_running" in metrics.text
    assert 'meshkit_mock_requests_total{path="/health"}' in metrics.text
    assert http.get(mock.url + "/nope").status_code == 404
    assert http.get(mock.url + "/v1/chat/completions").status_code == 405
    assert mock.worker.stats.requests_total["/health"] >= 1


def test_bad_json_is_400_in_each_shape(mock: MockWorkerThread, http: httpx2.Client) -> None:
    r = http.post(mock.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = http.post(mock.url + "/v1/messages", content=b"[1]")
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("documents", [3.5, 2**63, {"text": "a"}, "a"])
def test_rerank_documents_not_a_list_is_400(
    mock: MockWorkerThread, http: httpx2.Client, documents: object
) -> None:
    r = http.post(mock.url + "/v1/rerank", json={"query": "q", "documents": documents})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "documents"
    for good in (["a", "b"], {"content": ["a", "b"]}):  # vLLM's multimodal form too
        ok = http.post(mock.url + "/v1/rerank", json={"query": "q", "documents": good})
        assert ok.status_code == 200 and len(ok.json()["results"]) == 2


# -- HTTP layer -----------------------------------------------------------------------


def test_pipelining_chunked_body_and_expect(mock: MockWorkerThread) -> None:
    body = b'{"prompt": "a b"}'
    first = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
        b"expect: 100-continue\r\nconnection: close\r\n\r\n"
        b"5\r\n" + body[:5] + b"\r\n" + b"%x\r\n" % (len(body) - 5) + body[5:] + b"\r\n0\r\n\r\n"
    )
    data = raw_http(mock.url, first + chunked)
    assert data.count(b"HTTP/1.1 200 OK") == 2
    assert data.count(b'"prompt_tokens":2') == 2
    assert b"connection: close" in data
    # the interim 100 Continue of the second request comes after the first answer
    first_end = data.index(b"HTTP/1.1 200 OK", 1)
    assert data.index(b"HTTP/1.1 100 Continue") < first_end
    assert data.index(b"HTTP/1.1 100 Continue") > data.index(b"x-mock-worker")


def test_malformed_request_is_400(mock: MockWorkerThread) -> None:
    data = raw_http(mock.url, b"NOT A REQUEST\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400 Bad Request")
    assert b"x-mock-worker: main" in data


def test_adapters_load_and_unload_at_run_time_as_in_vllm(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(model="base")

    def listed() -> list[str]:
        return [card["id"] for card in http.get(m.url + "/v1/models").json()["data"]]

    load, unload = m.url + "/v1/load_lora_adapter", m.url + "/v1/unload_lora_adapter"
    r = http.post(load, json={"lora_name": "ad1", "lora_path": "/adapters/ad1"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'ad1' added successfully.")
    assert listed() == ["base", "ad1"]
    again = http.post(load, json={"lora_name": "ad1", "lora_path": "/adapters/ad1"})
    assert again.status_code == 400 and "already been loaded" in again.text
    assert http.post(load, json={"lora_name": "ad2"}).status_code == 400  # no path
    r = http.post(unload, json={"lora_name": "ad1"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'ad1' removed successfully.")
    assert listed() == ["base"]
    assert http.post(unload, json={"lora_name": "ad1"}).status_code == 404


def test_http10_and_connection_close(mock: MockWorkerThread) -> None:
    data = raw_http(mock.url, b"GET /v1/models HTTP/1.0\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200 OK")
    assert b"connection: close" in data
    assert data.endswith(b"}]}")


def test_streams_pipeline_in_order(spawn: Callable[..., MockWorkerThread]) -> None:
    m = spawn(per_token_ms=5, output_tokens=3)
    one = b'{"prompt": "a", "stream": true}'
    req = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (
        len(one),
        one,
    )
    last = req.replace(b"host: x\r\n", b"host: x\r\nconnection: close\r\n")
    data = raw_http(m.url, req + last)
    assert data.count(b"HTTP/1.1 200 OK") == 2
    assert data.count(b"data: [DONE]") == 2
    assert data.index(b"data: [DONE]") < data.rindex(b"HTTP/1.1 200 OK")


# -- auth, apis, dp rank ----------------------------------------------------------------


def test_api_key(spawn: Callable[..., MockWorkerThread], http: httpx2.Client) -> None:
    m = spawn(api_key="secret")
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10}
    r = http.post(m.url + "/v1/chat/completions", json=body)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = http.post(m.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    ok_bearer = {"authorization": "Bearer secret"}
    assert (
        http.post(m.url + "/v1/chat/completions", json=body, headers=ok_bearer).status_code == 200
    )
    assert (
        http.post(m.url + "/v1/messages", json=body, headers={"x-api-key": "secret"}).status_code
        == 200
    )
    assert http.get(m.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        oai(m.url, max_retries=0).models.list()
    assert openai.OpenAI(
        base_url=m.url + "/v1", api_key="secret", http_client=httpx2.Client()
    ).models.list()


def test_apis_restriction(spawn: Callable[..., MockWorkerThread], http: httpx2.Client) -> None:
    m = spawn(apis=frozenset({"chat", "models"}))
    assert http.post(m.url + "/v1/chat/completions", json={"messages": []}).status_code == 200
    assert http.post(m.url + "/v1/completions", json={"prompt": "x"}).status_code == 404
    r = http.post(m.url + "/v1/messages", json={"messages": []})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
    assert http.post(m.url + "/v1/responses", json={"input": "x"}).status_code == 404
    assert http.get(m.url + "/v1/responses/resp_1").status_code == 404
    assert http.post(m.url + "/generate", json={"text": "x"}).status_code == 404
    assert http.post(m.url + "/tokenize", json={"prompt": "x"}).status_code == 404
    assert http.get(m.url + "/v1/models").status_code == 200
    with pytest.raises(ValueError, match="unknown apis"):
        MockConfig(apis=frozenset({"chatt"}))


def test_dp_rank(spawn: Callable[..., MockWorkerThread], http: httpx2.Client) -> None:
    m = spawn(dp_size=4, name="dp")
    url = m.url + "/v1/completions"
    r = http.post(url, json={"prompt": "x", "data_parallel_rank": 2})
    assert r.json()["mesh_dp_rank"] == 2
    assert r.headers["x-mock-dp-rank"] == "2"
    r = http.post(url, json={"prompt": "x"}, headers={"X-data-parallel-rank": "3"})
    assert r.json()["mesh_dp_rank"] == 3
    assert m.worker.stats.last_dp_rank == 3
    r = http.post(url, json={"prompt": "x"})
    assert "mesh_dp_rank" not in r.json()
    assert "x-mock-dp-rank" not in r.headers
    assert http.post(url, json={"prompt": "x", "data_parallel_rank": 4}).status_code == 400
    assert (
        http.post(url, json={"prompt": "x"}, headers={"x-data-parallel-rank": "9"}).status_code
        == 400
    )
    r = http.post(m.url + "/generate", json={"text": "x", "data_parallel_rank": 1})
    assert r.json()["mesh_dp_rank"] == 1


# -- cache model ----------------------------------------------------------------------


def test_prefix_cache_across_apis(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(cache_tokens=1024)
    chat = {"messages": [{"role": "user", "content": PROMPT}]}
    first = http.post(m.url + "/v1/chat/completions", json=chat).json()["usage"]
    second = http.post(m.url + "/v1/chat/completions", json=chat).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 32  # 2 full blocks of 16
    msg = {"max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]}
    usage = http.post(m.url + "/v1/messages", json=msg).json()["usage"]
    assert usage["cache_read_input_tokens"] == 32
    assert usage["input_tokens"] == 8
    resp = http.post(m.url + "/v1/responses", json={"input": PROMPT}).json()
    assert resp["usage"]["input_tokens_details"]["cached_tokens"] == 32
    gen = http.post(m.url + "/generate", json={"text": PROMPT}).json()
    assert gen["meta_info"]["cached_tokens"] == 32
    assert m.worker.stats.cached_tokens_total == 4 * 32


def test_prefix_cache_capacity() -> None:
    cache = PrefixCache(capacity_tokens=32, block_size=16)
    tokens = prompt_tokens(" ".join(str(i) for i in range(100)))
    hashes = cache.block_hashes(tokens)
    assert len(hashes) == 6
    assert cache.lookup(hashes, len(tokens)) == 0
    cache.insert(hashes)
    assert cache.used_tokens == 32
    assert cache.lookup(hashes, len(tokens)) == 32  # the shared prefix survives
    other = cache.block_hashes(prompt_tokens(" ".join(f"x{i}" for i in range(48))))
    cache.insert(other)
    assert cache.lookup(hashes, len(tokens)) == 0
    assert cache.used_tokens <= 32
    # a full-block prompt never counts its last block as cached
    exact = cache.block_hashes(tokens[:32])
    cache.insert(exact)
    assert cache.lookup(exact, 32) == 16


def test_cache_capacity_on_worker(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(cache_tokens=16)
    body = {"prompt": PROMPT}
    http.post(m.url + "/v1/completions", json=body)
    usage = http.post(m.url + "/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 16


# -- sleep, errors, delays ----------------------------------------------------------------


def test_sleep_mode(spawn: Callable[..., MockWorkerThread], http: httpx2.Client) -> None:
    m = spawn(sleep_mode=True, wake_ms=100, cache_tokens=1024)
    body = {"prompt": PROMPT}
    http.post(m.url + "/v1/completions", json=body)
    assert http.get(m.url + "/is_sleeping").json() == {"is_sleeping": False}
    r = http.post(m.url + "/sleep", params={"level": 1, "mode": "wait"})
    assert r.status_code == 200
    assert r.content == b""
    assert http.get(m.url + "/is_sleeping").json() == {"is_sleeping": True}
    stats = m.worker.stats
    assert (stats.sleep_calls, stats.last_sleep_level, stats.last_sleep_mode) == (1, 1, "wait")
    r = http.post(m.url + "/v1/completions", json=body)
    assert r.status_code == 503
    assert "sleeping" in r.json()["error"]["message"]
    assert http.get(m.url + "/health").status_code == 200
    t0 = time.monotonic()
    assert http.post(m.url + "/wake_up").status_code == 200
    assert time.monotonic() - t0 >= 0.09
    assert stats.wake_calls == 1
    assert http.get(m.url + "/is_sleeping").json() == {"is_sleeping": False}
    usage = http.post(m.url + "/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # level 1 dropped the cache


def test_sleep_endpoints_absent_without_sleep_mode(
    mock: MockWorkerThread, http: httpx2.Client
) -> None:
    assert http.post(mock.url + "/sleep").status_code == 404
    assert http.get(mock.url + "/is_sleeping").status_code == 404


def test_error_rate(spawn: Callable[..., MockWorkerThread], http: httpx2.Client) -> None:
    m = spawn(error_rate=1.0, fail_status=503)
    r = http.post(m.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "server_error"
    r = http.post(m.url + "/v1/messages", json={"messages": []})
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "overloaded_error"
    assert http.post(m.url + "/tokenize", json={"prompt": "x"}).status_code == 200
    assert m.worker.stats.injected_errors == 2
    half = spawn(error_rate=0.5, seed=7)
    codes = [
        http.post(half.url + "/v1/completions", json={"prompt": "x"}).status_code for _ in range(40)
    ]
    assert 5 < codes.count(500) < 35


def test_latency_model(spawn: Callable[..., MockWorkerThread], http: httpx2.Client) -> None:
    m = spawn(first_token_ms=100, per_token_ms=20, output_tokens=4)
    t0 = time.monotonic()
    http.post(m.url + "/v1/completions", json={"prompt": "x"})
    assert time.monotonic() - t0 >= 0.15  # 100 + 3 * 20 ms
    arrivals = []
    with http.stream("POST", m.url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        t0 = time.monotonic()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic() - t0)
    assert arrivals[0] >= 0.09
    assert arrivals[-1] - arrivals[0] >= 0.05


# -- crashes, disconnects, kill -----------------------------------------------------------


def test_crash_after_chunks(spawn: Callable[..., MockWorkerThread], http: httpx2.Client) -> None:
    m = spawn(crash_after_chunks=3)
    payload = b'{"messages": [], "stream": true}'
    data = raw_http(
        m.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
        % (len(payload), payload),
    )
    assert data.startswith(b"HTTP/1.1 200 OK")
    assert data.count(b"data: ") == 3
    assert not data.endswith(b"0\r\n\r\n")
    stream_body = {"prompt": "x", "stream": True}
    with (
        pytest.raises(httpx2.HTTPError),
        http.stream("POST", m.url + "/v1/completions", json=stream_body) as r,
    ):
        for _ in r.iter_bytes():
            pass
    assert m.worker.stats.crashes == 2
    assert m.worker.stats.disconnects == 0
    assert http.post(m.url + "/v1/completions", json={"prompt": "x"}).status_code == 200


def test_disconnect_counted(spawn: Callable[..., MockWorkerThread]) -> None:
    m = spawn(per_token_ms=50, output_tokens=100)
    stats = m.worker.stats
    host, port = m.url.removeprefix("http://").split(":")
    payload = b'{"prompt": "x", "stream": true}'
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
            % (len(payload), payload)
        )
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        wait_for(lambda: stats.active_streams == 1)
    wait_for(lambda: stats.disconnects == 1 and stats.active_streams == 0)
    assert stats.in_flight == 0


def test_kill_and_restart_same_port(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(name="k", per_token_ms=50, output_tokens=50)
    url = m.url
    assert http.get(url + "/health").status_code == 200
    rid = http.post(url + "/v1/responses", json={"input": "x", "max_output_tokens": 1}).json()["id"]
    with http.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        m.kill()
        with pytest.raises(httpx2.HTTPError):
            for _ in lines:
                pass
    with pytest.raises(httpx2.ConnectError):
        http.get(url + "/health")
    m.restart()
    assert m.url == url
    r = http.get(url + "/health")
    assert r.status_code == 200
    assert r.headers["x-mock-worker"] == "k"
    assert http.get(f"{url}/v1/responses/{rid}").status_code == 404  # state died with it
    m.kill()
    m.kill()  # idempotent
    m.start()
    assert http.get(url + "/health").status_code == 200


def test_a_killed_worker_keeps_its_port(spawn: Callable[..., MockWorkerThread]) -> None:
    """Killed, the port stays bound and refuses connections, so no other server
    (another pytest-xdist worker's) is given it and answers in the worker's place."""
    m = spawn(name="k")
    port = m.worker.port
    m.kill()  # no connection was open: nothing else holds the port
    taker = socket.socket()
    taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with taker, pytest.raises(OSError) as taken:
        taker.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    m.restart()
    assert m.worker.port == port
    with httpx2.Client(trust_env=False) as http:
        assert http.get(m.url + "/health").status_code == 200


def test_async_worker_api() -> None:
    async def main() -> None:
        async with MockWorker(MockConfig(name="a")) as worker:
            assert worker.running
            assert worker.url.startswith("http://127.0.0.1:")
            reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            data = await reader.read()
            writer.close()
            assert data.startswith(b"HTTP/1.1 200 OK")
            port = worker.port
            worker.kill()
            await worker.start()
            assert worker.port == port
        assert not worker.running

    asyncio.run(main())


# -- CLI ---------------------------------------------------------------------------------


def test_cli_runs_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshkit.mock",
            "--port",
            "0",
            "--name",
            "cli",
            "--apis",
            "chat,models",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.rsplit(" ", 1)[-1].strip()
        assert "cli" in line
        assert url.startswith("http://127.0.0.1:")
        with httpx2.Client() as c:
            assert c.get(url + "/v1/models").status_code == 200
            assert c.post(url + "/generate", json={"text": "x"}).status_code == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()


def test_cli_rejects_bad_config() -> None:
    with pytest.raises(SystemExit):
        run_mock_worker(["--apis", "bogus"])
