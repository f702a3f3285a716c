"""
Request views
=============

A request body is parsed once (msgspec, typed structs) into a
:class:`RequestView`: the few facts placement needs, while the body itself is
forwarded as the client's original bytes.

Validation is as permissive as the backends: only the fields
meshkit reads are typed, and only loosely. ``max_tokens`` is not required,
``temperature`` is not capped, ``top_k: -1`` is fine, every role is accepted.
Unusable JSON or a field meshkit reads having the wrong type is a 400.

The *routing text* is the prompt in prompt order: the system prompt (or
instructions), then the tools, then messages / input — the order chat templates
render them in — so two requests sharing a system prompt and tools share a text
prefix (alphabetical order would break prefix matching).
It is only built when the policy needs it.

Responses state: ``previous_response_id``, ``conversation`` (a string or
``{"id": ...}``) and ``item_reference`` input items (including items that are
only ``{"id": ...}``, since ``type`` is optional on item references) mark a request
as stateful. The first two name a stored object a router can look up when it does
not know its owner (:attr:`RequestView.state_id`, :attr:`RequestView.state_path`);
an item id cannot be: no endpoint answers for an item alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Final
from urllib.parse import parse_qsl, quote

import msgspec

from meshkit.core.endpoints import ENDPOINTS, Api, Match, Op, StreamFormat, check_id
from meshkit.core.shapes import (
    AnyBody,
    ChatBody,
    CompletionBody,
    GenerateBody,
    Json,
    MessagesBody,
    ResponsesBody,
)
from meshkit.core.unbound import count_upto, find, isdigit, isspace
from meshkit.errors import HeadersTooLarge, InvalidRequest, UnsupportedMediaType, body_over

__all__ = [
    "MAX_JSON_DEPTH",
    "ClientTimeout",
    "LocalResponse",
    "RequestView",
    "Timeouts",
    "check_declared",
    "check_head",
    "check_media",
    "declared_over",
    "head_error",
    "parse_request",
    "query_streams",
]

#: default of ``bounds.max_json_depth``
MAX_JSON_DEPTH: Final = 64


#: bound once: a call skips the lookup of ``decode`` (meshkit.core.unbound)
_decode_any: Final = msgspec.json.Decoder(AnyBody).decode
# Read per request: module globals are cheaper than enum members' attributes.
_CANCEL: Final = Op.CANCEL
_COUNT_TOKENS: Final = Op.COUNT_TOKENS
_CREATE_STATE: Final = Op.CREATE_STATE
_TYPED_OPS: Final = (Op.CREATE, Op.COUNT_TOKENS)
_UNSET: Final = msgspec.UNSET
#: where a worker answers whether it holds a referenced response / conversation
_RESPONSE_GET: Final = next(e for e in ENDPOINTS if e.name == "responses.retrieve")
_CONVERSATION_GET: Final = next(e for e in ENDPOINTS if e.name == "conversations.retrieve")


@dataclass(frozen=True, slots=True)
class LocalResponse:
    """A response meshkit builds itself (a merged listing, a captured error, a
    tokenization meshkit answered)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


class ClientTimeout(Exception):
    """A bound of the client's own fired: ``phase`` is "connect", "read", "write", or
    "pool" (its request waited that long to be prepared). The client transports
    raise their library's timeout for it, as a direct connection would."""

    def __init__(self, phase: str) -> None:
        super().__init__(phase)
        self.phase = phase


class Timeouts:
    """A client's own timeouts, in seconds, where they are tighter than
    ``[upstream]``'s (None: ``[upstream]``'s applies), and httpcore's ``timeout``
    extension with the bounds in force: what a client transport's request carries
    to the upstream clients (:mod:`meshkit.upstream.timeouts` makes it).

    ``connect`` bounds the wait for a pooled connection and the connect together,
    as ``connect_timeout_s`` does; ``read`` and ``write`` are held against
    ``read_timeout_s`` (meshkit's write bound, as httpcore's).
    """

    __slots__ = ("connect", "extensions", "read", "write")

    def __init__(
        self,
        connect: float | None,
        read: float | None,
        write: float | None,
        extensions: dict[str, dict[str, float | None]],
    ) -> None:
        self.connect = connect
        self.read = read
        self.write = write
        self.extensions = extensions

    def __repr__(self) -> str:
        return f"Timeouts(connect={self.connect}, read={self.read}, write={self.write})"


