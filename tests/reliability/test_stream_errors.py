"""A worker's error event ends the client's stream, in every mode.

The engine reports an error in-band and then keeps the stream open (it may, until
its own timeout): meshkit relays the error event, ends the client's stream there,
releases the worker's load at once and records the outcome as an error, not a 200.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from rawworker import RawWorker

from harness import MODES, wait_until
from meshkit import Mesh

ANTHROPIC_ERROR = (
    b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
    b'"message":"engine overloaded"}}\n\n'
)
STREAMS = {
    "messages": (
        "/v1/messages",
        {"model": "m", "max_tokens": 8, "stream": True, "messages": []},
        [b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n', ANTHROPIC_ERROR],
    ),
    "chat": (
        "/v1/chat/completions",
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        [
            b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
            b'data: {"error":{"message":"engine failed","type":"server_error","code":"x"}}\n\n',
        ],
    ),
    "responses": (
        "/v1/responses",
        {"model": "m", "input": "hi", "stream": True},
        [
            b'event: response.created\ndata: {"type":"response.created",'
            b'"response":{"id":"resp_1"}}\n\n',
            b'event: response.failed\ndata: {"type":"response.failed","response":'
            b'{"id":"resp_1","error":{"code":"server_error","message":"no"}}}\n\n',
        ],
    ),
}


@pytest.fixture
def held() -> Iterator[threading.Event]:
    ev = threading.Event()
    yield ev
    ev.set()  # let the worker finish its bodies


def requests_with(mesh: Mesh, api: str, status: str) -> float:
    labels = {"api": api, "status": status}
    return mesh.metrics.registry.get_sample_value("mesh_router_requests_total", labels) or 0.0


@pytest.mark.parametrize("api", list(STREAMS))
def test_an_error_event_ends_the_stream_and_frees_the_worker(
    api: str, held: threading.Event, mesh_factory: Any, run_mode: Any
) -> None:
    path, body, chunks = STREAMS[api]
    worker = RawWorker(lambda: chunks, hold=held)
    try:
        mesh = mesh_factory(workers=[worker.url], lifecycle={"probe": False})
        mode = run_mode(mesh)
        with mode.stream("POST", path, json=body) as it:
            got = b"".join(it)
        # The client's stream ended while the worker still holds its body open.
        assert worker.ended == 0
        assert got.endswith(chunks[-1])
        assert mesh.total_load() == 0
        assert requests_with(mesh, api, "error") == 1
        assert requests_with(mesh, api, "200") == 0
    finally:
        held.set()
        worker.close()


@pytest.mark.parametrize("mode_name", [m for m in MODES if m != "async_transport"])
def test_the_anthropic_sdk_raises_at_the_error_event(
    held: threading.Event, mesh_factory: Any, run_mode: Any
) -> None:
    chunks = STREAMS["messages"][2]
    worker = RawWorker(lambda: chunks, hold=held)
    try:
        mesh = mesh_factory(workers=[worker.url], lifecycle={"probe": False})
        client = run_mode(mesh).anthropic(max_retries=0)
        with (
            pytest.raises(anthropic.APIStatusError, match="engine overloaded"),
            client.messages.stream(model="m", max_tokens=8, messages=[]) as s,
        ):
            list(s.text_stream)
        assert wait_until(lambda: mesh.total_load() == 0)
        assert worker.ended == 0
    finally:
        held.set()
        worker.close()
