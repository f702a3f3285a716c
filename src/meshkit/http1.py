"""
Sans-I/O HTTP/1.1
=================

The HTTP/1.1 bytes (RFC 9112) meshkit writes and parses itself, with no I/O, so
that one copy of each rule serves every side: the request heads the asyncio and
blocking clients send to workers (:mod:`meshkit.upstream.fast`,
:mod:`meshkit.upstream.blocking`), the response parser both drive, and the
response heads and chunks the built-in server (:mod:`meshkit.server.h1.conn`)
and the mock worker write.

Requests: the request line and ``host`` are built once per URL (:func:`http_origin`);
a head is then one ``bytes``, the headers joined in C. Nothing can inject a line:
a header name or value holding CR or LF, a target holding a control character,
or a method that is not a token (RFC 9110 §5.1, §5.5, §9.1) is :class:`Unsendable`.

Responses: :class:`ResponseParser` runs ``httptools`` (llhttp) for a client that
has one request in flight per connection, and hands a :class:`ResponseSink` the
head (names lower-cased; interim 1xx skipped), the body chunks and the end with
its keep-alive verdict.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Final, Protocol
from urllib.parse import quote, urlsplit

import httptools

from meshkit.core.unbound import count_upto, isdigit, lower

__all__ = [
    "LAST_CHUNK",
    "NO_CONTENT",
    "PARSE_ERRORS",
    "Framing",
    "ResponseParser",
    "ResponseSink",
    "Unsendable",
    "build_head",
    "chunk",
    "date_header",
    "ends_with_connection",
    "http_origin",
    "response_head",
    "split_url",
    "status_line",
]

Headers = list[tuple[bytes, bytes]]


class Unsendable(ValueError):
    """The request cannot be written as valid HTTP/1.1 (it would inject a line)."""


# -- requests ---------------------------------------------------------------------------

#: Methods whose semantics anticipate no content (RFC 9110 §9.3): with an empty body
#: they state no ``content-length``; every other method states ``content-length: 0``
#: (§8.6: "SHOULD NOT send ... when the method semantics do not anticipate such data").
NO_CONTENT: Final = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})

_METHODS: Final = {
    m: m.encode() for m in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
}
# RFC 9110 §5.6.2 token characters (a method is a token).
_TCHAR: Final = frozenset(
    b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)
# Kept as they are in a target; anything else printable (space, non-ASCII) is
# percent-encoded, as httpx encodes it.
_TARGET_SAFE: Final = "/?#[]@!$&'()*+,;=:%-._~"
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def build_head(method: str, line: bytes, headers: Headers, size: int) -> bytes:
    """``METHOD`` + ``line`` + headers + ``content-length`` + CRLF, where ``line`` is
    ``b" /target HTTP/1.1\r\nhost: h:p\r\n"`` (from :func:`http_origin`).

    ``size`` is the body's length; an empty body of a :data:`NO_CONTENT` method
    states none. :class:`Unsendable` when the method is not a token or a header
    name or value holds CR or LF."""
    m = _METHODS.get(method)
    if m is None:
        m = method.encode("latin-1", "replace")
        if not m or not method.isascii() or not set(m) <= _TCHAR:
            raise Unsendable(method)
    bare = not size and method in NO_CONTENT
    if not headers:
        if bare:
            return b"%s%s\r\n" % (m, line)
        return b"%s%scontent-length: %d\r\n\r\n" % (m, line, size)
    block = b"\r\n".join([b": ".join(item) for item in headers])  # native joins, no map()
    # The joints put exactly len(headers) - 1 of each; any other is in a header
    # (checked once, on the joined block).
    joints = len(headers) - 1
    over = joints + 1
    if count_upto(block, b"\n", over) != joints or count_upto(block, b"\r", over) != joints:
        raise Unsendable("a header holds CR or LF")
    if bare:
        return b"%s%s%s\r\n\r\n" % (m, line, block)
    return b"%s%s%s\r\ncontent-length: %d\r\n\r\n" % (m, line, block, size)


def split_url(url: str) -> tuple[str, str, int, str, str]:
    """``(scheme, host, port, authority, target)`` of an ``http``/``https`` URL: the
    host in ASCII (IDNA), the authority as ``host`` states it (RFC 9110 §7.2: the
    port only when not the scheme's default) and the origin-form target (RFC 9112
    §3.2.1), percent-encoded where it must be.

    :class:`Unsendable` when the target holds a control character (a CR or LF would
    end the request line); ``ValueError`` when the URL names no http(s) origin."""
    # Checked before urlsplit, which drops tabs, CRs and LFs without a word.
    if (not url.isascii() or not url.isprintable()) and any(c < " " or c == "\x7f" for c in url):
        raise Unsendable("the URL holds a control character")
    parts = urlsplit(url)
    scheme, host = parts.scheme, parts.hostname
    default = _DEFAULT_PORTS.get(scheme)
    if default is None or not host:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or default  # ValueError when not a port
    if not host.isascii():
        host = host.encode("idna").decode("ascii")
    authority = f"[{host}]" if ":" in host else host
    if port != default:
        authority = f"{authority}:{port}"
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    if not target.isascii() or " " in target:
        target = quote(target, safe=_TARGET_SAFE)
    return scheme, host, port, authority, target


def http_origin(url: str) -> tuple[str, str, int, bytes] | None:
    """``(origin key, host, port, request line)`` of an ``http://`` URL, None for
    ``https://``; the line is ``b" /target HTTP/1.1\\r\\nhost: authority\\r\\n"``.
    Raises as :func:`split_url`."""
    scheme, host, port, authority, target = split_url(url)
    if scheme == "https":
        return None
    line = b" %s HTTP/1.1\r\nhost: %s\r\n" % (target.encode(), authority.encode())
    return f"http://{authority}", host, port, line


# -- responses, parsed --------------------------------------------------------------------

#: what :meth:`ResponseParser.feed` raises on bytes that are not an HTTP/1.1 response
#: (a 101 is an upgrade error: nothing meshkit sends asks to switch protocols)
PARSE_ERRORS: Final = (httptools.HttpParserError, httptools.HttpParserUpgrade)

_FRAMING: Final = (b"content-length", b"transfer-encoding")


def ends_with_connection(headers: Headers) -> bool:
    """Whether a response with these headers is delimited by the end of the
    connection (RFC 9112 §6.3: neither ``transfer-encoding`` nor ``content-length``)."""
    return not any(k in _FRAMING for k, _ in headers)


class ResponseSink(Protocol):
    """What a client implements to receive the responses :class:`ResponseParser` reads."""

    def on_head(self, status: int, headers: Headers) -> None: ...

    def on_body(self, body: bytes) -> None:
        """A piece of the body (also called with what follows a response nobody
        asked for, or the body of a response to HEAD: the sink drops those)."""

    def on_end(self, keep_alive: bool) -> None: ...

    def on_unasked(self) -> None:
        """A response head arrived while no request was waiting: the connection is
        out of step and must not be reused."""


class ResponseParser:
    """Responses on one connection, one request at a time.

    Before each request the client sets :attr:`waiting` (and :attr:`head_only` for
    HEAD), then feeds what it receives to :attr:`feed` (which raises
    :data:`PARSE_ERRORS`).
    """

    __slots__ = (
        "_headers",
        "_interim",
        "_keeps_alive",
        "_on_end",
        "_on_head",
        "_on_unasked",
        "_parser",
        "_status",
        "feed",
        "head_only",
        "on_body",
        "waiting",
    )

    def __init__(self, sink: ResponseSink) -> None:
        # Bound once: no method lookup per response. on_body is read by httptools
        # when it is built, below: the sink's own, no hop per chunk.
        self._on_head = sink.on_head
        self._on_end = sink.on_end
        self._on_unasked = sink.on_unasked
        self.on_body = sink.on_body
        self._headers: Headers = []
        self._interim = False
        #: a request is waiting for its response (set by the client, cleared at its end)
        self.waiting = False
        #: the waiting request is a HEAD
        self.head_only = False
        self._parser = parser = httptools.HttpResponseParser(self)
        self.feed = parser.feed_data
        self._status = parser.get_status_code
        self._keeps_alive = parser.should_keep_alive

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((lower(name), value))

    def on_headers_complete(self) -> None:
        headers, self._headers = self._headers, []
        status = self._status()
        if status < 200:
            # RFC 9110 §15.2: an interim response precedes the final one; skipped.
            self._interim = True
            return
        if not self.waiting:
            self._on_unasked()
            return
        self._on_head(status, headers)
        if self.head_only:
            # RFC 9110 §9.3.2: a response to HEAD has no content, whatever its
            # headers say. httptools cannot be told, so it ends here and the
            # connection is not reused (the parser would wait for a body).
            self.waiting = False
            self._on_end(False)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        elif self.waiting:
            self.waiting = False
            self._on_end(self._keeps_alive())


# -- responses, written ------------------------------------------------------------------

_STATUS: Final[dict[int, bytes]] = {}
LAST_CHUNK: Final = b"0\r\n\r\n"


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <reason>`` + CRLF, cached (an unknown status has an empty
    reason, RFC 9112 §4)."""
    line = _STATUS.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase.encode()
        except ValueError:
            reason = b""
        line = _STATUS[status] = b"HTTP/1.1 %d %s\r\n" % (status, reason)
    return line


