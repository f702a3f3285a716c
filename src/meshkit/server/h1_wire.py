"""
HTTP/1.1 response heads, built as bytes
=======================================

What the built-in server (:mod:`meshkit.server.h1`) writes: status lines cached
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
    lines = [status_line(status)]
    declared = -1 if length is None else length
    for name, value in headers:
        if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name:
            continue
        if name == b"content-length":
            if declared >= 0 or not value.isdigit():
                continue  # ours, a repeat or not a length: one framing, stated once
            declared = int(value)
        elif name == b"transfer-encoding" or name == b"connection":
            continue  # ours to decide
        lines.append(b"%s: %s\r\n" % (name, value))
    if length is not None:
        lines.append(b"content-length: %d\r\n" % length)
    if bodyless or status < 200 or status == 204 or status == 304:
        framing = Framing.LENGTH
        declared = 0
    elif declared >= 0:
        framing = Framing.LENGTH
    elif http11:
        framing = Framing.CHUNKED
        lines.append(b"transfer-encoding: chunked\r\n")
    else:
        framing = Framing.CLOSE
        keep_alive = False
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    elif not http11:
        lines.append(b"connection: keep-alive\r\n")  # an HTTP/1.0 client closes without it
    lines.append(b"\r\n")
    return b"".join(lines), framing, keep_alive, declared


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)
