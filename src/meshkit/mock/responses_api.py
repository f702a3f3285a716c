"""
OpenAI Responses API bodies and the response store
==================================================

* :func:`build_response` renders a ``Response`` object (one ``message`` output item,
  ``usage`` with ``input_tokens_details.cached_tokens``).
* :func:`response_events` renders the stream the SDK's helper expects:
  ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta`` (one per token),
  ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done`` and ``response.completed`` (or
  ``response.incomplete`` when ``max_output_tokens`` cut the output), each with
  ``type`` and an increasing ``sequence_number``; no ``[DONE]``.
* :class:`ResponseStore` keeps the last responses created on this worker (bounded),
  with their input items and their conversation context for ``previous_response_id``.
* :func:`list_page` pages input items and conversation items alike.
"""

from __future__ import annotations

import asyncio
import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshkit.mock.tokens import Token
from meshkit.mock.turn import Event, Turn
from meshkit.mock.wire import sse_event

__all__ = [
    "ResponseStore",
    "StoredResponse",
    "build_response",
    "list_input_items",
    "list_page",
    "normalize_input",
    "page_of",
    "response_events",
]

#: Request fields echoed into the Response object, with their defaults.
_ECHO: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None},
    "service_tier": "default",
    "store": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
    "background": False,
}


@dataclass
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    #: Conversation tokens (previous context + input + output), without instructions.
    context: list[Token]
    background: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    #: a background response still generating: what it will be, and its turn (a
    #: streamed retrieve meanwhile streams it at the turn's pace)
    final: dict[str, Any] | None = field(default=None, repr=False)
    turn: Turn | None = field(default=None, repr=False)


class ResponseStore:
    """The last ``capacity`` responses created on this worker, by id."""

    def __init__(self, capacity: int = 1000) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, stored: StoredResponse) -> None:
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            _, old = self._items.popitem(last=False)
            if old.timer is not None:
                old.timer.cancel()

    def get(self, rid: str) -> StoredResponse | None:
        return self._items.get(rid)

    def pop(self, rid: str) -> StoredResponse | None:
        stored = self._items.pop(rid, None)
        if stored is not None and stored.timer is not None:
            stored.timer.cancel()
        return stored

    def clear(self) -> None:
        for stored in self._items.values():
            if stored.timer is not None:
                stored.timer.cancel()
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def normalize_input(value: Any, new_id: Callable[[str], str]) -> list[dict[str, Any]]:
    """The request's ``input`` as stored input items (each with an ``id``)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items: list[dict[str, Any]] = []
    if not isinstance(value, list):
        return items
    for raw in value:
        if not isinstance(raw, dict):
            continue
        item = dict(raw)
        if item.get("type") is None and "role" in item:
            item["type"] = "message"
        if item.get("type") == "message":
            content = item.get("content")
            if isinstance(content, str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": content}]
            item.setdefault("status", "completed")
            item.setdefault("id", new_id("msg"))
        elif item.get("type") is None and "id" in item:
            item["type"] = "item_reference"
        else:
            item.setdefault("id", new_id("item"))
        items.append(item)
    return items


def _output_item(msg_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def build_response(
    t: Turn, rid: str, msg_id: str, body: dict[str, Any], *, status: str | None = None
) -> dict[str, Any]:
    """A finished ``Response`` for ``t`` (``status`` overrides, e.g. ``in_progress``)."""
    final = "incomplete" if t.truncated else "completed"
    status = status or final
    resp: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": t.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": t.model,
        "output": []
        if status in ("in_progress", "queued")
        else [_output_item(msg_id, t.text, final)],
        "usage": None
        if status in ("in_progress", "queued")
        else {
            "input_tokens": t.prompt_tokens,
            "input_tokens_details": {"cached_tokens": t.cached_tokens},
            "output_tokens": t.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": t.prompt_tokens + t.output_tokens,
        },
    }
    for key, default in _ECHO.items():
        value = body.get(key)
        resp[key] = default if value is None else value
    if t.rank is not None:
        resp["mesh_dp_rank"] = t.rank
    return resp


def response_events(resp: dict[str, Any], pieces: tuple[str, ...]) -> list[Event]:
    """The SSE events that stream ``resp`` (a finished Response) token by token."""
    out: list[Event] = []
    seq = 0

    def add(name: str, is_token: bool = False, **data: Any) -> None:
        nonlocal seq
        out.append((is_token, sse_event(name, {"type": name, **data, "sequence_number": seq})))
        seq += 1

    start = copy.copy(resp)
    start.update(status="in_progress", output=[], usage=None, incomplete_details=None)
    if resp.get("background") is True:
        # A background response is created queued, as the API streams it.
        queued = {**start, "status": "queued"}
        add("response.created", response=queued)
        add("response.queued", response=queued)
    else:
        add("response.created", response=start)
    add("response.in_progress", response=start)
    for index, item in enumerate(resp["output"]):
        part = item["content"][0]
        text = part["text"]
        ids = {"item_id": item["id"], "output_index": index}
        add(
            "response.output_item.added",
            output_index=index,
            item={**item, "status": "in_progress", "content": []},
        )
        add("response.content_part.added", **ids, content_index=0, part={**part, "text": ""})
        for piece in pieces if index == 0 else (text,):
            add(
                "response.output_text.delta", True, **ids, content_index=0, delta=piece, logprobs=[]
            )
        add("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
        add("response.content_part.done", **ids, content_index=0, part=part)
        add("response.output_item.done", output_index=index, item=item)
    terminal = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
    add(terminal, response=resp)
    return out


def list_input_items(stored: StoredResponse, params: dict[str, list[str]]) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: ``after``, ``limit`` (1-100), ``order``."""
    return list_page(stored.input_items, params)


def list_page(items: list[dict[str, Any]], params: dict[str, list[str]]) -> dict[str, Any]:
    """A page of ``items`` (input items, conversation items) as the API lists them:
    ``after``, ``limit`` (1-100), ``order`` (``desc`` unless ``asc``)."""
    order = (params.get("order") or ["desc"])[-1]
    if order != "asc":
        items = items[::-1]
    after = params.get("after", [""])[-1] or None
    if after is not None:
        for i, item in enumerate(items):
            if item.get("id") == after:
                items = items[i + 1 :]
                break
    try:
        limit = int((params.get("limit") or ["20"])[-1])
    except ValueError:
        limit = 20
    limit = min(max(limit, 1), 100)
    return page_of(items[:limit], has_more=len(items) > limit)


def page_of(page: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """A ``list`` object of ``page``."""
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": has_more,
    }
