"""
Anthropic Messages bodies
=========================

The non-stream ``message`` and the named-event stream (``message_start``,
``content_block_start``, ``ping``, ``content_block_delta`` (one per token),
``content_block_stop``, ``message_delta``, ``message_stop``).

Usage: ``input_tokens`` = uncached prompt tokens, ``cache_read_input_tokens`` =
cached ones, ``cache_creation_input_tokens`` = 0 (the mock does not model explicit
``cache_control`` writes), so their sum is the prompt size.
"""

from __future__ import annotations

from typing import Any

from meshkit.mock.turn import Event, Turn
from meshkit.mock.wire import sse_event

__all__ = ["message_body", "message_events", "usage"]


def usage(t: Turn, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": t.uncached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": t.cached_tokens,
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def _stop_reason(t: Turn) -> str:
    return "max_tokens" if t.truncated else "end_turn"


def message_body(t: Turn, mid: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": t.model,
        "content": [{"type": "text", "text": t.text}],
        "stop_reason": _stop_reason(t),
        "stop_sequence": None,
        "usage": usage(t, t.output_tokens),
    }
    if t.rank is not None:
        body["mesh_dp_rank"] = t.rank
    return body


def message_events(t: Turn, mid: str) -> list[Event]:
    start: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": t.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(t, 0),
    }
    events: list[Event] = [
        (False, sse_event("message_start", {"type": "message_start", "message": start})),
        (
            False,
            sse_event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
        ),
        (False, sse_event("ping", {"type": "ping"})),
    ]
    for piece in t.pieces:
        delta = {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": piece},
        }
        events.append((True, sse_event("content_block_delta", delta)))
    events.append(
        (False, sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
    )
    final = {
        "type": "message_delta",
        "delta": {"stop_reason": _stop_reason(t), "stop_sequence": None},
        "usage": usage(t, t.output_tokens),
    }
    events.append((False, sse_event("message_delta", final)))
    events.append((False, sse_event("message_stop", {"type": "message_stop"})))
    return events