class RequestView:
    """What placement knows about one request.

    A plain class made per request (``docs/architecture.md``, "Compiled and
    interpreted": a dataclass's generated ``__init__`` is never compiled).
    """

    __slots__ = (
        "batch",
        "body",
        "conversation",
        "extra",
        "has_dp_rank",
        "idempotency_key",
        "include_usage",
        "item_references",
        "kv_keys",
        "local",
        "match",
        "model",
        "no_wait",
        "only",
        "previous_response_id",
        "prompt_ids",
        "prompt_weight",
        "query",
        "return_logprob",
        "routing_key",
        "routing_text",
        "stream",
        "timeout",
        "token_ids",
    )

    def __init__(
        self,
        match: Match,
        body: bytes = b"",
        query: str = "",
        model: str | None = None,
        stream: bool = False,
        include_usage: bool = False,
        previous_response_id: str | None = None,
        conversation: str | None = None,
        item_references: tuple[str, ...] = (),
        routing_key: str | None = None,
        routing_text: str = "",
        token_ids: list[int] | None = None,
        prompt_ids: list[int] | None = None,
        kv_keys: dict[int, list[int]] | None = None,
        prompt_weight: int = 0,
        has_dp_rank: bool = False,
        batch: int | None = None,
        return_logprob: bool = False,
        idempotency_key: str | None = None,
        no_wait: bool = False,
        local: LocalResponse | None = None,
        extra: dict[str, Any] | None = None,
        only: frozenset[str] | None = None,
    ) -> None:
        self.match = match
        self.body = body
        self.query = query
        self.model = model
        self.stream = stream
        self.include_usage = include_usage
        self.previous_response_id = previous_response_id
        self.conversation = conversation
        self.item_references = item_references
        #: prompt_cache_key / safety_identifier / user, or a configured header's value
        self.routing_key = routing_key
        #: prompt in prompt order ("" until a policy asks for text)
        self.routing_text = routing_text
        #: token ids of a prefix of the prompt, when a policy asks for tokens
        self.token_ids = token_ids
        #: the prompt's leading token ids as the engine computes them (its chat
        #: template rendered), when a policy matches them against KV events
        self.prompt_ids = prompt_ids
        #: their KV-index block keys per block size (computed with them, off the lock)
        self.kv_keys = kv_keys
        #: prompt-size estimate (characters) used by load-weighting policies
        self.prompt_weight = prompt_weight
        #: the client sent data_parallel_rank itself (the body must be rebuilt once)
        self.has_dp_rank = has_dp_rank
        #: items in a batched /generate request (None: not batched)
        self.batch = batch
        #: /generate asked for logprobs (PD merges the prefill's input logprobs)
        self.return_logprob = return_logprob
        #: ``Idempotency-Key``, scoped by path: a retry joins its running twin
        self.idempotency_key = idempotency_key
        #: ``x-mesh-wait: false``: answer 503 ``worker_waking`` rather than hold the request
        self.no_wait = no_wait
        #: the answer meshkit gives itself (``/v1/tokenize``), instead of forwarding
        self.local = local
        #: anything a plugin or a front end attaches (never logged)
        self.extra: dict[str, Any] = {} if extra is None else extra
        #: the worker ids this request may go to (a proxy's subset hint); None: any
        self.only = only
        #: the client's own timeouts, tighter than ``[upstream]``'s (a client
        #: transport sets them); every attempt carries them
        self.timeout: Timeouts | None = None

    def __repr__(self) -> str:
        # Never the body, the routing text or the ids: a prompt must not reach a log.
        return f"RequestView({self.match.endpoint.name}, model={self.model!r})"

    @property
    def api(self) -> Api:
        return self.match.endpoint.api

    @property
    def stateful(self) -> bool:
        return bool(self.previous_response_id or self.conversation or self.item_references)

    @property
    def state_id(self) -> str | None:
        """The stored object this request continues, which pins it to its owner:
        ``previous_response_id`` or ``conversation`` (both at once is a 400)."""
        return self.previous_response_id or self.conversation

    @property
    def state_path(self) -> str | None:
        """The ``GET`` a worker answers with 200 when it holds :attr:`state_id`."""
        rid = self.previous_response_id
        if rid:
            return _RESPONSE_GET.path(quote(rid, safe=""))
        cid = self.conversation
        if cid:
            return _CONVERSATION_GET.path(quote(cid, safe=""))
        return None


