"""Shared by the upstream clients' tests: attempts built by hand (no mesh, no lease
to keep), headers that would inject a line, and scripted response bytes."""

from __future__ import annotations

from typing import Any

from meshkit.core.forward import Attempt

JSON = [(b"content-type", b"application/json")]
#: headers whose name or value would inject a line into a request head
INJECTED_HEADERS = [
    (b"x-a", b"1\r\nx-injected: 1"),
    (b"x-a", b"1\nx-injected: 1"),
    (b"x-a", b"1\r"),
    (b"x-a\r\nx-injected", b"1"),
    (b"x-a\n", b"1"),
]


class FakeLease:
    """A lease that holds nothing: the upstream clients never look into it."""

    candidate: Any = None
    started = 0.0

    def release(self, *, ok: bool, status: int | None = None) -> None:
        return None


def attempt(
    url: str,
    body: bytes = b"",
    *,
    method: str = "POST",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> Attempt:
    """One attempt to ``url`` (JSON content type unless ``headers`` are given)."""
    return Attempt(
        number=0,
        candidate=None,  # type: ignore[arg-type]
        lease=FakeLease(),
        method=method,
        url=url,
        headers=list(JSON if headers is None else headers),
        body=body,
    )


def ch(data: bytes, ext: bytes = b"") -> bytes:
    """One chunk of a chunked body (with an optional chunk extension)."""
    return b"%x%s\r\n%s\r\n" % (len(data), ext, data)


#: an SSE answer in chunks, split across writes, with mixed-case header names
CHUNKED_SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"X-Mixed-Case: Kept\r\n\r\n",
    ch(b"data: a"),
    ch(b"\n\n"),
    ch('data: {"k": "\u00e9\u20ac"}\n\n'.encode(), b";ext=1"),
    ch(b"data: [DONE]") + ch(b"\n\n") + b"0\r\n\r\n",
)
