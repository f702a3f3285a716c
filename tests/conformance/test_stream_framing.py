"""A worker's stream, in any SSE framing and cut into one-byte chunks, reaches the
client byte for byte, and the books count what the worker reported (PROTOCOLS.md
sections 1-4: usage in the last chat chunk with empty choices, Anthropic
message_start usage with cache tokens plus a cumulative message_delta,
Responses usage in the terminal event, SGLang's cumulative meta_info)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness import wait_until
from reliability.rawworker import RawWorker


def _j(o: Any) -> bytes:
    return json.dumps(o, separators=(",", ":")).encode()


def _data(o: Any, nl: bytes) -> bytes:
    return b"data: " + _j(o) + nl + nl


def _event(name: str, o: Any, nl: bytes) -> bytes:
    return b"event: " + name.encode() + nl + b"data: " + _j(o) + nl + nl


def chat(nl: bytes) -> bytes:
    def chunk(choices: list[Any], usage: Any = None) -> Any:
        return {"id": "c", "object": "chat.completion.chunk", "choices": choices, "usage": usage}

    usage = {
        "prompt_tokens": 11,
        "completion_tokens": 3,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    parts = [
        chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
        chunk([{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]),
        chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
        chunk([], usage),
    ]
    return b": comment" + nl + b"".join(_data(p, nl) for p in parts) + b"data: [DONE]" + nl + nl


def messages(nl: bytes) -> bytes:
    start_usage = {
        "input_tokens": 31,
        "cache_creation_input_tokens": 5,
        "cache_read_input_tokens": 100,
        "output_tokens": 1,
    }
    events = [
        (
            "message_start",
            {"type": "message_start", "message": {"id": "msg_1", "usage": start_usage}},
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "Hi"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 15},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return b"".join(_event(n, o, nl) for n, o in events)


def responses(nl: bytes) -> bytes:
    usage = {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 16},
        "output_tokens": 2,
        "total_tokens": 22,
    }
    events = [
        (
            "response.created",
            {"type": "response.created", "response": {"id": "resp_f", "status": "in_progress"}},
        ),
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"}),
        (
            "response.incomplete",
            {
                "type": "response.incomplete",
                "response": {"id": "resp_f", "status": "incomplete", "usage": usage},
            },
        ),
    ]
    return b"".join(_event(n, o, nl) for n, o in events)


def generate(nl: bytes) -> bytes:
    parts = [
        {
            "text": " Pa",
            "meta_info": {"prompt_tokens": 7, "completion_tokens": 1, "cached_tokens": 4},
        },
        {
            "text": " Paris",
            "meta_info": {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 4},
        },
    ]
    return b"".join(_data(p, nl) for p in parts) + b"data: [DONE]" + nl + nl


CASES = {
    "chat": (
        "/v1/chat/completions",
        {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}},
        chat,
        (11, 3, 4),
    ),
    "messages": (
        "/v1/messages",
        {"model": "m", "max_tokens": 8, "messages": [], "stream": True},
        messages,
        (136, 15, 100),
    ),
    "responses": (
        "/v1/responses",
        {"model": "m", "input": "x", "stream": True},
        responses,
        (20, 2, 16),
    ),
    "generate": ("/generate", {"text": "x", "stream": True}, generate, (7, 3, 4)),
}
FRAMINGS = {
    "lf": (b"\n", b""),
    "crlf": (b"\r\n", b""),
    "cr": (b"\r", b""),
    "bom": (b"\n", b"\xef\xbb\xbf"),
}


@pytest.mark.parametrize("framing", list(FRAMINGS))
@pytest.mark.parametrize("api", list(CASES))
def test_bytes_relayed_and_usage_counted(
    api: str, framing: str, mesh_factory: Any, run_mode: Any
) -> None:
    path, body, make, tokens = CASES[api]
    nl, bom = FRAMINGS[framing]
    stream = bom + make(nl)
    worker = RawWorker(lambda: [stream[i : i + 1] for i in range(len(stream))])
    try:
        mesh = mesh_factory(workers=[worker.url], lifecycle={"probe": False})
        with run_mode(mesh).stream("POST", path, json=body) as chunks:
            got = b"".join(chunks)
        assert got == stream
        sample = mesh.metrics.registry.get_sample_value
        labels = {"api": api, "status": "200"}
        assert wait_until(lambda: sample("mesh_router_requests_total", labels) == 1.0)
        counted = tuple(
            sample("mesh_router_tokens_total", {"kind": k}) for k in ("input", "output", "cached")
        )
        assert counted == tokens
        assert sample("mesh_router_ttft_seconds_count", {"api": api}) == 1.0
        assert not sample("mesh_router_streams_without_usage_total", {"api": api})
        assert not sample("mesh_router_stream_errors_total", {"api": api})
    finally:
        worker.close()
