"""The relay writes a stream's events whole (core.relay: "An event is relayed once
it is whole"): split anywhere, the bytes written are the worker's, in order, each
write ending on an event boundary; cut anywhere, the client gets the whole events
and then meshkit's error event, never half an event glued to it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshkit.core.endpoints import resolve
from meshkit.core.relay import NoBooks, Relay
from meshkit.core.requests import RequestView, parse_request

#: the books' ``bounds.max_sse_line_bytes``, small here
MAX_EVENT = 4096


def _books() -> NoBooks:
    """Books that keep nothing, but hold a stream's events up to ``MAX_EVENT``."""
    return NoBooks(MAX_EVENT)


def _view(stream: bool = True) -> RequestView:
    m = resolve("POST", "/v1/chat/completions")
    assert m is not None
    body = {"model": "m", "messages": [], "stream": stream}
    return parse_request(m, json.dumps(body).encode())


EVENTS = [b'data: {"a":1}', b": keep-alive", b'event: x\ndata: {"b":2}', b"data: [DONE]"]


@pytest.mark.parametrize("nl", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_every_write_ends_on_an_event_boundary(nl: bytes) -> None:
    stream = b"".join(e.replace(b"\n", nl) + nl + nl for e in EVENTS)
    ends = {i + 1 for i in range(len(stream)) if stream[: i + 1].endswith(nl + nl)}
    for size in (1, 2, 3, 7, len(stream)):
        relay = Relay(_books(), _view())
        written = b""
        for i in range(0, len(stream), size):
            out = relay.chunk(stream[i : i + size])
            written += out
            if out:
                assert len(written) in ends, (size, written)
        written += relay.end()
        assert written == stream


def test_a_cut_drops_the_half_event_and_ends_with_the_error_event() -> None:
    stream = b"".join(e + b"\n\n" for e in EVENTS)
    for cut in range(len(stream)):
        relay = Relay(_books(), _view())
        written = relay.chunk(stream[:cut])
        whole = stream[: stream.rfind(b"\n\n", 0, cut) + 2] if b"\n\n" in stream[:cut] else b""
        assert written == whole
        tail = relay.fail()
        assert tail.startswith(b'data: {"error":') and tail.endswith(b"\n\n")
        assert tail.count(b"\n\n") == 1


def test_a_body_that_is_not_sse_is_held_only_up_to_the_bound() -> None:
    relay = Relay(_books(), _view())
    big = b"x" * (MAX_EVENT + 1)
    assert relay.chunk(big[:10]) == b""
    assert relay.chunk(big[10:]) == big
    assert relay.chunk(b"yy") == b""
    assert relay.end() == b"yy"


def test_a_whole_body_is_not_framed() -> None:
    relay = Relay(_books(), _view(stream=False))
    assert relay.chunk(b'{"a":') == b""
    assert relay.chunk(b"1}") == b'{"a":'
    assert relay.end() == b"1}"


def test_the_hold_is_bounds_max_sse_line_bytes(mesh_factory: Any) -> None:
    """What the relay holds of an unfinished event is the config's bound, the one
    the books parse an event within, carried by the books the mesh makes."""
    mesh = mesh_factory(
        workers=["http://127.0.0.1:9"],
        lifecycle={"probe": False},
        bounds={"max_sse_line_bytes": 64},
    )
    match = mesh.resolve("POST", "/v1/chat/completions")
    assert match is not None
    view = mesh.prepare(match, b'{"model":"m","messages":[],"stream":true}', [])
    flow = mesh.forward(view, [])
    attempt = next(flow)
    flow.close()
    books = mesh.account(view, attempt.lease, 200)
    assert books.max_event_bytes == 64
    relay = Relay(books, view)
    assert relay.chunk(b"data: " + b"x" * 50) == b""  # held: within the bound
    assert relay.chunk(b"x" * 20) == b"data: " + b"x" * 70  # past it: passed on
    relay.close()
