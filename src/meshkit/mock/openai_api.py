"""
OpenAI Chat Completions and legacy Completions bodies
=====================================================

Non-stream bodies (``chat.completion`` / ``text_completion``) and the data-only SSE
chunk sequences (``chat.completion.chunk`` / ``text_completion``), ending with an
optional usage chunk (``choices: []``, when ``stream_options.include_usage``) and
``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

from meshkit.mock.turn import Event, Turn
from meshkit.mock.wire import sse_data

__all__ = ["DONE", "chat_body", "chat_events", "completion_body", "completion_events", "usage"]

DONE = b"data: [DONE]\n\n"


def usage(t: Turn) -> dict[str, Any]:
    """OpenAI ``CompletionUsage``."""
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.output_tokens,
        "total_tokens": t.prompt_tokens + t.output_tokens,
        "prompt_tokens_details": {"cached_tokens": t.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _finish(t: Turn) -> str:
    return "length" if t.truncated else "stop"


def _base(t: Turn, rid: str, obj: str) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": t.created,
        "model": t.model,
        "system_fingerprint": t.fingerprint,
    }


def chat_body(t: Turn, rid: str) -> dict[str, Any]:
    body = _base(t, rid, "chat.completion")
    body["choices"] = [
        {
            "index": 0,
            "message": {"role": "assistant", "content": t.text, "refusal": None},
            "logprobs": None,
            "finish_reason": _finish(t),
        }
    ]
    body["usage"] = usage(t)
    if t.rank is not None:
        body["mesh_dp_rank"] = t.rank
    return body


def completion_body(t: Turn, rid: str) -> dict[str, Any]:
    body = _base(t, rid, "text_completion")
    body["choices"] = [{"index": 0, "text": t.text, "logprobs": None, "finish_reason": _finish(t)}]
    body["usage"] = usage(t)
    if t.rank is not None:
        body["mesh_dp_rank"] = t.rank
    return body


def _chunks(
    t: Turn, rid: str, obj: str, choices: list[tuple[bool, dict[str, Any]]], include_usage: bool
) -> list[Event]:
    base = _base(t, rid, obj)
    if include_usage:
        base["usage"] = None
    events: list[Event] = []
    for is_token, choice in choices:
        base["choices"] = [choice]
        events.append((is_token, sse_data(base)))
    if include_usage:
        base["choices"] = []
        base["usage"] = usage(t)
        events.append((False, sse_data(base)))
    events.append((False, DONE))
    return events


def chat_events(t: Turn, rid: str, include_usage: bool) -> list[Event]:
    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    choices = [(False, choice({"role": "assistant", "content": ""}))]
    choices += [(True, choice({"content": piece})) for piece in t.pieces]
    choices.append((False, choice({}, _finish(t))))
    return _chunks(t, rid, "chat.completion.chunk", choices, include_usage)


def completion_events(t: Turn, rid: str, include_usage: bool) -> list[Event]:
    def choice(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    choices = [(True, choice(piece)) for piece in t.pieces]
    choices.append((False, choice("", _finish(t))))
    return _chunks(t, rid, "text_completion", choices, include_usage)
