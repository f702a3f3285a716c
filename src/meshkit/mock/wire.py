"""
HTTP/1.1 and SSE wire helpers for the mock worker
=================================================

:class:`Request` is what the protocol hands the app; a handler answers with one of:

* ``bytes`` — a complete response, written at once (the hot path);
* :class:`Delayed` — a complete response written after a delay;
* :class:`Stream` — a ``Transfer-Encoding: chunked`` response whose events are
  written one chunk each, with a delay before each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import msgspec

from meshkit.http1 import chunk, status_line

__all__ = [
    "Delayed",
    "Reply",
    "Request",
    "Stream",
    "chunk",
    "encode",
    "head",
    "response",
    "sse_data",
    "sse_event",
]

encode = msgspec.json.Encoder().encode


class Request:
    """One parsed HTTP request (raw bytes; decoded only when needed)."""

    __slots__ = ("body", "headers", "keep_alive", "method", "path", "query")

    def __init__(
        self,
        method: bytes,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.path, _, self.query = url.partition(b"?")
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive

    def header(self, lname: bytes) -> bytes | None:
        """The value of header ``lname`` (lower-case), or ``None``."""
        n = len(lname)
        for name, value in self.headers:
            if len(name) == n and name.lower() == lname:
                return value
        return None

    def params(self) -> dict[str, list[str]]:
        """The query parameters (``include[]=a&include[]=b`` → ``{"include[]": ["a", "b"]}``)."""
        return parse_qs(self.query.decode("latin-1"), keep_blank_values=True)


@dataclass(slots=True)
class Delayed:
    """A complete response written after ``delay`` seconds (``before()`` runs just before)."""

    delay: float
    data: bytes
    keep_alive: bool
    before: Callable[[], None] | None = None


@dataclass(slots=True)
class Stream:
    """A chunked response: ``head`` then each ``(delay_s, event)`` as its own chunk."""

    head: bytes
    events: list[tuple[float, bytes]]
    keep_alive: bool
    crash_after: int | None = None


Reply = bytes | Delayed | Stream


def head(
    status: int,
    content_type: bytes | None,
    extra: bytes,
    keep_alive: bool,
    length: int | None,
) -> bytes:
    """Status line and headers; ``length=None`` means chunked.

    ``extra`` is more header lines, each ``b"name: value\\r\\n"``.
    """
    parts = [status_line(status)]
    if content_type is not None:
        parts.append(b"content-type: " + content_type + b"\r\n")
    if length is None:
        parts.append(b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n")
    else:
        parts.append(b"content-length: %d\r\n" % length)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(extra)
    parts.append(b"\r\n")
    return b"".join(parts)


def response(
    status: int,
    body: bytes,
    extra: bytes,
    keep_alive: bool,
    content_type: bytes | None = b"application/json",
) -> bytes:
    """A complete response."""
    return head(status, content_type if body else None, extra, keep_alive, len(body)) + body


def sse_data(obj: Any) -> bytes:
    """A data-only server-sent event."""
    return b"data: " + encode(obj) + b"\n\n"


def sse_event(name: str, obj: Any) -> bytes:
    """A named server-sent event (``event:`` + ``data:``)."""
    return b"event: " + name.encode() + b"\ndata: " + encode(obj) + b"\n\n"
