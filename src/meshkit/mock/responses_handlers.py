"""
OpenAI Responses API endpoints of the mock worker
=================================================

* ``POST /v1/responses``: non-stream, stream, ``background`` (answers ``queued``
  without usage, as the API does; the stored response is ``in_progress`` once its
  simulated queue wait is over and ``completed``, with its usage, after the
  simulated generation time: a client polls ``GET /v1/responses/{id}``),
  ``previous_response_id`` (404 unless this worker created it; the previous
  conversation is prepended to the prompt), ``conversation`` (a string or
  ``{"id": ...}``: 404 unless this worker holds it; its items are prepended to the
  prompt, and the response's input and output items are appended to it when the
  response completes), ``store: false`` (not retrievable).
* ``GET /v1/responses/{id}`` (``?stream=true&starting_after=N`` replays the events;
  a background response still generating streams them at its pace). A streamed
  background create starts with ``response.created`` and ``response.queued``
  (status ``queued``), as the API streams it,
  ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` (only background
  responses, as the API says; others → 400) and ``GET /v1/responses/{id}/input_items``.
"""

from __future__ import annotations

import asyncio
import copy
from typing import TYPE_CHECKING, Any

from meshkit.mock import responses_api
from meshkit.mock.conversations import StoredConversation, conversation_id
from meshkit.mock.responses_api import StoredResponse
from meshkit.mock.tokens import Token, prompt_tokens
from meshkit.mock.turn import Turn, max_tokens
from meshkit.mock.wire import Reply, Request

if TYPE_CHECKING:
    from meshkit.mock.app import MockApp

__all__ = ["ResponsesHandlers"]

_RESP_PREFIX = b"/v1/responses/"
_POST, _GET, _DELETE = b"POST", b"GET", b"DELETE"


