"""
SGLang ``/generate`` bodies
===========================

Non-stream: ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}``.
Stream: data-only SSE whose ``text`` and ``output_ids`` are **cumulative**, the last
chunk carrying ``finish_reason``, then ``data: [DONE]``.

``finish_reason`` is ``{"type": "length", "length": n}`` when
``sampling_params.max_new_tokens`` cut the output, else ``{"type": "stop",
"matched": 2}`` (an EOS id).
"""

from __future__ import annotations

from typing import Any

from meshkit.mock.tokens import Vocab
from meshkit.mock.turn import Event, Turn
from meshkit.mock.wire import sse_data

__all__ = ["DONE", "generate_body", "generate_events"]

DONE = b"data: [DONE]\n\n"
_EOS = 2


def _finish(t: Turn) -> dict[str, Any]:
    if t.truncated:
        return {"type": "length", "length": t.output_tokens}
    return {"type": "stop", "matched": _EOS}


def _meta(
    t: Turn, rid: str, completion_tokens: int, finish: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": t.cached_tokens,
        "e2e_latency": 0.0,
    }


def generate_body(t: Turn, rid: str, vocab: Vocab) -> dict[str, Any]:
    body: dict[str, Any] = {
        "text": t.text,
        "output_ids": vocab.encode(list(w.strip() for w in t.pieces)),
        "meta_info": _meta(t, rid, t.output_tokens, _finish(t)),
    }
    if t.rank is not None:
        body["mesh_dp_rank"] = t.rank
    return body


def generate_events(t: Turn, rid: str, vocab: Vocab) -> list[Event]:
    ids = vocab.encode(list(w.strip() for w in t.pieces))
    events: list[Event] = []
    text = ""
    n = len(t.pieces)
    for i, piece in enumerate(t.pieces):
        text += piece
        last = i == n - 1
        chunk = {
            "text": text,
            "output_ids": ids[: i + 1],
            "meta_info": _meta(t, rid, i + 1, _finish(t) if last else None),
        }
        events.append((True, sse_data(chunk)))
    if n == 0:
        events.append(
            (
                False,
                sse_data({"text": "", "output_ids": [], "meta_info": _meta(t, rid, 0, _finish(t))}),
            )
        )
    events.append((False, DONE))
    return events