def check_media(content_type: str | None, content_encoding: str | None) -> None:
    """415 unless the body is JSON in the identity encoding.

    A missing content type is accepted (curl without ``-H`` and some SDK paths send
    none); anything else must be ``application/json`` or a ``+json`` type.
    """
    if content_encoding:
        enc = content_encoding.strip().lower()
        if enc not in ("", "identity"):
            raise UnsupportedMediaType(f"content-encoding {enc!r} is not supported; send identity")
    if content_type:
        mime = content_type.split(";", 1)[0].strip().lower()
        if mime != "application/json" and not mime.endswith("+json"):
            raise UnsupportedMediaType(f"content type {mime!r} is not JSON")


def check_head(headers: Iterable[tuple[bytes, bytes]], *, max_bytes: int, max_count: int) -> None:
    """431 when a request head is over ``bounds.max_header_bytes`` or ``bounds.max_headers``.

    The size is that of the header lines as sent, ``name: value\\r\\n`` each (the
    request line is not counted). Every adapter measures the headers it was given,
    so the same request trips the same bound in every mode.

    :raises HeadersTooLarge: (431 ``request_header_fields_too_large``)
    """
    count = 0
    size = 0
    for k, v in headers:
        count += 1
        size += len(k) + len(v) + 4
    error = head_error(count, size, max_bytes=max_bytes, max_count=max_count)
    if error is not None:
        raise error


def head_error(count: int, size: int, *, max_bytes: int, max_count: int) -> HeadersTooLarge | None:
    """The 431 for a head of ``count`` header lines of ``size`` bytes in all, if over a bound."""
    if count > max_count:
        return HeadersTooLarge(
            f"the request has {count} header fields; bounds.max_headers allows {max_count}"
        )
    if size > max_bytes:
        return HeadersTooLarge(
            f"the request header fields are {size} bytes; "
            f"bounds.max_header_bytes allows {max_bytes}"
        )
    return None


def check_declared(headers: Iterable[tuple[bytes, bytes]], limit: int) -> None:
    """413 when the (lower-cased) ``headers`` declare a body over ``limit`` bytes.

    :raises RequestTooLarge: (413 ``request_too_large``)
    """
    for k, v in headers:
        if k == b"content-length":
            if declared_over(v, limit):
                raise body_over(limit)
            return


def declared_over(value: bytes, limit: int) -> bool:
    """Whether a ``Content-Length`` value declares a body over ``limit`` bytes.

    Every mode refuses such a request (413) before reading its body, and reads the
    value alike: digits, with optional whitespace around them (RFC 9112 §6.3). A
    value that is not one declares nothing here: the server's parser (or Envoy)
    refuses that head, and the body is held to ``limit`` as it arrives anyway.
    However many digits it has, it is not converted whole (``int`` refuses over
    4,300 digits with a ValueError): past 18 significant digits, over 10¹⁸ bytes,
    it is over any limit (a limit is far below that).
    """
    if not isdigit(value):  # the usual value is bare digits: one check
        value = value.strip(b" \t")
        if not isdigit(value):
            return False
    if len(value) > 18:
        value = value.lstrip(b"0")
        if len(value) > 18:
            return True
    return int(value or b"0") > limit


