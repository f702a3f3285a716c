"""The first output of a stream is the first token whatever kind of output it is
(PROTOCOLS.md section 2: the Responses event types; openai-python
``types/responses/*_delta_event.py``, ``types/chat/chat_completion_chunk.py``):
a Responses stream whose model writes a custom tool's input, an MCP call's
arguments, code for the code interpreter, a shell command or audio has a TTFT, as
a chat stream whose first output is a tool call has one."""

from __future__ import annotations

import json

import pytest

from meshkit.core.endpoints import StreamFormat
from meshkit.core.streams import StreamAccountant, Usage


def _ev(name: str, data: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


def _responses(delta_event: str, item_type: str) -> list[bytes]:
    resp = {"id": "resp_t", "status": "in_progress", "usage": None}
    done = {
        **resp,
        "status": "completed",
        "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13},
    }
    return [
        _ev("response.created", {"type": "response.created", "response": resp}),
        _ev(
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {"id": "it_1", "type": item_type},
            },
        ),
        _ev(delta_event, {"type": delta_event, "item_id": "it_1", "output_index": 0, "delta": "x"}),
        _ev("response.completed", {"type": "response.completed", "response": done}),
    ]


@pytest.mark.parametrize(
    ("delta_event", "item_type"),
    [
        ("response.custom_tool_call_input.delta", "custom_tool_call"),
        ("response.mcp_call_arguments.delta", "mcp_call"),
        ("response.code_interpreter_call_code.delta", "code_interpreter_call"),
        ("response.shell_call_command.delta", "shell_call"),
        ("response.audio.delta", "message"),
        ("response.audio.transcript.delta", "message"),
    ],
)
def test_a_responses_stream_of_tool_input_or_audio_has_a_first_token(
    delta_event: str, item_type: str
) -> None:
    acc = StreamAccountant(StreamFormat.RESPONSES, streaming=True, started_at=0.5)
    for i, chunk in enumerate(_responses(delta_event, item_type)):
        acc.feed(chunk, float(i + 1))
    acc.finish(9.0)
    assert acc.first_token_at == 3.0  # the feed that carried the delta
    assert acc.usage == Usage(9, 4)
    assert acc.done and acc.error is None


def test_tool_output_is_not_a_first_token() -> None:
    """What a tool (not the model) produced, e.g. a shell call's output, is not."""
    acc = StreamAccountant(StreamFormat.RESPONSES, streaming=True, started_at=0.5)
    for i, chunk in enumerate(_responses("response.shell_call_output_content.delta", "x")):
        acc.feed(chunk, float(i + 1))
    acc.finish(9.0)
    assert acc.first_token_at is None


def test_a_chat_stream_of_audio_has_a_first_token() -> None:
    """``delta.audio`` (``ChoiceDeltaAudio``: id, data, transcript) is output."""
    chunks = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"audio":{"id":"a1","data":"UklGR",'
        b'"transcript":"Hi"}}}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    acc = StreamAccountant(StreamFormat.OPENAI, streaming=True, started_at=0.5)
    for i, chunk in enumerate(chunks):
        acc.feed(chunk, float(i + 1))
    acc.finish(9.0)
    assert acc.first_token_at == 2.0
