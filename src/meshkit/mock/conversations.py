"""
OpenAI Conversations API of the mock worker
===========================================

* ``POST /v1/conversations`` (optional ``items``, at most 20, and ``metadata``)
  answers a ``conversation`` object whose id is ``conv_<hex>``;
* ``GET``, ``POST`` (new ``metadata``) and ``DELETE /v1/conversations/{id}``;
* ``GET /v1/conversations/{id}/items`` (``after``, ``limit``, ``order``: newest
  first by default) and ``POST`` (at most 20 ``items``, answered as a list);
* ``GET`` and ``DELETE /v1/conversations/{id}/items/{item_id}`` (the delete answers
  the conversation, as the API does).

An id this worker does not hold answers 404 in OpenAI's error shape: a router asks
``GET /v1/conversations/{id}`` to find the owner. ``POST /v1/responses`` with
``conversation`` reads and extends the same store
(:mod:`meshkit.mock.responses_handlers`).

:class:`ConversationStore` is bounded twice: ``MockConfig.max_conversations``
conversations (the least recently used is dropped) and
``MockConfig.max_conversation_items`` items in each (the oldest are dropped), so a
long benchmark cannot grow a worker without limit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshkit.mock import responses_api
from meshkit.mock.wire import Reply, Request

if TYPE_CHECKING:
    from meshkit.mock.app import MockApp

__all__ = ["ConversationHandlers", "ConversationStore", "StoredConversation"]

#: the most items one create or add may carry (the API's limit)
MAX_ITEMS_PER_CALL = 20
#: the most metadata pairs (the API's limit)
MAX_METADATA = 16
PREFIX = b"/v1/conversations/"
_POST, _GET, _DELETE = b"POST", b"GET", b"DELETE"


@dataclass
class StoredConversation:
    id: str
    created_at: int
    metadata: dict[str, Any] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        """The ``conversation`` object the API answers."""
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }


class ConversationStore:
    """The last ``capacity`` conversations used on this worker, each with its last
    ``max_items`` items."""

    def __init__(self, capacity: int = 1000, max_items: int = 1000) -> None:
        self.capacity = capacity
        self.max_items = max_items
        self._items: OrderedDict[str, StoredConversation] = OrderedDict()

    def put(self, conv: StoredConversation) -> None:
        self._items[conv.id] = conv
        self._items.move_to_end(conv.id)
        self._trim(conv)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, cid: str) -> StoredConversation | None:
        conv = self._items.get(cid)
        if conv is not None:
            # In use: an idle conversation goes first.
            self._items.move_to_end(cid)
        return conv

    def pop(self, cid: str) -> StoredConversation | None:
        return self._items.pop(cid, None)

    def append(self, conv: StoredConversation, items: list[dict[str, Any]]) -> None:
        conv.items.extend(items)
        self._trim(conv)

    def _trim(self, conv: StoredConversation) -> None:
        extra = len(conv.items) - self.max_items
        if extra > 0:
            del conv.items[:extra]

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, cid: object) -> bool:
        return cid in self._items


def conversation_id(ref: Any) -> str | None:
    """The id of a Responses ``conversation`` parameter (a string or ``{"id": ...}``)."""
    if isinstance(ref, dict):
        ref = ref.get("id")
    return ref if isinstance(ref, str) and ref else None


def _problem(body: dict[str, Any], *, need: str | None = None) -> tuple[str, str] | None:
    """(message, param) when ``items`` or ``metadata`` of ``body`` is unusable."""
    items = body.get("items")
    if items is not None or need == "items":
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            return "items must be an array of objects", "items"
        if len(items) > MAX_ITEMS_PER_CALL:
            return f"items: at most {MAX_ITEMS_PER_CALL} items at a time", "items"
    meta = body.get("metadata")
    if meta is not None or need == "metadata":
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            return "metadata must be an object of strings", "metadata"
        if len(meta) > MAX_METADATA:
            return f"metadata: at most {MAX_METADATA} pairs", "metadata"
    return None


class ConversationHandlers:
    """Conversations endpoints for one :class:`~meshkit.mock.app.MockApp`."""

    def __init__(self, app: MockApp) -> None:
        self.app = app
        self.store = app.conversations

    def _body(self, req: Request, need: str | None) -> dict[str, Any] | bytes:
        # The API accepts a create without a body; the others need theirs.
        if need is None and not req.body.strip():
            return {}
        body = self.app.parse(req)
        if body is None:
            return self.app.error(req, 400, "The request body is not a JSON object")
        problem = _problem(body, need=need)
        if problem is not None:
            return self.app.error(req, 400, problem[0], param=problem[1])
        return body

    def _new_items(self, raw: Any) -> list[dict[str, Any]]:
        return responses_api.normalize_input(raw or [], lambda kind: self.app.new_id(f"{kind}_"))

    def create(self, req: Request) -> Reply:
        body = self._body(req, None)
        if isinstance(body, bytes):
            return body
        conv = StoredConversation(
            self.app.new_id("conv_"), int(time.time()), dict(body.get("metadata") or {})
        )
        conv.items = self._new_items(body.get("items"))
        self.store.put(conv)
        return self.app.json(req, conv.body())

    def resource(self, req: Request) -> Reply:
        path = req.path[len(PREFIX) :].decode("latin-1")
        cid, _, sub = path.partition("/")
        conv = self.store.get(cid)
        if conv is None:
            msg = f"Conversation with id '{cid}' not found."
            return self.app.error(req, 404, msg, param="conversation_id")
        method = req.method
        if sub == "":
            if method == _GET:
                return self.app.json(req, conv.body())
            if method == _POST:
                body = self._body(req, "metadata")
                if isinstance(body, bytes):
                    return body
                conv.metadata = dict(body["metadata"])
                return self.app.json(req, conv.body())
            if method == _DELETE:
                self.store.pop(cid)
                return self.app.json(
                    req, {"id": cid, "object": "conversation.deleted", "deleted": True}
                )
        elif sub == "items":
            if method == _GET:
                return self.app.json(req, responses_api.list_page(conv.items, req.params()))
            if method == _POST:
                body = self._body(req, "items")
                if isinstance(body, bytes):
                    return body
                added = self._new_items(body["items"])
                self.store.append(conv, added)
                return self.app.json(req, responses_api.page_of(added, has_more=False))
        elif sub.startswith("items/") and "/" not in sub[6:]:
            return self._item(req, conv, sub[6:])
        else:
            return self.app.error(req, 404, "Not found")
        return self.app.error(req, 405, "Method not allowed")

    def _item(self, req: Request, conv: StoredConversation, item_id: str) -> Reply:
        at = next((i for i, item in enumerate(conv.items) if item.get("id") == item_id), None)
        if at is None:
            msg = f"Item with id '{item_id}' not found."
            return self.app.error(req, 404, msg, param="item_id")
        if req.method == _GET:
            return self.app.json(req, conv.items[at])
        if req.method == _DELETE:
            del conv.items[at]
            return self.app.json(req, conv.body())
        return self.app.error(req, 405, "Method not allowed")
