"""
The demo's SDK calls
====================

One function per (SDK, API, stream) the demo exercises. Each returns a
:class:`Outcome`: the HTTP status, the worker that answered (the mock's
``x-mock-worker`` header, relayed by every meshkit mode), the time to the first
text delta measured by the client (streams only) and the usage the response
reported (prompt and cached tokens).

SDK errors become outcomes too (status and worker from the error's response):
the demo reports them in its table instead of stopping at the first one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam

__all__ = [
    "MODEL",
    "Outcome",
    "anthropic_messages",
    "measure",
    "openai_chat",
    "openai_responses",
]

MODEL = "mock-model"
_WORKER = "x-mock-worker"


@dataclass
class Outcome:
    status: int
    worker: str = "-"
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    #: a Responses call's response id
    id: str | None = None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def measure(call: Callable[[], Outcome]) -> Outcome:
    """Run one call; an SDK error becomes an outcome with its status."""
    try:
        return call()
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        return Outcome(exc.status_code, exc.response.headers.get(_WORKER, "-"))
    except (openai.APIConnectionError, anthropic.APIConnectionError):
        return Outcome(0)


def openai_chat(
    client: openai.OpenAI, messages: Sequence[ChatCompletionMessageParam], *, stream: bool
) -> Outcome:
    """``chat.completions.create``; streams ask for usage in the last chunk."""
    if not stream:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        chat = raw.parse()
        out = Outcome(raw.status_code, raw.headers.get(_WORKER, "-"))
        out.text = chat.choices[0].message.content or "" if chat.choices else ""
        if chat.usage is not None:
            out.prompt_tokens = chat.usage.prompt_tokens
            details = chat.usage.prompt_tokens_details
            out.cached_tokens = details.cached_tokens if details else 0
        return out
    t0 = time.perf_counter()
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    out = Outcome(chunks.response.status_code, chunks.response.headers.get(_WORKER, "-"))
    parts: list[str] = []
    for chunk in chunks:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            if out.ttft_ms is None:
                out.ttft_ms = _ms(t0)
            parts.append(delta)
        if chunk.usage is not None:
            out.prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            out.cached_tokens = details.cached_tokens if details else 0
    out.text = "".join(parts)
    return out


def openai_responses(
    client: openai.OpenAI, text: str, *, stream: bool, previous: str | None = None
) -> Outcome:
    """``responses.create`` (following up ``previous``, a response id, when given); a
    stream ends with ``response.completed`` and its usage."""
    follows: dict[str, Any] = {"previous_response_id": previous} if previous else {}
    if not stream:
        raw = client.responses.with_raw_response.create(model=MODEL, input=text, **follows)
        resp = raw.parse()
        out = Outcome(raw.status_code, raw.headers.get(_WORKER, "-"), text=resp.output_text)
        out.id = resp.id
        if resp.usage is not None:
            out.prompt_tokens = resp.usage.input_tokens
            out.cached_tokens = resp.usage.input_tokens_details.cached_tokens
        return out
    t0 = time.perf_counter()
    events = client.responses.create(model=MODEL, input=text, stream=True, **follows)
    out = Outcome(events.response.status_code, events.response.headers.get(_WORKER, "-"))
    for event in events:
        if event.type == "response.output_text.delta" and out.ttft_ms is None:
            out.ttft_ms = _ms(t0)
        elif event.type == "response.completed":
            usage = event.response.usage
            out.text = event.response.output_text
            out.id = event.response.id
            if usage is not None:
                out.prompt_tokens = usage.input_tokens
                out.cached_tokens = usage.input_tokens_details.cached_tokens
    return out


def anthropic_messages(
    client: anthropic.Anthropic, messages: Sequence[MessageParam], *, stream: bool
) -> Outcome:
    """``messages.create``; cached tokens are ``cache_read_input_tokens``."""
    if not stream:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=64, messages=messages
        )
        msg = raw.parse()
        out = Outcome(raw.status_code, raw.headers.get(_WORKER, "-"))
        out.text = "".join(b.text for b in msg.content if b.type == "text")
        u = msg.usage
        out.cached_tokens = u.cache_read_input_tokens or 0
        out.prompt_tokens = u.input_tokens + out.cached_tokens
        return out
    t0 = time.perf_counter()
    events = client.messages.create(model=MODEL, max_tokens=64, messages=messages, stream=True)
    out = Outcome(events.response.status_code, events.response.headers.get(_WORKER, "-"))
    parts: list[str] = []
    for event in events:
        if event.type == "message_start":
            u = event.message.usage
            out.cached_tokens = u.cache_read_input_tokens or 0
            out.prompt_tokens = u.input_tokens + out.cached_tokens
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            if out.ttft_ms is None:
                out.ttft_ms = _ms(t0)
            parts.append(event.delta.text)
    out.text = "".join(parts)
    return out
