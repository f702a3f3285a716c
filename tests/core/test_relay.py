"""The relay's steps, as a table: what each front end writes, and how the books close."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshkit.core.endpoints import resolve
from meshkit.core.relay import MID_STREAM_CODE, MID_STREAM_MESSAGE, Books, Relay
from meshkit.core.requests import RequestView, parse_request


class FakeBooks(Books):
    def __init__(self, terminal: bool = False) -> None:
        self.fed: list[bytes] = []
        self.closed: list[str] = []
        self.terminal = terminal
        self.stopped = False
        # Books.max_event_bytes (bounds.max_sse_line_bytes' default); no event here
        # is held back long enough for it to matter
        self.max_event_bytes = 1024 * 1024

    @property
    def done(self) -> bool:
        return bool(self.closed) or self.terminal

    def feed(self, chunk: bytes) -> None:
        self.fed.append(chunk)

    def end(self) -> None:
        self.closed.append("end")

    def abort(self, *, client_left: bool = True) -> None:
        self.closed.append("client_left" if client_left else "worker_failed")


def view(path: str, body: dict[str, Any]) -> RequestView:
    m = resolve("POST", path)
    assert m is not None
    return parse_request(m, json.dumps(body).encode())


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}
MESSAGES = {"model": "m", "max_tokens": 5, "messages": [], "stream": True}


def test_a_whole_body_is_written_one_chunk_behind_and_the_books_close_first() -> None:
    books = FakeBooks()
    relay = Relay(books, view("/v1/chat/completions", CHAT))
    assert relay.chunk(b"a") == b""
    assert relay.chunk(b"b") == b"a"
    assert books.closed == []
    assert relay.end() == b"b"  # the last bytes after the books closed
    assert books.closed == ["end"] and books.fed == [b"a", b"b"]
    relay.close()
    assert books.closed == ["end"]  # once


def test_a_stream_is_written_as_it_arrives() -> None:
    books = FakeBooks()
    relay = Relay(books, view("/v1/chat/completions", STREAM))
    assert relay.chunk(b"data: 1\n\n") == b"data: 1\n\n"
    assert relay.end() == b""
    assert books.closed == ["end"]


@pytest.mark.parametrize(
    ("path", "body", "start"),
    [
        ("/v1/chat/completions", STREAM, b"data: "),
        ("/v1/messages", MESSAGES, b"event: error\ndata: "),
        ("/v1/responses", {"model": "m", "input": "hi", "stream": True}, b"event: error\ndata: "),
    ],
)
def test_a_stream_the_worker_cut_ends_with_one_error_event(
    path: str, body: dict[str, Any], start: bytes
) -> None:
    books = FakeBooks()
    relay = Relay(books, view(path, body))
    relay.chunk(b"data: 1\n\n")
    tail = relay.fail()
    assert tail.startswith(start) and tail.endswith(b"\n\n")
    assert MID_STREAM_MESSAGE.encode() in tail
    assert MID_STREAM_CODE.encode() in tail
    assert not relay.cut
    assert books.closed == ["worker_failed"]
    relay.close()
    assert books.closed == ["worker_failed"]


def test_a_whole_body_the_worker_cut_hands_back_the_held_bytes_and_asks_for_a_cut() -> None:
    books = FakeBooks()
    relay = Relay(books, view("/v1/chat/completions", CHAT))
    relay.chunk(b'{"partial"')
    assert relay.fail() == b'{"partial"'
    assert relay.cut
    assert books.closed == ["worker_failed"]


def test_closing_before_the_end_is_the_client_leaving() -> None:
    books = FakeBooks()
    relay = Relay(books, view("/v1/chat/completions", STREAM))
    relay.chunk(b"data: 1\n\n")
    relay.close()
    assert books.closed == ["client_left"]


def test_closing_after_the_terminal_event_is_a_completion() -> None:
    books = FakeBooks(terminal=True)
    relay = Relay(books, view("/v1/chat/completions", STREAM))
    relay.chunk(b"data: [DONE]\n\n")
    relay.close()
    assert books.closed == ["end"]


def test_whole_writes_at_once_and_end_closes() -> None:
    books = FakeBooks()
    relay = Relay(books, view("/v1/chat/completions", CHAT))
    assert relay.whole(b"{}") == b"{}"
    assert books.closed == []
    assert relay.end() == b""
    assert books.closed == ["end"]


def test_a_chunk_that_stopped_the_books_is_written_and_finishes_the_relay() -> None:
    """The stream's own error event: written, then the front end ends the body."""
    books = FakeBooks()
    relay = Relay(books, view("/v1/messages", MESSAGES))
    assert relay.chunk(b"event: ping\ndata: {}\n\n") == b"event: ping\ndata: {}\n\n"
    assert not relay.finished
    books.stopped = True
    assert relay.chunk(b"event: error\ndata: {}\n\n") == b"event: error\ndata: {}\n\n"
    assert relay.finished
    assert relay.end() == b""
