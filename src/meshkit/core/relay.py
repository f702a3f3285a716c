"""
Relaying a response body
========================

Every front end relays a worker's body the same way, by driving one
:class:`Relay` with what its I/O saw: a chunk arrived (:meth:`Relay.chunk`), the
body ended (:meth:`Relay.end`), the worker failed mid-body (:meth:`Relay.fail`),
the front end is done with the response whatever happened (:meth:`Relay.close`).
Each step returns the bytes to write now; the relay keeps the books.

The rules, written once:

* **Books close before the client holds the whole response.** A whole (not
  streamed) body is relayed one chunk behind: the last chunk is written only after
  the books closed (the lease released, Responses affinity taught), so a client
  that sends its next request (``previous_response_id``) the moment it has the
  body finds them closed. A front end whose write hands the bytes over before
  anything else on its loop can run may write first and close right after
  (:meth:`Relay.whole`).
* **A failure after the first byte cannot become an HTTP error.** The stream ends
  with one error event in its own framing, the same bytes in every mode, and the
  worker's breaker hears of it. A body without event framing has no way to say so
  in-band: :attr:`Relay.cut` tells the front end to cut the connection (or raise
  its library's error), as a direct connection would.
* **An event is relayed once it is whole.** A stream's chunk that ends inside
  an event keeps that event's bytes back until its end arrives (a chunk that ends
  on an event boundary, the common case, is written as it is). The client gets the
  worker's bytes, in order, and no later than it could use them; and when the
  worker dies mid-event, the half event is dropped and the error event starts a
  line of its own (glued to a half line, it would be one broken event: the openai
  SDK raises ``JSONDecodeError`` instead of ``APIError``).
* **Closing is exactly once.** A response the front end gives up before its end is
  the client leaving, unless the stream already carried its terminal event (the
  openai SDK stops reading at ``[DONE]``, before the end of the body): that is a
  completion.
"""

from __future__ import annotations

from typing import Final

import msgspec
from mypy_extensions import mypyc_attr

from meshkit.core.endpoints import StreamFormat
from meshkit.core.requests import RequestView

__all__ = [
    "MID_STREAM_CODE",
    "MID_STREAM_MESSAGE",
    "Books",
    "NoBooks",
    "Relay",
    "stream_error_event",
]

#: what a stream cut by the worker ends with, in every mode
MID_STREAM_CODE: Final = "upstream_error"
MID_STREAM_MESSAGE: Final = "the worker failed while streaming the response"
_NONE: Final = StreamFormat.NONE
#: how a chunk that ends an SSE event ends (LF, CR, CRLF framing)
_EVENT_ENDS: Final = (b"\n\n", b"\r\r", b"\n\r\n")


def _event_end(buf: bytes, start: int) -> int:
    """Where the last complete SSE event of ``buf`` ends (0: none), looking for
    its blank line from ``start`` on."""
    end = 0
    for sep in _EVENT_ENDS:
        i = buf.rfind(sep, start)
        if i >= 0 and i + len(sep) > end:
            end = i + len(sep)
    return end