# Brackets of both kinds become "[" and "]" (which kind closes which is the
# decoder's concern, not depth's); every other byte but the quote is dropped.
_STRUCTURE: Final = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE: Final = bytes(b for b in range(256) if b not in b'"[]{}')
# The same, keeping backslashes, with the other bytes a JSON escape can hold
# (/ b f n r t u) written as "x": after a backslash, an "x" is an escape that is
# neither a quote nor a backslash. A body's own "x" bytes are dropped.
_ESCAPED: Final = bytes.maketrans(b"{}/bfnrtu", b"[]xxxxxxx")
_NOT_ESCAPED: Final = bytes(b for b in range(256) if b not in b'"[]{}\\/bfnrtu')
_DEPTH_STEP: Final = {ord("["): 1, ord("]"): -1}
# The openers of a body over _REPLACE_COUNTS_MAX counted before it is scanned
# instead: 4, and one more per 128 bytes (a find call ~0.1 µs; the scan 1 to 2.5
# ns a byte, more with escapes).
_FINDS: Final = 4
_BYTES_PER_FIND_BITS: Final = 7
#: the largest body whose brackets are counted with ``replace`` (see _more_than)
_REPLACE_COUNTS_MAX: Final = 2048


def _more_than(body: bytes, limit: int) -> bool:
    """Whether ``body`` holds more than ``limit`` opening brackets.

    Up to ``_REPLACE_COUNTS_MAX`` bytes, each bracket with one ``count_upto``
    (``replace``, memchr-fast): 2.7K against 6.0K instructions on a 1 KiB chat
    body, compiled, as ``find`` builds a tuple of each call's arguments and parses
    it. Timed with warm caches the two are level at 1 to 2 KiB (0.64 against 0.66
    µs, then 0.70 against 0.67), and past that the copy costs more than the calls
    (1.73 against 0.86 µs at 16 KiB): ``find``, memchr-fast too (``bytes.count`` of
    one byte is a plain loop: 40 µs for both brackets on a 64 KiB body, twice the
    decode). Stops at ``limit + 1``.
    """
    if len(body) <= _REPLACE_COUNTS_MAX:
        n = count_upto(body, b"[", limit + 1)
        return n > limit or n + count_upto(body, b"{", limit + 1 - n) > limit
    n = 0
    for opener in (b"[", b"{"):
        at = find(body, opener)
        while at >= 0:
            n += 1
            if n > limit:
                return True
            at = find(body, opener, at + 1)
    return False