_date: Final = [0, b""]
#: read from a C static per call, not ``time`` then its ``time`` (two lookups)
_wall_clock: Final = time.time


def date_header() -> bytes:
    """The ``date`` value, recomputed at most once a second."""
    now = int(_wall_clock())
    if now != _date[0]:
        _date[0] = now
        _date[1] = formatdate(now, usegmt=True).encode()
    return _date[1]  # type: ignore[return-value]


class Framing:
    """How a response body is delimited."""

    LENGTH: Final = 0  # Content-Length given
    CHUNKED: Final = 1
    CLOSE: Final = 2  # HTTP/1.0 without a length: the body ends with the connection


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
    Header names and values come from workers (parsed by httptools, which refuses
    CR/LF in them), from meshkit, or unparsed from an app the server hosts
    (``server/h1/bridge.py``); a line holding CR or LF is dropped, so nothing can
    split a response.
    """
    declared = -1 if length is None else length
    alive = keep_alive
    # One flat list joined once: name, ": ", value, CRLF per header line.
    parts: list[bytes] = [status_line(status)]
    ends = 2  # line ends: the status line's and the blank line's
    for item in headers:
        name = item[0]
        if name == b"content-length":
            value = item[1]
            if declared >= 0 or not isdigit(value) or len(value) > 18:
                # ours, a repeat or not a length (past 18 digits, over 10^18 bytes:
                # none a body has, and int() refuses over 4,300 digits): one
                # framing, stated once
                continue
            declared = int(value)
        elif name == b"transfer-encoding" or name == b"connection":
            continue  # ours to decide
        parts.append(name)
        parts.append(b": ")
        parts.append(item[1])
        parts.append(b"\r\n")
        ends += 1
    if length is not None:
        parts.append(b"content-length: %d\r\n" % length)
        ends += 1
    if bodyless or status < 200 or status == 204 or status == 304:
        framing = Framing.LENGTH
        declared = 0
    elif declared >= 0:
        framing = Framing.LENGTH
    elif http11:
        framing = Framing.CHUNKED
        parts.append(b"transfer-encoding: chunked\r\n")
        ends += 1
    else:
        framing = Framing.CLOSE
        alive = False
    if not alive:
        parts.append(b"connection: close\r\n")
        ends += 1
    elif not http11:
        parts.append(b"connection: keep-alive\r\n")  # an HTTP/1.0 client closes without it
        ends += 1
    parts.append(b"\r\n")
    head = b"".join(parts)
    # Each line holds just the CRLF that ends it: one more CR or LF means a name or
    # value held one (checked once on the whole head, not per header). Rare: the
    # head is built again without those lines, as nothing may split a response.
    if count_upto(head, b"\n", ends + 1) != ends or count_upto(head, b"\r", ends + 1) != ends:
        clean = [item for item in headers if not _splits(item[0]) and not _splits(item[1])]
        return response_head(
            status, clean, keep_alive=keep_alive, http11=http11, length=length, bodyless=bodyless
        )
    return head, framing, alive, declared


def _splits(field: bytes) -> bool:
    return 13 in field or 10 in field  # CR, LF (see meshkit.core.unbound)


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (RFC 9112 §7.1)."""
    return b"%x\r\n%s\r\n" % (len(data), data)
