"""A worker that dies in the middle of an event: the client's stream still ends
with one well-formed error event (docs/errors.md: "an upstream failure ends the
stream with one error event in the stream's own framing, so the SDK raises").

The half-sent event is never complete, so it is not relayed: glued in front of
meshkit's error event it would make one broken line (``data: {"choidata:
{"error":...}``), on which the openai SDK raises ``JSONDecodeError`` instead of
``APIError`` and the anthropic SDK fails to parse the error event.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from harness import MODES, wait_until

#: the sync SDKs: every mode but the async transport's
SDK_MODES = pytest.mark.parametrize("mode_name", [m for m in MODES if m != "async_transport"])

CHAT_EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    b'[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
)
MSG_EVENTS = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
    b'"type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":3,"output_tokens":1}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
)
RESP_EVENT = (
    b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_c",'
    b'"status":"in_progress"},"sequence_number":0}\n\n'
)
#: complete events, then half of the next one, per API; framed with LF or CRLF
CASES = {
    "chat": (
        "/v1/chat/completions",
        CHAT_EVENT,
        b'data: {"id":"c","object":"chat.completion.chunk","choi',
    ),
    "messages": (
        "/v1/messages",
        MSG_EVENTS,
        b'event: content_block_delta\ndata: {"type":"content_',
    ),
    "responses": ("/v1/responses", RESP_EVENT, b"event: response.output_text.delta\ndata: {"),
}
#: how meshkit's error event starts, per API (core.relay.stream_error_event)
ERROR_START = {
    "chat": b'data: {"error":',
    "messages": b'event: error\ndata: {"type":"error"',
    "responses": b'event: error\ndata: {"type":"error"',
}
BODIES = {
    "chat": {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    "messages": {"model": "m", "max_tokens": 8, "stream": True, "messages": []},
    "responses": {"model": "m", "input": "x", "stream": True},
}


class CutWorker:
    """Answers every POST with a chunked SSE body of ``body``, then closes the
    connection without ending the chunked body (a worker that died)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.served = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    got = conn.recv(65536)
                    if not got:
                        break
                    data += got
                head, _, rest = data.partition(b"\r\n\r\n")
                m = re.search(rb"content-length: *(\d+)", head, re.I)
                while m and len(rest) < int(m.group(1)):
                    rest += conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                    + b"%x\r\n%b\r\n"
                    % (len(self.body), self.body)
                )
                self.served += 1

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def cut() -> Iterator[list[CutWorker]]:
    made: list[CutWorker] = []
    yield made
    for w in made:
        w.close()


def _mesh(cut: list[CutWorker], mesh_factory: Any, body: bytes) -> Any:
    w = CutWorker(body)
    cut.append(w)
    return mesh_factory(workers=[w.url], lifecycle={"probe": False})


@pytest.mark.not_in_extproc(
    "Envoy carries the bytes: a worker cut mid-body is Envoy's reset, not meshkit's relay"
)
@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
@pytest.mark.parametrize("api", list(CASES))
def test_the_client_gets_the_whole_events_then_the_error_event(
    api: str, crlf: bool, cut: list[CutWorker], mesh_factory: Any, run_mode: Any
) -> None:
    path, whole, half = CASES[api]
    if crlf:
        whole, half = whole.replace(b"\n", b"\r\n"), half.replace(b"\n", b"\r\n")
    mesh = _mesh(cut, mesh_factory, whole + half)
    with run_mode(mesh).stream("POST", path, json=BODIES[api]) as chunks:
        got = b"".join(chunks)
    assert got.startswith(whole)
    tail = got[len(whole) :]
    assert b"upstream_error" in tail
    # One event of its own: nothing of the half event before it.
    assert tail.startswith(ERROR_START[api]), tail
    assert tail.endswith(b"\n\n") and tail.count(b"\n\n") == 1
    labels = {"api": api, "status": "cancelled"}
    sample = mesh.metrics.registry.get_sample_value
    assert wait_until(lambda: sample("mesh_router_requests_total", labels) == 1.0)


@pytest.mark.not_in_extproc(
    "Envoy carries the bytes: a worker cut mid-body is Envoy's reset, not meshkit's relay"
)
@SDK_MODES
def test_the_openai_sdk_raises_its_api_error(
    cut: list[CutWorker], mesh_factory: Any, run_mode: Any
) -> None:
    _, whole, half = CASES["chat"]
    client = run_mode(_mesh(cut, mesh_factory, whole + half)).openai(max_retries=0)
    seen: list[str | None] = []

    def read() -> None:
        for chunk in client.chat.completions.create(model="m", messages=[], stream=True):
            seen.append(chunk.choices[0].delta.content)

    with pytest.raises(openai.APIError) as caught:
        read()
    assert seen == ["Hi"]
    assert caught.value.code == "upstream_error"


@pytest.mark.not_in_extproc(
    "Envoy carries the bytes: a worker cut mid-body is Envoy's reset, not meshkit's relay"
)
@SDK_MODES
def test_the_anthropic_sdk_raises_its_status_error(
    cut: list[CutWorker], mesh_factory: Any, run_mode: Any
) -> None:
    _, whole, half = CASES["messages"]
    client = run_mode(_mesh(cut, mesh_factory, whole + half)).anthropic(max_retries=0)
    with (
        pytest.raises(anthropic.APIStatusError, match="the worker failed while streaming"),
        client.messages.stream(model="m", max_tokens=8, messages=[]) as s,
    ):
        list(s.text_stream)