def _too_deep(body: bytes, max_depth: int) -> bool:
    """Whether ``body`` nests arrays/objects deeper than ``max_depth`` (cheap, pure).

    A body with few brackets is not scanned: it cannot nest deeper than it has
    openers. They are counted (:func:`_more_than`) up to ``max_depth``, past 2 KiB
    only up to a few per KiB: there each one costs a ``find`` call, and past that
    many the calls cost more than the scan, whose passes are linear.

    The scan, in C-speed passes: escaped backslashes and quotes are cut out, every
    byte but quotes and brackets is dropped (``bytes.translate``), what lies
    between quotes (string contents) is dropped, and then levels are peeled: each
    ``replace(b"[]", b"")`` removes exactly the innermost containers (it does not
    rescan what it produced), so the number of passes that empties the string is
    the depth. At most ``max_depth + 1`` passes run; a long string that a pass
    barely shortens (one deep chain) is summed up in one ``accumulate`` instead.
    Invalid JSON gets an answer too (any): the decoder refuses it next.
    """
    # Nesting d deep takes 2d bytes at least ("[[]]").
    size = len(body)
    if size < 2 * (max_depth + 1):
        return False
    limit = max_depth
    if size > _REPLACE_COUNTS_MAX:
        limit = min(max_depth, _FINDS + (size >> _BYTES_PER_FIND_BITS))
    if not _more_than(body, limit):
        return False
    if b"\\" in body:
        # Escapes are cut out of what the translate leaves, not out of the whole
        # body (a replace of two bytes runs at ~1 ns a byte). With ``_ESCAPED``
        # every escape is two bytes still, so cutting the escaped backslashes and
        # then the escaped quotes leaves quotes that open and close strings.
        body = body.translate(_ESCAPED, _NOT_ESCAPED)
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, b"\\x")
    else:
        body = body.translate(_STRUCTURE, _NOT_STRUCTURE)
    if b'"' in body:
        # Two adjacent quotes are a string with no bracket in it, or one string's
        # end and the next one's start with only separators between them (":",
        # ",", spaces: dropped). Cutting either pair out leaves the other quotes
        # paired around the same brackets, so one replace removes most strings,
        # and the split that copies each piece is left for the few strings that
        # hold brackets (an agent's tool arguments: 5,178 pieces of an 83 KB
        # session otherwise).
        body = body.replace(b'""', b"")
        if b'"' in body:
            body = b"".join(body.split(b'"')[::2])
    depth = 0
    while body:
        peeled = body.replace(b"[]", b"")
        if len(peeled) == len(body):
            return False  # unbalanced: not JSON, the decoder says so
        depth += 1
        if depth > max_depth:
            return True
        if len(peeled) > 4096 and 4 * len(peeled) > 3 * len(body):
            # A long chain peels little per pass (a pass is linear): what is left
            # is max_depth - depth levels at most, summed up in one walk instead.
            return depth + max(accumulate(map(_DEPTH_STEP.__getitem__, peeled))) > max_depth
        body = peeled
    return False


def query_streams(match: Match, query: str) -> bool:
    """Whether a read of a stored Response asks for its events as a stream:
    ``GET /v1/responses/{id}?stream=true`` (the SDK's ``responses.retrieve(id,
    stream=True)``, PROTOCOLS.md section 2). The stream flag of a create is in its
    body; a retrieve has none, so its query says it (the last ``stream`` wins)."""
    ep = match.endpoint
    if ep.op is not Op.RETRIEVE or ep.stream_format is StreamFormat.NONE or "stream" not in query:
        return False
    given = [value for name, value in parse_qsl(query) if name == "stream"]
    return bool(given) and given[-1].lower() in ("true", "1")


