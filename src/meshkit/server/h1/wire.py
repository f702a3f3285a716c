"""
HTTP/1.1 response heads, built as bytes
=======================================

What the built-in server (:mod:`meshkit.server.h1.conn`) writes: status lines cached
per status, header blocks joined in C, and the framing decision (a known
``Content-Length``, else chunked for HTTP/1.1, else read-until-close). Header
names and values come from workers (parsed by httptools, which refuses CR/LF in
them) or from meshkit itself; a value holding CR or LF is dropped here anyway,
so nothing can split a response.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

__all__ = ["Framing", "chunk", "date_header", "response_head", "status_line"]

Headers = list[tuple[bytes, bytes]]

_STATUS: dict[int, bytes] = {}
LAST_CHUNK = b"0\r\n\r\n"


def status_line(status: int) -> bytes:
    line = _STATUS.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase.encode()
        except ValueError:
            reason = b""
        line = _STATUS[status] = b"HTTP/1.1 %d %s\r\n" % (status, reason)
    return line


_date = [0, b""]


def date_header() -> bytes:
    """The ``date`` value, recomputed at most once a second."""
    now = int(time.time())
    if now != _date[0]:
        _date[0] = now
        _date[1] = formatdate(now, usegmt=True).encode()
    return _date[1]  # type: ignore[return-value]


class Framing:
    """How a response body is delimited."""

    LENGTH = 0  # Content-Length given
    CHUNKED = 1
    CLOSE = 2  # HTTP/1.0 without a length: the body ends with the connection


def response_head(
    status: int,
    headers: Headers,
    *,
    keep_alive: bool,
    http11: bool,
    length: int | None = None,
    bodyless: bool = False,
) -> tuple[bytes, int, bool, int]:
    """The response head, its framing, whether the connection stays open and the
    body length it announces (-1: chunked or close-delimited).

    ``length`` adds a ``content-length`` (meshkit's own answers); otherwise a
    ``content-length`` among ``headers`` is used, else the body is chunked
    (HTTP/1.1) or ends with the connection (HTTP/1.0). ``bodyless`` (an answer to
    HEAD), 1xx, 204 and 304 answers have no body whatever the headers say.
    """
    lines = []
    declared = -1 if length is None else length
    for item in headers:
        name = item[0]
        if name == b"content-length":
            value = item[1]
            if declared >= 0 or not value.isdigit():
                continue  # ours, a repeat or not a length: one framing, stated once
            declared = int(value)
        elif name == b"transfer-encoding" or name == b"connection":
            continue  # ours to decide
        lines.append(b": ".join(item))
    block = b"\r\n".join(lines)
    seps = len(lines) - 1
    if block.count(b"\n") != max(seps, 0) or block.count(b"\r") != max(seps, 0):
        # Rare: a name or value held CR or LF. Drop those lines (checked once on
        # the joined block, not per header): nothing may split the response.
        lines = [line for line in lines if b"\r" not in line and b"\n" not in line]
        block = b"\r\n".join(lines)
    tail = []
    if length is not None:
        tail.append(b"content-length: %d" % length)
    if bodyless or status < 200 or status == 204 or status == 304:
        framing = Framing.LENGTH
        declared = 0
    elif declared >= 0:
        framing = Framing.LENGTH
    elif http11:
        framing = Framing.CHUNKED
        tail.append(b"transfer-encoding: chunked")
    else:
        framing = Framing.CLOSE
        keep_alive = False
    if not keep_alive:
        tail.append(b"connection: close")
    elif not http11:
        tail.append(b"connection: keep-alive")  # an HTTP/1.0 client closes without it
    if tail:
        block = b"\r\n".join((block, *tail)) if lines else b"\r\n".join(tail)
    head = status_line(status) + block + b"\r\n\r\n" if block else status_line(status) + b"\r\n"
    return head, framing, keep_alive, declared


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)
