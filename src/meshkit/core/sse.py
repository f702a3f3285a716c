"""
Ending a relayed stream after a failure
=======================================

Once the first byte has reached the client, an upstream failure cannot become an
HTTP error. meshkit ends the stream with one error event in the stream's own
framing, so the SDK raises instead of returning a silently truncated answer: the
OpenAI SDK raises on a data payload with an ``error`` key, the Anthropic SDK on
``event: error``, the Responses helpers on an ``error`` event.
"""

from __future__ import annotations

import msgspec

from meshkit.core.endpoints import StreamFormat

__all__ = ["stream_error_event"]


def stream_error_event(fmt: StreamFormat, code: str, message: str) -> bytes:
    """One SSE event that reports ``code`` in ``fmt``'s framing (b"" for non-streams)."""
    if fmt is StreamFormat.ANTHROPIC:
        data = msgspec.json.encode(
            {"type": "error", "error": {"type": "api_error", "message": message}}
        )
        return b"event: error\ndata: " + data + b"\n\n"
    if fmt is StreamFormat.RESPONSES:
        data = msgspec.json.encode(
            {"type": "error", "code": code, "message": message, "param": None}
        )
        return b"event: error\ndata: " + data + b"\n\n"
    if fmt in (StreamFormat.OPENAI, StreamFormat.GENERATE):
        data = msgspec.json.encode(
            {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        )
        return b"data: " + data + b"\n\n"
    return b""