def stream_error_event(fmt: StreamFormat, code: str, message: str) -> bytes:
    """One SSE event that reports ``code`` in ``fmt``'s framing (b"" for non-streams):
    the OpenAI SDK raises on a data payload with an ``error`` key, the Anthropic SDK
    on ``event: error``, the Responses helpers on an ``error`` event."""
    if fmt is StreamFormat.ANTHROPIC:
        data = msgspec.json.encode(
            {"type": "error", "error": {"type": "api_error", "message": message, "code": code}}
        )
        return b"event: error\ndata: " + data + b"\n\n"
    if fmt is StreamFormat.RESPONSES:
        data = msgspec.json.encode(
            {"type": "error", "code": code, "message": message, "param": None}
        )
        return b"event: error\ndata: " + data + b"\n\n"
    if fmt in (StreamFormat.OPENAI, StreamFormat.GENERATE):
        data = msgspec.json.encode(
            {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        )
        return b"data: " + data + b"\n\n"
    return b""


# A base class, not a Protocol: a compiled build calls a relay's books directly
# (per chunk of a stream), where a protocol's method is looked up by name at each
# call. Interpreted subclasses (tests' fakes) are allowed.
@mypyc_attr(allow_interpreted_subclasses=True)
class Books:
    """The accounting of one response (:class:`meshkit.accounting.Accounting`)."""

    __slots__ = ()

    #: the most of an unfinished event the relay holds back (``bounds.max_sse_line_bytes``,
    #: the event the books parse whole); past it the bytes go on as they come (a
    #: body that is not SSE after all, e.g. a JSON answer to a stream request)
    max_event_bytes: int
    #: the stream reported its own failure: the books are closed, relay no more
    stopped: bool

    @property
    def done(self) -> bool:
        """Closed, or the stream carried its terminal event."""
        raise NotImplementedError

    def feed(self, chunk: bytes) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError

    def abort(self, *, client_left: bool = True) -> None:
        raise NotImplementedError


class NoBooks(Books):
    """The books of a body meshkit only passes through: none to keep.

    :param max_event_bytes: 0 for a body passed through (its relay has no stream
        format: nothing is held); tests give a stream's relay more."""

    __slots__ = ("max_event_bytes", "stopped")

    def __init__(self, max_event_bytes: int = 0) -> None:
        self.max_event_bytes = max_event_bytes
        self.stopped = False

    @property
    def done(self) -> bool:
        return False

    def feed(self, chunk: bytes) -> None:
        return None

    def end(self) -> None:
        return None

    def abort(self, *, client_left: bool = True) -> None:
        return None


class Relay:
    """The steps of relaying one body (see the module docstring)."""

    __slots__ = ("_books", "_fmt", "_held", "_hold", "_part", "cut", "finished")

    def __init__(self, books: Books, view: RequestView | None) -> None:
        """:param view: the request; None for one meshkit does not own (passed
        through: relayed as it comes, a failure always a cut)."""
        self._books = books
        stream = view is None or view.stream
        self._hold = not stream
        self._fmt = view.match.endpoint.stream_format if view is not None and stream else _NONE
        self._held = b""
        # A stream's unfinished event (made when a chunk first ends inside one)
        self._part: bytearray | None = None
        #: the body ended (or failed): the books are closed
        self.finished = False
        #: the failure could not be said in-band: the front end must cut the body
        self.cut = False

    def chunk(self, data: bytes) -> bytes:
        """A chunk of the worker's body: accounted; returns what to write now. After
        a chunk that carried the stream's error event :attr:`finished` is set: the
        front end writes this chunk, then ends the body as if the worker had."""
        books = self._books
        books.feed(data)
        if not self._hold:
            if books.stopped:
                self.finished = True
            if self._fmt is _NONE or (not self._part and data.endswith(_EVENT_ENDS)):
                return data
            return self._whole_events(data)
        out, self._held = self._held, data
        return out

    def _whole_events(self, data: bytes) -> bytes:
        """The bytes of a stream up to its last complete event; the rest is kept in
        ``_part`` (appended to, never copied whole per chunk)."""
        part = self._part
        if part is None:
            part = self._part = bytearray()
        k = len(part)
        limit = self._books.max_event_bytes
        # The kept bytes hold no event end, but may end in the first half of one.
        back = min(k, 2)
        end = _event_end(bytes(part[k - back :]) + data if back else data, 0)
        if end == 0:
            part += data
            if len(part) <= limit:
                return b""
            out = bytes(part)
            part.clear()
            return out
        end -= back  # now within data
        out = bytes(part) + data[:end] if k else data[:end]
        part.clear()
        rest = data[end:]
        if len(rest) > limit:
            return out + rest
        part += rest
        return out

    def whole(self, data: bytes) -> bytes:
        """The entire body, known at once, to write now; the front end calls
        :meth:`end` right after the write, with nothing else run in between."""
        self._books.feed(data)
        return data

    def end(self) -> bytes:
        """The worker's body ended: closes the books; returns the rest to write."""
        self.finished = True
        self._books.end()
        out, self._held = self._held, b""
        part = self._part
        if part:
            out = bytes(part)
            part.clear()
        return out

    def fail(self, *, in_band: bool = True) -> bytes:
        """The worker failed mid-body: closes the books (the worker's failure);
        returns the rest to write, ending with the error event when the framing
        has one and ``in_band`` (else :attr:`cut` is set: a client transport
        raises its library's own error instead, as a direct connection would)."""
        self.finished = True
        self._books.abort(client_left=False)
        tail = (
            stream_error_event(self._fmt, MID_STREAM_CODE, MID_STREAM_MESSAGE) if in_band else b""
        )
        self.cut = not tail
        out, self._held = self._held, b""
        if self._part is not None:
            self._part.clear()  # half an event: dropped
        return tail or out

    def close(self) -> None:
        """The front end is done with the response: settles the books once."""
        if self.finished:
            return
        self.finished = True
        books = self._books
        if books.done:
            books.end()
        else:
            books.abort(client_left=True)