def parse_request(
    match: Match, body: bytes, *, want_text: bool = False, max_depth: int = MAX_JSON_DEPTH
) -> RequestView:
    """Parse ``body`` for ``match`` into a :class:`RequestView`.

    :param want_text: build :attr:`RequestView.routing_text` (the policy reads it).
    :param max_depth: the deepest nesting of arrays and objects accepted
        (``bounds.max_json_depth``); the top-level object is depth 1.
    :raises InvalidRequest: unusable JSON, nesting deeper than ``max_depth``, or a
        routing field of the wrong type.
    """
    view = RequestView(match=match, body=body)
    ep = match.endpoint
    op = ep.op
    if not ep.has_body or op is _CANCEL:
        return view
    if op is _CREATE_STATE and (not body or isspace(body)):
        return view  # every field of a new conversation is optional, the body too
    parser = _PARSERS.get(ep.api) if op in _TYPED_OPS else None
    try:
        if not body or isspace(body):  # strip() would copy a body ending in a newline
            raise InvalidRequest("request body is empty; expected a JSON object")
        if _too_deep(body, max_depth):
            raise InvalidRequest(
                f"request body nests arrays and objects deeper than {max_depth} levels"
            )
        parsed = _decode_any(body) if parser is None else parser[0](body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(_validation_message(exc), param=_param_of(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    view.model = parsed.model
    view.has_dp_rank = parsed.data_parallel_rank is not _UNSET
    if parser is None:
        return view
    parser[1](view, parsed, want_text)
    if op is _COUNT_TOKENS:
        view.stream = False
    return view


def _validation_message(exc: msgspec.ValidationError) -> str:
    return f"invalid request: {exc}"


def _param_of(exc: msgspec.ValidationError) -> str | None:
    text = str(exc)
    at = text.rfind("at `$.")
    if at < 0:
        return None
    return text[at + 6 :].rstrip("`").split("[", 1)[0].split(".", 1)[0] or None


def _usage_flag(opts: dict[str, Json] | None) -> bool:
    return bool(opts and opts.get("include_usage") is True)


def _chat(view: RequestView, p: ChatBody, want_text: bool) -> None:
    view.stream = bool(p.stream)
    view.include_usage = view.stream and _usage_flag(p.stream_options)
    view.routing_key = p.prompt_cache_key or p.safety_identifier or p.user
    parts: list[str] = []
    messages = p.messages
    # The leading system (or developer) messages, then the tools: the order chat
    # templates render them in, so the text prefix follows the engine's cache.
    lead = 0
    while lead < len(messages) and _is_system(messages[lead]):
        _message_text(messages[lead], parts)
        lead += 1
    if p.tools:
        parts.append(_dumps(p.tools))
    for m in messages[lead:] if lead else messages:
        _message_text(m, parts)
    _set_text(view, parts, want_text)


def _is_system(m: Json) -> bool:
    return isinstance(m, dict) and m.get("role") in ("system", "developer")


def _completion(view: RequestView, p: CompletionBody, want_text: bool) -> None:
    view.stream = bool(p.stream)
    view.include_usage = view.stream and _usage_flag(p.stream_options)
    view.routing_key = p.user
    prompt = p.prompt
    if isinstance(prompt, str):
        _set_text(view, [prompt], want_text)
    elif isinstance(prompt, list) and prompt:
        first = prompt[0]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            view.token_ids = list(prompt)
            view.prompt_weight = len(prompt) * 4
        elif isinstance(first, list):
            view.token_ids = [x for x in first if isinstance(x, int) and not isinstance(x, bool)]
            view.prompt_weight = sum(len(x) * 4 for x in prompt if isinstance(x, list))
        else:
            _set_text(view, [x for x in prompt if isinstance(x, str)], want_text)


def _messages(view: RequestView, p: MessagesBody, want_text: bool) -> None:
    view.stream = bool(p.stream)
    meta = p.metadata or {}
    uid = meta.get("user_id")
    view.routing_key = uid if isinstance(uid, str) else None
    parts: list[str] = []
    if isinstance(p.system, str):
        parts.append("system\n" + p.system)
    elif p.system:
        parts.append("system\n" + _content_text(p.system))
    if p.tools:
        parts.append(_dumps(p.tools))
    for m in p.messages:
        _message_text(m, parts)
    _set_text(view, parts, want_text)


def _responses(view: RequestView, p: ResponsesBody, want_text: bool) -> None:
    view.stream = bool(p.stream)
    view.routing_key = p.prompt_cache_key or p.safety_identifier or p.user
    view.previous_response_id = p.previous_response_id or None
    conv = p.conversation
    if isinstance(conv, dict):
        cid = conv.get("id")
        if cid is not None and not isinstance(cid, str):
            raise InvalidRequest("conversation.id must be a string", param="conversation")
        view.conversation = cid or None
    else:
        view.conversation = conv or None
    if view.previous_response_id and view.conversation:
        raise InvalidRequest(
            "previous_response_id cannot be combined with conversation",
            param="previous_response_id",
        )
    # Refused as the same id in a path is: the owner is looked up by it.
    if view.previous_response_id:
        check_id(view.previous_response_id, "previous_response_id")
    elif view.conversation:
        check_id(view.conversation, "conversation")
    parts: list[str] = []
    if p.instructions:
        parts.append("instructions\n" + p.instructions)
    if p.tools:
        parts.append(_dumps(p.tools))
    refs: list[str] = []
    if isinstance(p.input, str):
        parts.append("user\n" + p.input)
    elif p.input:
        for item in p.input:
            if not isinstance(item, dict):
                raise InvalidRequest("input items must be objects", param="input")
            ref = _item_reference(item)
            if ref is not None:
                refs.append(ref)
                continue
            _message_text(item, parts)
    view.item_references = tuple(refs)
    _set_text(view, parts, want_text)


def _item_reference(item: dict[str, Json]) -> str | None:
    """The id of an item_reference: ``type`` is optional (null or absent) on those."""
    kind = item.get("type")
    item_id = item.get("id")
    if kind == "item_reference" or (kind is None and "role" not in item and item_id is not None):
        if not isinstance(item_id, str) or not item_id:
            raise InvalidRequest("item_reference needs a string id", param="input")
        return item_id
    return None


def _generate(view: RequestView, p: GenerateBody, want_text: bool) -> None:
    view.stream = bool(p.stream)
    view.return_logprob = bool(p.return_logprob)
    if isinstance(p.text, list):
        view.batch = len(p.text)
    elif p.input_ids and isinstance(p.input_ids[0], list):
        view.batch = len(p.input_ids)
    if isinstance(p.text, str):
        _set_text(view, [p.text], want_text)
    elif isinstance(p.text, list):
        _set_text(view, p.text[:1], want_text)
        view.prompt_weight = sum(len(t) for t in p.text)
    elif p.input_ids:
        first = p.input_ids[0]
        ids = first if isinstance(first, list) else p.input_ids
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise InvalidRequest("input_ids must be token ids", param="input_ids")
        view.token_ids = list(ids)
        view.prompt_weight = len(ids) * 4


def _set_text(view: RequestView, parts: list[str], want_text: bool) -> None:
    # the joined text's length: the parts and a newline between each two
    size = sum(len(s) for s in parts) + max(len(parts) - 1, 0)
    view.prompt_weight = view.prompt_weight or size
    if want_text:
        view.routing_text = "\n".join(parts)


def _dumps(value: Json) -> str:
    return msgspec.json.encode(value).decode()


def _message_text(m: Json, out: list[str]) -> None:
    if isinstance(m, dict):
        content = m.get("content")
        if content is None and m.get("type") not in (None, "message"):
            # function_call, function_call_output, reasoning...: keep their payload
            out.append(_dumps(m))
            return
        role = m.get("role")
        if isinstance(role, str):
            # a part of its own: the newline that joins the parts puts it before its
            # content, and the content is not copied into a new string to get there
            out.append(role)
        out.append(_content_text(content))
        calls = m.get("tool_calls")
        if calls:
            out.append(_dumps(calls))
    elif isinstance(m, str):
        out.append(m)


def _content_text(content: Json) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        chunks: list[str] = []
        for part in content:
            if isinstance(part, str):
                chunks.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    chunks.append(text)
                else:
                    # images, audio, files, tool results: a stable stand-in keeps
                    # prefixes aligned without copying binary payloads.
                    chunks.append("<" + str(part.get("type", "part")) + ">")
        return "\n".join(chunks)
    return ""


#: the typed decode of each API's create body (bound: no lookup of ``decode`` per
#: call), and what reads the result
_Decode = Callable[[bytes], Any]
_PARSERS: Final[dict[Api, tuple[_Decode, Callable[[RequestView, Any, bool], None]]]] = {
    Api.CHAT: (msgspec.json.Decoder(ChatBody).decode, _chat),
    Api.COMPLETIONS: (msgspec.json.Decoder(CompletionBody).decode, _completion),
    Api.MESSAGES: (msgspec.json.Decoder(MessagesBody).decode, _messages),
    Api.RESPONSES: (msgspec.json.Decoder(ResponsesBody).decode, _responses),
    Api.GENERATE: (msgspec.json.Decoder(GenerateBody).decode, _generate),
}