class ResponsesHandlers:
    """Responses endpoints for one :class:`~meshkit.mock.app.MockApp`."""

    def __init__(self, app: MockApp) -> None:
        self.app = app
        self.store = app.responses

    def create(self, req: Request) -> Reply:
        pre = self.app.prelude(req, False)
        if isinstance(pre, bytes):
            return pre
        body, rank = pre
        context: list[Token] = []
        prev_id = body.get("previous_response_id")
        conv_ref = body.get("conversation")
        if prev_id is not None and conv_ref is not None:
            msg = "previous_response_id cannot be combined with conversation"
            return self.app.error(req, 400, msg, param="previous_response_id")
        if prev_id is not None:
            prev = self.store.get(prev_id) if isinstance(prev_id, str) else None
            if prev is None:
                msg = f"Previous response with id '{prev_id}' not found."
                return self.app.error(
                    req, 404, msg, param="previous_response_id", code="previous_response_not_found"
                )
            context = prev.context
        conv: StoredConversation | None = None
        if conv_ref is not None:
            cid = conversation_id(conv_ref)
            conv = None if cid is None else self.app.conversations.get(cid)
            if conv is None:
                msg = f"Conversation with id '{cid}' not found."
                return self.app.error(req, 404, msg, param="conversation")
            context = prompt_tokens(conv.items)
        new_input = prompt_tokens(body.get("input"))
        tokens = prompt_tokens(body.get("instructions")) + context + new_input
        t = self.app.turn(body, tokens, max_tokens(body, "max_output_tokens"), rank)
        rid, msg_id = self.app.new_id("resp_"), self.app.new_id("msg_")
        resp = responses_api.build_response(t, rid, msg_id, body)
        items: list[dict[str, Any]] = []
        if conv is not None:
            resp["conversation"] = {"id": conv.id}
        if conv is not None or body.get("store") is not False:
            items = responses_api.normalize_input(
                body.get("input"), lambda kind: self.app.new_id(f"{kind}_")
            )
        stored: StoredResponse | None = None
        if body.get("store") is not False:
            out_words: list[Token] = [w.strip() for w in t.pieces]
            stored = StoredResponse(resp, items, context + new_input + out_words)
            stored.background = body.get("background") is True
            self.store.put(rid, stored)
        if stored is not None and stored.background and body.get("stream") is not True:
            return self._background(req, stored, t, msg_id, body, conv)
        if conv is not None:
            # The mock's generation is done once answered (its delays only pace
            # the bytes): the response is complete now.
            self._extend(conv, items, resp)
        if body.get("stream") is True:
            return self.app.stream(req, responses_api.response_events(resp, t.pieces), t)
        return self.app.complete_json(req, resp, t)

    def _extend(
        self, conv: StoredConversation, items: list[dict[str, Any]], resp: dict[str, Any]
    ) -> None:
        """A completed response's input and output items join its conversation."""
        added = [dict(i) for i in items] + copy.deepcopy(resp["output"])
        self.app.conversations.append(conv, added)

    def _background(
        self,
        req: Request,
        stored: StoredResponse,
        t: Turn,
        msg_id: str,
        body: dict[str, Any],
        conv: StoredConversation | None,
    ) -> bytes:
        final = stored.response
        queued = responses_api.build_response(t, final["id"], msg_id, body, status="queued")
        if conv is not None:
            queued["conversation"] = final["conversation"]
        stored.response = queued
        stored.final, stored.turn = final, t
        loop = asyncio.get_running_loop()
        waited = t.queued_s
        run = max(self.app.total_delay(t) - waited, 0.0)

        def start() -> None:
            if stored.response["status"] == "queued":
                stored.response = {**queued, "status": "in_progress"}
                stored.timer = loop.call_later(run, finish)
            else:
                stored.timer = None

        def finish() -> None:
            stored.timer = None
            stored.final = stored.turn = None
            if stored.response["status"] == "in_progress":
                stored.response = final
                if conv is not None:
                    self._extend(conv, stored.input_items, final)

        stored.timer = loop.call_later(waited, start)
        return self.app.json(req, queued, rank=t.rank)

    def resource(self, req: Request) -> Reply:
        rid, _, sub = req.path[len(_RESP_PREFIX) :].decode("latin-1").partition("/")
        stored = self.store.get(rid)
        if stored is None:
            return self.app.error(
                req, 404, f"Response with id '{rid}' not found.", param="response_id"
            )
        method = req.method
        if sub == "" and method == _GET:
            params = req.params()
            if (params.get("stream") or ["false"])[-1].lower() == "true":
                return self._replay(req, stored, params)
            return self.app.json(req, stored.response)
        if sub == "" and method == _DELETE:
            self.store.pop(rid)
            return self.app.json(req, {"id": rid, "object": "response", "deleted": True})
        if sub == "cancel" and method == _POST:
            if not stored.background:
                msg = "Only responses created with background=true can be cancelled."
                return self.app.error(req, 400, msg)
            if stored.response["status"] in ("in_progress", "queued"):
                if stored.timer is not None:
                    stored.timer.cancel()
                    stored.timer = None
                stored.response = {**stored.response, "status": "cancelled"}
            return self.app.json(req, stored.response)
        if sub == "input_items" and method == _GET:
            return self.app.json(req, responses_api.list_input_items(stored, req.params()))
        return self.app.error(
            req, 404 if sub not in ("", "cancel", "input_items") else 405, "Not found"
        )

    def _replay(self, req: Request, stored: StoredResponse, params: dict[str, list[str]]) -> Reply:
        resp, turn = stored.response, None
        if resp["status"] in ("queued", "in_progress") and stored.final is not None:
            # Still generating: the events from the start, at the generation's pace.
            resp, turn = stored.final, stored.turn
        elif resp["status"] not in ("completed", "incomplete"):
            return self.app.json(req, resp)
        text = resp["output"][0]["content"][0]["text"] if resp["output"] else ""
        events = responses_api.response_events(resp, tuple(w + " " for w in text.split()))
        try:
            after = int((params.get("starting_after") or ["-1"])[-1])
        except ValueError:
            after = -1
        events = events[after + 1 :] if after >= 0 else events
        return self.app.stream(req, events, turn)
