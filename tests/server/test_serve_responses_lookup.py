"""A Responses follow-up through a second ``meshkit serve`` finds the first turn's
worker (it asks the origins once), with the real openai SDK; a conversation created
through one gateway is continued through the other."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx2
import openai


@contextmanager
def _two_gateways(mock_factory: Any, spawn: Any) -> Iterator[tuple[list[Any], list[openai.OpenAI]]]:
    """Two ``meshkit serve`` processes over the same three mock workers: the
    workers, and an SDK client for each gateway."""
    mocks = [mock_factory(name=f"w{i}") for i in range(3)]
    flags = [a for m in mocks for a in ("--worker", m.url)]
    gateways = [spawn("serve", *flags, "--port", "0") for _ in range(2)]
    with httpx2.Client(trust_env=False) as http:
        yield (
            mocks,
            [
                openai.OpenAI(base_url=g.url + "/v1", api_key="k", http_client=http, max_retries=0)
                for g in gateways
            ],
        )


def test_two_gateways_with_the_openai_sdk(mock_factory: Any, spawn: Any) -> None:
    with _two_gateways(mock_factory, spawn) as (_, sdk):
        raw = sdk[0].responses.with_raw_response.create(model="m", input="hello")
        created = raw.parse()
        follow = sdk[1].responses.with_raw_response.create(
            model="m", input="and then?", previous_response_id=created.id
        )
        assert follow.headers["x-mock-worker"] == raw.headers["x-mock-worker"]
        assert follow.parse().previous_response_id == created.id


def test_a_conversation_across_two_gateways_with_the_openai_sdk(
    mock_factory: Any, spawn: Any
) -> None:
    with _two_gateways(mock_factory, spawn) as (mocks, sdk):
        raw = sdk[0].conversations.with_raw_response.create()
        conv = raw.parse()
        owner = raw.headers["x-mock-worker"]
        for text in ("hello", "and then?"):
            turn = sdk[1].responses.with_raw_response.create(
                model="m", input=text, conversation=conv.id
            )
            assert turn.headers["x-mock-worker"] == owner
            assert turn.parse().conversation is not None
        # the first gateway relays the items the second one's turns added
        items = sdk[0].conversations.items.list(conv.id)
        assert len(items.data) == 4
        lookups = sum(
            m.worker.stats.requests_total.get(f"/v1/conversations/{conv.id}", 0) for m in mocks
        )
        assert 1 <= lookups <= len(mocks)  # the second gateway asked once
