"""The one ASGI body reader (middleware and admin apps): what it returns and when
it stops reading."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from meshkit.errors import RequestTooLarge
from meshkit.frontends.asgi_body import receive_body
from meshkit.types import Message


def feed(messages: list[Message]) -> tuple[Callable[[], Awaitable[Message]], list[int]]:
    """A ``receive`` over ``messages``, and how many of them were read."""
    read = [0]

    async def receive() -> Message:
        message = messages[read[0]]
        read[0] += 1
        return message

    return receive, read


def body(chunk: bytes, more: bool = True) -> Message:
    return {"type": "http.request", "body": chunk, "more_body": more}


def test_chunks_are_joined_and_empty_ones_skipped() -> None:
    receive, read = feed([body(b"ab"), body(b""), body(b"cd"), body(b"e", more=False)])
    assert asyncio.run(receive_body(receive, 5)) == b"abcde"
    assert read[0] == 4


def test_a_body_without_chunks_is_empty() -> None:
    receive, _ = feed([{"type": "http.request"}])
    assert asyncio.run(receive_body(receive, 0)) == b""


def test_one_byte_over_is_refused_before_the_rest_is_read() -> None:
    receive, read = feed([body(b"abc"), body(b"def"), body(b"never read", more=False)])
    with pytest.raises(RequestTooLarge) as exc:
        asyncio.run(receive_body(receive, 5))
    assert exc.value.status == 413 and "over 5 bytes" in str(exc.value)
    assert read[0] == 2


def test_a_client_that_leaves_mid_body_gives_none() -> None:
    receive, _ = feed([body(b"abc"), {"type": "http.disconnect"}])
    assert asyncio.run(receive_body(receive, 100)) is None
