"""
Stream accounting
=================

A :class:`StreamAccountant` watches a response body go by and learns, without
ever holding the response up, what the router needs once it has ended: when the
first output token arrived (TTFT), the token usage, whether the upstream reported
an error, whether the stream reached its terminal event, and (for the Responses
API) the id of the stored response, which later requests pin to.

It is pure: no clocks, sockets or threads. The caller passes the current time with
every :meth:`~StreamAccountant.feed`, so the time of the first token is the ``now``
of the call whose bytes completed the first-token event.

Theory of operation
-------------------

Framing
    Bytes are fed in whatever pieces the network delivered, down to one byte at a
    time. Line endings (``\\r\\n``, and a bare ``\\r`` too) are normalised to
    ``\\n`` on the way in (a trailing ``\\r`` is held back until the next piece
    shows whether it starts a ``\\r\\n``), so one ``bytes.find(b"\\n\\n")``
    locates every event boundary. Only the unterminated tail is kept between
    calls, and the search resumes where it stopped, so a byte-at-a-time feed stays
    linear. Events are split into ``event:`` / ``data:`` lines (comments dropped,
    several ``data:`` lines joined with ``\\n``) and handed to the handler of the
    stream format.

Laziness
    JSON is decoded only when an event can change what is known. Named events
    (Responses, Anthropic) are told apart by their ``event:`` line, so text deltas
    are never decoded. OpenAI chunks are decoded until the first token; after it,
    a chunk is decoded only if its bytes hold an ``"error"`` key, and a chunk with
    a non-null ``"usage"`` is just kept: it is decoded when
    :attr:`~StreamAccountant.usage` is read.
    SGLang ``/generate`` repeats ``meta_info`` in every chunk, so only the last raw
    chunk (per batch index) is kept, for the same lazy decode. Responses lifecycle
    events are decoded against a struct naming only ``id``, ``usage``, ``error``
    and ``background``, so the (possibly large) output they repeat is skipped, not
    built.

Background responses
    A Response generated in the background (``background: true``) has its usage
    only once it has ended, and a client reads it back (``GET
    /v1/responses/{id}``) as often as it likes. The accountant reports whether the
    Response it saw had ended in the background
    (:attr:`~StreamAccountant.background_ended`); whether its usage is counted
    (once per process) is the books' decision (:mod:`meshkit.accounting`).

Bounds and failure
    An event (or a non-streaming body) longer than ``max_line_bytes`` sets
    :attr:`~StreamAccountant.overflow` and stops all parsing; malformed JSON is
    counted in :attr:`~StreamAccountant.malformed` and skipped. Nothing here raises
    on what an upstream sends. After the terminal event, further bytes are ignored.
    At :meth:`~StreamAccountant.finish`, complete lines of an event the server
    never closed with a blank line still count; a line cut mid-way does not.

Non-streaming bodies
    They are buffered (within the same bound) and decoded once, in
    :meth:`~StreamAccountant.finish`; ``done`` then means the body was one whole
    JSON document. A streaming request that was answered with a plain JSON body
    (typically an error) is accounted the same way.

Errors are reported as a short code or type (``rate_limit_exceeded``,
``overloaded_error``), never as message text, which may quote the prompt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

import msgspec

from meshkit.core.endpoints import StreamFormat
from meshkit.core.shapes import Answer, Indexed, Lifecycle, StateAnswer

__all__ = ["StreamAccountant", "Usage"]


class Usage:
    """Token usage of one response.

    A plain class, not a dataclass: a compiled build runs a dataclass's generated
    ``__init__`` interpreted, and one is built per request.
    """

    __slots__ = ("cached_tokens", "input_tokens", "output_tokens")

    def __init__(
        self, input_tokens: int = 0, output_tokens: int = 0, cached_tokens: int = 0
    ) -> None:
        #: total prompt/input tokens (Anthropic: input + cache creation + cache read)
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        #: input tokens served from the prefix cache
        self.cached_tokens = cached_tokens

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Usage):
            return NotImplemented
        return (
            self.input_tokens == other.input_tokens
            and self.output_tokens == other.output_tokens
            and self.cached_tokens == other.cached_tokens
        )

    def __repr__(self) -> str:
        return (
            f"Usage(input_tokens={self.input_tokens}, output_tokens={self.output_tokens}, "
            f"cached_tokens={self.cached_tokens})"
        )


# Looked up through the module so tests can count decodes.
_decode = msgspec.json.decode
# msgspec raises RecursionError, not DecodeError, on very deep nesting.
_DECODE_ERRORS: Final = (msgspec.DecodeError, RecursionError)


_lifecycle_decoder: Final = msgspec.json.Decoder(Lifecycle)
_index_decoder: Final = msgspec.json.Decoder(Indexed)
#: bound once: a call skips the lookup of ``decode`` (meshkit.core.unbound)
_decode_answer: Final = msgspec.json.Decoder(Answer).decode
_decode_state_answer: Final = msgspec.json.Decoder(StateAnswer).decode

# Read per request: a module global is cheaper than an enum member's attribute.
_NONE: Final = StreamFormat.NONE
_RESPONSES: Final = StreamFormat.RESPONSES
_DONE: Final = b"[DONE]"
_BOM: Final = b"\xef\xbb\xbf"
# After a "usage" key: a non-null value never starts with "n", and whitespace
# around ":" is legal JSON.
_NON_NULL: Final = re.compile(rb"\s*:\s*[^\sn]")
# Codes are identifiers; anything with spaces could be message text.
_CODE: Final = re.compile(r"[\w.:-]{1,64}", re.ASCII)

_DELTA_OUTPUT: Final = (
    "content",
    "refusal",
    "tool_calls",
    "reasoning_content",
    "reasoning",
    "function_call",
    "audio",
)

# Every delta of what the model writes (text, refusal, reasoning, a tool call's
# input, audio); not what a tool returns (shell_call_output_content, images).
_R_FIRST: Final = frozenset(
    {
        b"response.output_text.delta",
        b"response.refusal.delta",
        b"response.function_call_arguments.delta",
        b"response.reasoning_text.delta",
        b"response.reasoning_summary_text.delta",
        b"response.custom_tool_call_input.delta",
        b"response.mcp_call_arguments.delta",
        b"response.code_interpreter_call_code.delta",
        b"response.shell_call_command.delta",
        b"response.audio.delta",
        b"response.audio.transcript.delta",
    }
)
_R_TERMINAL: Final = frozenset({b"response.completed", b"response.failed", b"response.incomplete"})
_R_START: Final = frozenset({b"response.created", b"response.queued", b"response.in_progress"})
#: the statuses of a Response that has ended (its usage is final)
_ENDED: Final = frozenset({"completed", "incomplete", "failed", "cancelled"})

_ANTHROPIC_USAGE: Final = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
)

_Handler = Callable[[bytes | None, bytes, float], None]
_HANDLERS: Final = {
    StreamFormat.OPENAI: "_on_openai",
    StreamFormat.RESPONSES: "_on_responses",
    StreamFormat.ANTHROPIC: "_on_anthropic",
    StreamFormat.GENERATE: "_on_generate",
}


def _ignore(name: bytes | None, payload: bytes, now: float) -> None:
    return None


def _int(v: object) -> int:
    if type(v) is int:  # the common case, without two isinstance calls
        return v if v > 0 else 0
    if isinstance(v, int) and not isinstance(v, bool):
        return v if v > 0 else 0
    if isinstance(v, float) and v.is_integer() and v > 0:
        return int(v)
    return 0


def _code(err: object, default: str) -> str:
    """A short, identifier-like error code from an error object, else ``default``."""
    if isinstance(err, dict):
        for key in ("code", "type"):
            v = err.get(key)
            if isinstance(v, str) and _CODE.fullmatch(v):
                return v
        v = err.get("code")
        if isinstance(v, int) and not isinstance(v, bool):
            return str(v)
    return default


def _usage_from(u: object) -> Usage | None:
    """Usage from any of the shapes: OpenAI, Responses, Anthropic or SGLang meta_info."""
    if not isinstance(u, dict):
        return None
    if "prompt_tokens" in u or "completion_tokens" in u:
        details = u.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = _int(details.get("cached_tokens"))
        else:
            cached = _int(u.get("cached_tokens"))  # SGLang meta_info
        return Usage(_int(u.get("prompt_tokens")), _int(u.get("completion_tokens")), cached)
    if "input_tokens" in u or "output_tokens" in u:
        # Responses has no cache_* fields and counts cached tokens inside
        # input_tokens; Anthropic counts them apart. One sum serves both.
        read = _int(u.get("cache_read_input_tokens"))
        details = u.get("input_tokens_details")
        cached = read or (_int(details.get("cached_tokens")) if isinstance(details, dict) else 0)
        total = _int(u.get("input_tokens")) + _int(u.get("cache_creation_input_tokens")) + read
        return Usage(total, _int(u.get("output_tokens")), cached)
    if "total_tokens" in u:
        # a pooling answer (older vLLM rerank): all of it is input
        return Usage(_int(u.get("total_tokens")), 0, 0)
    return None


def _usage_set(payload: bytes) -> bool:
    """Whether a chunk may hold a non-null ``usage`` (false positives only cost a decode)."""
    # Servers put usage last, so searching from the end finds it at once.
    i = payload.rfind(b'"usage"')
    while i >= 0:
        if _NON_NULL.match(payload, i + 7) is not None:
            return True
        i = payload.rfind(b'"usage"', 0, i)
    return False


def _batch_index(payload: bytes) -> int:
    try:
        return _int(_index_decoder.decode(payload).index)
    except _DECODE_ERRORS:
        return 0  # counted as malformed when the usage is read


def _ended_in_background(background: object, status: object) -> bool:
    """Whether a Response object says it was generated in the background and ended."""
    return background is True and isinstance(status, str) and status in _ENDED


def _add(a: Usage, b: Usage) -> Usage:
    return Usage(
        a.input_tokens + b.input_tokens,
        a.output_tokens + b.output_tokens,
        a.cached_tokens + b.cached_tokens,
    )


def _delta_has_output(d: object) -> bool:
    return isinstance(d, dict) and any(d.get(k) for k in _DELTA_OUTPUT)


def _choices_have_output(choices: object, key: str) -> bool:
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            continue
        text = c.get("text")
        if (isinstance(text, str) and text) or _delta_has_output(c.get(key)):
            return True
    return False


def _body_has_output(item: dict[str, Any]) -> bool:
    """Whether a complete (non-streamed) body of any format carries output.

    The keys read here are :class:`~meshkit.core.shapes.Answer`'s raw fields too
    (:func:`_holds_no_output`): a format that adds one adds it to both."""
    if _choices_have_output(item.get("choices"), "message"):
        return True
    # Responses `output`, Anthropic `content`, SGLang `output_ids`; a Response
    # also has a `text` key, but it is a config object, hence the type checks.
    for key in ("output", "content", "output_ids"):
        v = item.get(key)
        if isinstance(v, list) and v:
            return True
    text = item.get("text")
    return isinstance(text, str) and bool(text)


#: an output key's raw value that holds no output (absent, null, empty)
_EMPTY_RAW: Final = (b"", b"null", b"[]", b'""')


def _empty(raw: msgspec.Raw) -> bool:
    return len(raw) <= 4 and bytes(raw) in _EMPTY_RAW  # never copies a long value


def _holds_no_output(ans: Answer) -> bool:
    """Whether an answer has none of the keys that carry output, or only empty ones
    (a pooling answer: its vectors are never decoded); anything else is decided
    by :func:`_body_has_output` on the whole body."""
    return (
        _empty(ans.choices)
        and _empty(ans.output)
        and _empty(ans.content)
        and _empty(ans.output_ids)
        and _empty(ans.text)
    )


class StreamAccountant:
    """Feed it the response body bytes as they arrive; it tells first-token time,
    usage, errors and the end.

    :param fmt: the stream format of the endpoint; :attr:`StreamFormat.NONE` is
        accounted as a non-streaming body.
    :param streaming: whether the response is a stream (the request asked for one).
    :param started_at: the time the request was sent, for :attr:`ttft`.
    :param max_line_bytes: the longest SSE event (or non-streaming body) parsed.
    :param state_ids: a whole body is a stored state object whose ``id`` is
        :attr:`response_id` (None: for Responses bodies only).
    """

    __slots__ = (
        "_anthropic_usage",
        "_buf",
        "_cr",
        "_events",
        "_gen_raw",
        "_gen_usage",
        "_handler",
        "_scan",
        "_sse",
        "_stopped",
        "_usage",
        "_usage_raw",
        "background_ended",
        "done",
        "error",
        "first_token_at",
        "fmt",
        "malformed",
        "max_line_bytes",
        "overflow",
        "response_id",
        "started_at",
        "state_ids",
        "streaming",
    )

    def __init__(
        self,
        fmt: StreamFormat,
        *,
        streaming: bool,
        started_at: float,
        max_line_bytes: int = 1 << 20,
        state_ids: bool | None = None,
    ) -> None:
        self.fmt = fmt
        self.state_ids = fmt is _RESPONSES if state_ids is None else state_ids
        self.streaming = streaming
        self.started_at = started_at
        self.max_line_bytes = max_line_bytes
        #: time of the first output token (None if never)
        self.first_token_at: float | None = None
        #: short error type/code seen in the stream or body
        self.error: str | None = None
        #: a terminal event was seen (non-streaming: the body was a JSON document)
        self.done = False
        #: an event or body exceeded max_line_bytes; parsing stopped there
        self.overflow = False
        #: data payloads (or bodies) that were not a JSON object
        self.malformed = 0
        #: the Responses API id of the stored response (or conversation)
        self.response_id: str | None = None
        #: the Response (a stored-state body, or a stream's terminal event) was
        #: generated in the background (``background: true``) and has ended
        #: (completed, incomplete, failed, cancelled): its usage is final
        self.background_ended = False
        self._sse = streaming and fmt is not _NONE
        self._buf = bytearray()
        self._scan = 0
        self._cr = False
        self._stopped = False
        self._events = 0
        self._usage: Usage | None = None
        self._usage_raw: bytes | None = None
        self._gen_raw: dict[int, bytes] = {}
        self._gen_usage: dict[int, Usage] = {}
        self._anthropic_usage = [0, 0, 0, 0]
        # Only SSE bodies are framed into events (no bound method otherwise).
        self._handler: _Handler = (
            getattr(self, _HANDLERS.get(fmt, "_on_ignored")) if self._sse else _ignore
        )

    # -- results ---------------------------------------------------------------

    @property
    def ttft(self) -> float | None:
        """Time to first token: ``first_token_at - started_at``."""
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.started_at

    @property
    def usage(self) -> Usage | None:
        """The token usage reported so far (the last report wins)."""
        if self._usage_raw is not None:
            raw, self._usage_raw = self._usage_raw, None
            obj = self._json(raw)
            if obj is not None:
                self._usage = _usage_from(obj.get("usage")) or self._usage
        if self._gen_raw:
            for idx, raw in self._gen_raw.items():
                obj = self._json(raw)
                u = _usage_from(obj.get("meta_info")) if obj is not None else None
                if u is not None:
                    self._gen_usage[idx] = u
            self._gen_raw.clear()
            self._sum_generate()
        return self._usage

    # -- input -----------------------------------------------------------------

    def feed(self, data: bytes, now: float) -> None:
        """Account the next piece of the body, received at ``now``."""
        if self._stopped or not data:
            return
        if not self._sse:
            if len(self._buf) + len(data) > self.max_line_bytes:
                self._set_overflow()
            else:
                self._buf += data
            return
        if self._cr:
            data = b"\r" + data
            self._cr = False
        if data.endswith(b"\r"):
            # Maybe the first half of a CRLF: the next piece decides.
            data = data[:-1]
            self._cr = True
        if 13 in data:  # CR (meshkit.core.unbound: a one-byte ``in``)
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        pending = self._buf
        if pending:
            pending += data
            if pending.find(b"\n\n", self._scan) < 0:
                self._scan = len(pending) - 1
                # The tail may end in the first "\n" of its terminator.
                if len(pending) > self.max_line_bytes + 1:
                    self._set_overflow()
                return
            data = bytes(pending)
            pending.clear()
            self._consume(data, self._scan, now)
        else:
            self._consume(data, 0, now)

    def finish(self, now: float) -> None:
        """The body has ended at ``now`` (a non-streaming body is decoded here)."""
        if self._stopped:
            return
        self._stopped = True
        if not self._sse:
            self._finish_body(self._buf, now)  # decoded in place, not copied
            self._buf.clear()
            return
        tail = bytes(self._buf)
        self._buf.clear()
        if self._cr:
            tail += b"\n"
            self._cr = False
        if self._events == 0 and tail.lstrip()[:1] in (b"{", b"["):
            self._finish_body(tail, now)
            return
        # Be lenient with a server that closed without the final blank line:
        # every complete line it sent still counts.
        cut = tail.rfind(b"\n")
        if cut >= 0:
            self._stopped = False
            self._consume(tail[:cut] + b"\n\n", 0, now)
            self._stopped = True
            self._buf.clear()

    # -- framing ---------------------------------------------------------------

    def _consume(self, buf: bytes, scan: int, now: float) -> None:
        start = 0
        limit = self.max_line_bytes
        while True:
            end = buf.find(b"\n\n", scan)
            if end < 0:
                break
            if end - start > limit:
                self._set_overflow()
                return
            self._event(buf[start:end], now)
            if self._stopped:
                return
            start = scan = end + 2
        tail = len(buf) - start
        if tail:
            if tail > limit + 1:
                self._set_overflow()
                return
            self._buf += buf[start:]
            self._scan = tail - 1
        else:
            self._scan = 0

    def _event(self, ev: bytes, now: float) -> None:
        name: bytes | None = None
        nl = ev.find(b"\n")
        # Fast paths for the two shapes real servers send.
        if nl < 0 and ev.startswith(b"data:"):
            payload = ev[6:] if ev.startswith(b" ", 5) else ev[5:]
        elif (
            ev.startswith(b"event:")
            and ev.startswith(b"data:", nl + 1)
            and ev.find(b"\n", nl + 1) < 0
        ):
            name = ev[7:nl] if ev.startswith(b" ", 6) else ev[6:nl]
            payload = ev[nl + 7 :] if ev.startswith(b" ", nl + 6) else ev[nl + 6 :]
        else:
            parts: list[bytes] = []
            for line in ev.split(b"\n"):
                if not line or line.startswith(b":"):
                    continue
                field, _, value = line.partition(b":")
                if field.startswith(_BOM):
                    field = field[3:]
                if value.startswith(b" "):
                    value = value[1:]
                if field == b"data":
                    parts.append(value)
                elif field == b"event":
                    name = value
            if not parts:
                return  # SSE dispatches no event without data
            payload = parts[0] if len(parts) == 1 else b"\n".join(parts)
        self._events += 1
        self._handler(name or None, payload, now)

    # -- format handlers ---------------------------------------------------------

    def _on_ignored(self, name: bytes | None, payload: bytes, now: float) -> None:
        return None

    def _on_openai(self, name: bytes | None, payload: bytes, now: float) -> None:
        if payload.startswith(_DONE):
            self._set_done()
            return
        if self.first_token_at is not None and payload.find(b'"error"') < 0:
            if _usage_set(payload):
                self._usage_raw = payload
            return
        obj = self._json(payload)
        if obj is None:
            return
        u = _usage_from(obj.get("usage"))
        if u is not None:
            self._usage = u
            self._usage_raw = None
        if self.first_token_at is None and _choices_have_output(obj.get("choices"), "delta"):
            self.first_token_at = now
        err = obj.get("error")
        if err is not None:
            self.error = _code(err, "error")
            self._set_done()

    def _named(
        self, name: bytes | None, payload: bytes
    ) -> tuple[bytes, dict[str, Any] | None] | None:
        """The event name of a named-event stream, from its ``event:`` line or, when
        a server left that out, from the payload's ``type`` (decoded then, and
        returned). None when the event was handled here ([DONE], junk, a bare error)."""
        if name is not None and name != b"message":
            return name, None
        if payload.startswith(_DONE):
            self._set_done()
            return None
        obj = self._json(payload)
        if obj is None:
            return None
        kind = obj.get("type")
        if not isinstance(kind, str):
            self._bare_error(obj)
            return None
        return kind.encode(), obj

    def _on_responses(self, name: bytes | None, payload: bytes, now: float) -> None:
        named = self._named(name, payload)
        if named is None:
            return
        name, obj = named
        if name in _R_FIRST:
            if self.first_token_at is None:
                self.first_token_at = now
            return
        terminal = name in _R_TERMINAL
        if terminal or (name in _R_START and self.response_id is None):
            rid: Any = None
            usage: Any = None
            err: Any = None
            background: Any = None
            if obj is not None:
                resp = obj.get("response")
                if isinstance(resp, dict):
                    rid, usage, err = resp.get("id"), resp.get("usage"), resp.get("error")
                    background = resp.get("background")
            else:
                try:
                    ev = _lifecycle_decoder.decode(payload)
                except _DECODE_ERRORS:
                    self.malformed += 1
                else:
                    if ev.response is not None:
                        r = ev.response
                        rid, usage, err, background = r.id, r.usage, r.error, r.background
            if (
                isinstance(rid, str)
                and rid
                and (self.response_id is None or name == b"response.completed")
            ):
                self.response_id = rid
            if terminal:
                u = _usage_from(usage)
                if u is not None:
                    self._usage = u
                if name == b"response.failed":
                    self.error = _code(err, "failed")
                # every terminal event is of a Response that has ended
                self.background_ended = background is True
                self._set_done()
            return
        if name == b"error":
            if obj is None:
                obj = self._json(payload)
            if obj is None:
                self.error = "error"
            else:
                # The spec's event is flat; tolerate a nested error object too.
                nested = obj.get("error")
                self.error = _code(nested if isinstance(nested, dict) else obj, "error")
            self._set_done()
        elif payload.startswith(_DONE):
            self._set_done()

    def _on_anthropic(self, name: bytes | None, payload: bytes, now: float) -> None:
        named = self._named(name, payload)
        if named is None:
            return
        name, obj = named
        if name == b"content_block_delta":
            if self.first_token_at is None:
                self.first_token_at = now
        elif name == b"message_start":
            obj = obj if obj is not None else self._json(payload)
            if obj is not None:
                msg = obj.get("message")
                if isinstance(msg, dict):
                    self._anthropic_update(msg.get("usage"))
        elif name == b"message_delta":
            obj = obj if obj is not None else self._json(payload)
            if obj is not None:
                self._anthropic_update(obj.get("usage"))
        elif name == b"message_stop":
            self._set_done()
        elif name == b"error":
            obj = obj if obj is not None else self._json(payload)
            self.error = _code(obj.get("error") if obj is not None else None, "error")
            self._set_done()

    def _anthropic_update(self, u: object) -> None:
        if not isinstance(u, dict):
            return
        # message_delta usage is cumulative and its input/cache fields optional:
        # a field that is present replaces the earlier value, one that is not keeps it.
        parts = self._anthropic_usage
        for i, key in enumerate(_ANTHROPIC_USAGE):
            v = u.get(key)
            if v is not None:
                parts[i] = _int(v)
        self._usage = Usage(parts[0] + parts[1] + parts[2], parts[3], parts[2])

    def _on_generate(self, name: bytes | None, payload: bytes, now: float) -> None:
        if payload.startswith(_DONE):
            self._set_done()
            return
        if self.first_token_at is not None and payload.find(b'"error"') < 0:
            # Only a batch carries an index; its usage is summed over the items.
            idx = _batch_index(payload) if b'"index"' in payload else 0
            self._gen_raw[idx] = payload
            return
        obj = self._json(payload)
        if obj is None:
            return
        idx = _int(obj.get("index"))
        u = _usage_from(obj.get("meta_info"))
        if u is not None:
            self._gen_raw.pop(idx, None)
            self._gen_usage[idx] = u
            self._sum_generate()
        if self.first_token_at is None:
            text, ids = obj.get("text"), obj.get("output_ids")
            if (isinstance(text, str) and text) or (isinstance(ids, list) and ids):
                self.first_token_at = now
        err = obj.get("error")
        if err is not None:
            self.error = _code(err, "error")
            self._set_done()

    def _sum_generate(self) -> None:
        total: Usage | None = None
        for u in self._gen_usage.values():
            total = u if total is None else _add(total, u)
        if total is not None:
            self._usage = total

    # -- helpers -----------------------------------------------------------------

    def _bare_error(self, obj: dict[str, Any]) -> None:
        """A payload without a type: an OpenAI-style ``{"error": ...}`` ends the stream."""
        err = obj.get("error")
        if err is not None:
            self.error = _code(err, "error")
            self._set_done()

    def _finish_body(self, body: bytes | bytearray, now: float) -> None:
        if not body or body.isspace():  # strip() would copy the body
            return
        if body[:1] == b"{" and self._finish_answer(body, now):
            return
        try:
            obj = _decode(body)
        except _DECODE_ERRORS:
            self.malformed += 1
            return
        if isinstance(obj, dict):
            items: list[Any] = [obj]
        elif isinstance(obj, list):
            items = obj  # SGLang /generate answers a batch with a list
        else:
            self.malformed += 1
            return
        self.done = True
        total: Usage | None = None
        output = False
        for item in items:
            if not isinstance(item, dict):
                continue
            err = item.get("error")
            if err is None and item.get("object") == "error":
                err = item  # older vLLM: a flat error object
            if err is not None and self.error is None:
                self.error = _code(err, "error")
            u = _usage_from(item.get("usage")) or _usage_from(item.get("meta_info"))
            if u is not None:
                total = u if total is None else _add(total, u)
            output = output or _body_has_output(item) or (u is not None and u.output_tokens > 0)
        if total is not None:
            self._usage = total
        if output:
            self.first_token_at = now
        if self.state_ids and isinstance(obj, dict):
            rid = obj.get("id")
            if isinstance(rid, str) and rid:
                self.response_id = rid
            self.background_ended = _ended_in_background(obj.get("background"), obj.get("status"))

    def _finish_answer(self, body: bytes | bytearray, now: float) -> bool:
        """The common answer (one object, usage with output, no error) from its
        few fields alone; False: read it whole (:meth:`_finish_body`)."""
        state = self.state_ids
        try:
            ans = _decode_state_answer(body) if state else _decode_answer(body)
        except _DECODE_ERRORS:
            return False  # the whole read counts it
        if ans.error is not None or ans.object == "error":
            return False
        u = _usage_from(ans.usage) or _usage_from(ans.meta_info)
        if u is None:
            return False
        if u.output_tokens <= 0 and not _holds_no_output(ans):
            return False  # whether it holds output is in the choices
        self.done = True
        self._usage = u
        if u.output_tokens > 0:
            self.first_token_at = now
        if state:
            rid = ans.id
            if isinstance(rid, str) and rid:
                self.response_id = rid
            if isinstance(ans, StateAnswer):
                self.background_ended = _ended_in_background(ans.background, ans.status)
        return True

    def _json(self, payload: bytes) -> dict[str, Any] | None:
        try:
            obj = _decode(payload)
        except _DECODE_ERRORS:
            self.malformed += 1
            return None
        if not isinstance(obj, dict):
            self.malformed += 1
            return None
        return obj

    def _set_done(self) -> None:
        self.done = True
        self._stopped = True
        self._buf.clear()

    def _set_overflow(self) -> None:
        self.overflow = True
        self._stopped = True
        self._cr = False
        self._buf.clear()
