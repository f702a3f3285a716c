"""Routed with the fast relay: how a worker's response reaches the Downstream.

A body that arrived whole with its head is handed over in one ``end`` (no
``body`` calls: the built-in server writes head and body at once); a body still
arriving is relayed chunk by chunk; a worker that dies mid-body ends the response
with its error tail. In every case the books close (the lease is released)
before the loop runs anything else after the last ``end``: before it can read the
client's next request.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from typing import Any

from meshkit import Mesh
from meshkit.frontends.routed import Headers, Routed
from meshkit.upstream.fast import FastUpstream
from upstreams import CHAT, RawServer

BODY = json.dumps({"id": "x", "choices": [{"message": {"content": "hi"}}]}).encode()
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
PROBE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class Recorder:
    """A Downstream that records its calls, and the mesh's load at ``end``."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.calls: list[Any] = []

    async def start(self, status: int, headers: Headers) -> None:
        self.calls.append(("start", status))

    async def body(self, chunk: bytes) -> None:
        self.calls.append(("body", chunk))

    async def end(self, chunk: bytes = b"") -> None:
        # The load the loop's next callback (the client's next request) would see.
        entry: list[Any] = ["end", chunk]
        self.calls.append(entry)
        asyncio.get_running_loop().call_soon(lambda: entry.append(self.mesh.total_load()))

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.calls.append(("whole", status, body))


Reply = Callable[[socket.socket], bool]


def route_through(reply: Reply) -> tuple[list[tuple[Any, ...]], int]:
    """Route one chat request to a worker answering with ``reply``: the Downstream
    calls, and the load left once settled."""

    def script(srv: Any, s: socket.socket, n: int, head: bytes, body: bytes) -> bool:
        if head.startswith(b"GET"):  # health probes
            s.sendall(PROBE)
            return True
        return reply(s)

    async def go() -> tuple[list[tuple[Any, ...]], int]:
        with RawServer(script) as srv:
            mesh = Mesh(workers=[srv.url])
            upstream = FastUpstream(mesh.config.upstream)
            try:
                down = Recorder(mesh)
                match = mesh.resolve("POST", "/v1/chat/completions")
                assert match is not None
                routed = Routed(mesh, upstream, match, down)
                await routed.run("POST", json.dumps(CHAT).encode(), [], "")
                await asyncio.sleep(0)  # the callbacks end() scheduled
                return [tuple(c) for c in down.calls], mesh.total_load()
            finally:
                await upstream.aclose()
                mesh.close()

    result: tuple[list[tuple[Any, ...]], int] = asyncio.run(go())
    return result


def _whole(s: socket.socket) -> bool:
    s.sendall(HEAD % len(BODY) + BODY)
    return True


def _pieces(s: socket.socket) -> bool:
    s.sendall(HEAD % len(BODY) + BODY[:10])
    time.sleep(0.05)
    s.sendall(BODY[10:])
    return True


def _dies_mid_body(s: socket.socket) -> bool:
    s.sendall(HEAD % (len(BODY) + 100) + BODY)
    time.sleep(0.05)
    return False  # closes the connection, 100 bytes short


def test_a_body_that_arrived_with_its_head_is_one_end() -> None:
    calls, load = route_through(_whole)
    assert calls == [("start", 200), ("end", BODY, 0)]  # released before the next callback
    assert load == 0


def test_a_body_still_arriving_is_relayed_in_chunks() -> None:
    """One chunk behind: the last piece goes with the end, after the books closed."""
    calls, load = route_through(_pieces)
    assert calls[0] == ("start", 200)
    assert [c[0] for c in calls[1:-1]] == ["body"] * (len(calls) - 2)
    assert b"".join(c[1] for c in calls[1:]) == BODY
    assert len(calls) >= 3  # at least one piece before the last
    end = calls[-1]
    assert end[0] == "end" and end[1] and end[2] == 0
    assert load == 0


def test_a_worker_dying_mid_body_ends_with_the_error_tail() -> None:
    calls, load = route_through(_dies_mid_body)
    assert calls[0] == ("start", 200)
    assert b"".join(c[1] for c in calls[1:]) == BODY  # no event framing: no tail
    last = calls[-1]
    assert last[0] == "end" and last[2] == 0
    assert load == 0
