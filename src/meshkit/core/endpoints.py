"""
Endpoint registry
=================

Each inference API is declared once: method(s), path template, operation, the
stream format its responses use and the error shape its clients expect. Every
adapter resolves a request through :func:`resolve`, so every mode tells apart, in
the same way,

- an inference request (a :class:`Match`),
- a path under an inference prefix that does not exist (404 ``unknown_endpoint``),
- a known path with the wrong method (405 ``method_not_allowed``),
- anything else, which is not meshkit's business (``None``: adapters pass it through).

Responses state lives in two kinds of stored objects: responses
(``/v1/responses/{id}``) and conversations (``/v1/conversations/{id}``, with their
items at ``/v1/conversations/{id}/items/{item_id}``). Their resource operations are
placed by owner, like the responses they continue (:mod:`meshkit.core.fanout`).

Security: the forwarded path is rebuilt from the matched template and validated
resource ids, never copied from the client, so dot segments or encoded slashes can
never reach a path outside this registry. ``GET /v1/models/{model}`` (the OpenAI
SDKs' ``models.retrieve``) is answered by the mesh from the merged model list: its
model id (any characters, slashes included, percent-decoded) is only compared with
the workers' lists and never forwarded; the path forwarded is ``/v1/models``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

from meshkit.errors import ErrorShape, InvalidRequest, MethodNotAllowed, UnknownEndpoint

__all__ = [
    "ENDPOINTS",
    "Api",
    "Endpoint",
    "Match",
    "Op",
    "StreamFormat",
    "check_id",
    "resolve",
]


class Api(enum.StrEnum):
    """The API families a worker can serve (the values of the ``mesh.apis`` label)."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    MESSAGES = "messages"
    RESPONSES = "responses"
    GENERATE = "generate"
    TOKENIZE = "tokenize"
    MODELS = "models"
    # pooling models (vLLM): placed like inference, never streamed
    EMBEDDINGS = "embeddings"
    RERANK = "rerank"
    SCORE = "score"
    POOLING = "pooling"
    CLASSIFY = "classify"


class Op(enum.StrEnum):
    CREATE = "create"
    COUNT_TOKENS = "count_tokens"
    RETRIEVE = "retrieve"
    DELETE = "delete"
    CANCEL = "cancel"
    INPUT_ITEMS = "input_items"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    LIST = "list"
    UPDATE = "update"
    #: stores a new state object without inference (``POST /v1/conversations``)
    CREATE_STATE = "create_state"
    ADD_ITEMS = "add_items"


class StreamFormat(enum.StrEnum):
    """How a streamed response of an endpoint is framed."""

    NONE = "none"
    OPENAI = "openai"  # data-only SSE ending in [DONE] (chat, completions)
    RESPONSES = "responses"  # named events, terminal response.completed/failed/incomplete
    ANTHROPIC = "anthropic"  # named events, terminal message_stop
    GENERATE = "generate"  # SGLang /generate: data-only SSE, cumulative text


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One inference endpoint: what it is, how it streams, how its errors look."""

    name: str
    api: Api
    op: Op
    methods: frozenset[str]
    template: str
    stream_format: StreamFormat = StreamFormat.NONE
    shape: ErrorShape = "openai"
    #: a whole answer is a stored state object (a response, a conversation): the
    #: origin that gave it holds its ``id`` (Responses affinity learns it)
    answers_state: bool = False
    #: the ``api`` label of this endpoint's metrics: the API family as the SDKs
    #: name it (conversations are routed as Responses state but are their own API,
    #: so their fast resource calls do not mix into the Responses latencies)
    label: str = ""
    #: a request carries a body (POST); fields, not properties: read per request
    has_body: bool = False
    #: an operation on a stored Response or Conversation (placed by its owner)
    is_resource: bool = False

    def path(self, resource_id: str | None = None, item_id: str | None = None) -> str:
        """The canonical path to forward (the ids have been validated by :func:`resolve`).

        A model retrieve forwards the listing it is answered from, ``/v1/models``.
        """
        if self.api is Api.MODELS:
            return _MODELS
        if resource_id is None:
            return self.template
        path = self.template.replace("{id}", resource_id)
        return path if item_id is None else path.replace("{item_id}", item_id)


def _ep(
    name: str,
    api: Api,
    op: Op,
    methods: str,
    template: str,
    stream: StreamFormat = StreamFormat.NONE,
    shape: ErrorShape = "openai",
    *,
    state: bool = False,
) -> Endpoint:
    label = "conversations" if template.startswith("/v1/conversations") else api.value
    allowed = frozenset(methods.split("|"))
    return Endpoint(
        name,
        api,
        op,
        allowed,
        template,
        stream,
        shape,
        state,
        label,
        has_body="POST" in allowed,
        is_resource="{id}" in template,
    )


ENDPOINTS: Final[tuple[Endpoint, ...]] = (
    _ep("chat", Api.CHAT, Op.CREATE, "POST", "/v1/chat/completions", StreamFormat.OPENAI),
    _ep("completions", Api.COMPLETIONS, Op.CREATE, "POST", "/v1/completions", StreamFormat.OPENAI),
    _ep(
        "messages",
        Api.MESSAGES,
        Op.CREATE,
        "POST",
        "/v1/messages",
        StreamFormat.ANTHROPIC,
        "anthropic",
    ),
    _ep(
        "messages.count_tokens",
        Api.MESSAGES,
        Op.COUNT_TOKENS,
        "POST",
        "/v1/messages/count_tokens",
        shape="anthropic",
    ),
    _ep(
        "responses",
        Api.RESPONSES,
        Op.CREATE,
        "POST",
        "/v1/responses",
        StreamFormat.RESPONSES,
        state=True,
    ),
    _ep(
        "responses.retrieve",
        Api.RESPONSES,
        Op.RETRIEVE,
        "GET",
        "/v1/responses/{id}",
        StreamFormat.RESPONSES,
        state=True,
    ),
    _ep("responses.delete", Api.RESPONSES, Op.DELETE, "DELETE", "/v1/responses/{id}"),
    _ep(
        "responses.cancel",
        Api.RESPONSES,
        Op.CANCEL,
        "POST",
        "/v1/responses/{id}/cancel",
        state=True,  # answers the response (a background one's usage is read there)
    ),
    _ep(
        "responses.input_items",
        Api.RESPONSES,
        Op.INPUT_ITEMS,
        "GET",
        "/v1/responses/{id}/input_items",
    ),
    # Conversations are Responses state too: served by the workers that serve
    # responses, placed by their owner (the create by the policy, like a response).
    _ep(
        "conversations.create",
        Api.RESPONSES,
        Op.CREATE_STATE,
        "POST",
        "/v1/conversations",
        state=True,
    ),
    _ep(
        "conversations.retrieve",
        Api.RESPONSES,
        Op.RETRIEVE,
        "GET",
        "/v1/conversations/{id}",
        state=True,
    ),
    _ep(
        "conversations.update",
        Api.RESPONSES,
        Op.UPDATE,
        "POST",
        "/v1/conversations/{id}",
        state=True,
    ),
    _ep("conversations.delete", Api.RESPONSES, Op.DELETE, "DELETE", "/v1/conversations/{id}"),
    _ep(
        "conversations.items.list",
        Api.RESPONSES,
        Op.LIST,
        "GET",
        "/v1/conversations/{id}/items",
    ),
    _ep(
        "conversations.items.create",
        Api.RESPONSES,
        Op.ADD_ITEMS,
        "POST",
        "/v1/conversations/{id}/items",
    ),
    _ep(
        "conversations.items.retrieve",
        Api.RESPONSES,
        Op.RETRIEVE,
        "GET",
        "/v1/conversations/{id}/items/{item_id}",
    ),
    _ep(
        "conversations.items.delete",
        Api.RESPONSES,
        Op.DELETE,
        "DELETE",
        "/v1/conversations/{id}/items/{item_id}",
        state=True,  # answers the conversation
    ),
    _ep("generate", Api.GENERATE, Op.CREATE, "POST", "/generate", StreamFormat.GENERATE),
    _ep("tokenize", Api.TOKENIZE, Op.TOKENIZE, "POST", "/v1/tokenize"),
    _ep("tokenize.unversioned", Api.TOKENIZE, Op.TOKENIZE, "POST", "/tokenize"),
    _ep("detokenize", Api.TOKENIZE, Op.DETOKENIZE, "POST", "/v1/detokenize"),
    _ep("detokenize.unversioned", Api.TOKENIZE, Op.DETOKENIZE, "POST", "/detokenize"),
    _ep("embeddings", Api.EMBEDDINGS, Op.CREATE, "POST", "/v1/embeddings"),
    _ep("rerank", Api.RERANK, Op.CREATE, "POST", "/v1/rerank"),
    _ep("rerank.unversioned", Api.RERANK, Op.CREATE, "POST", "/rerank"),
    _ep("rerank.v2", Api.RERANK, Op.CREATE, "POST", "/v2/rerank"),
    _ep("score", Api.SCORE, Op.CREATE, "POST", "/v1/score"),
    _ep("score.unversioned", Api.SCORE, Op.CREATE, "POST", "/score"),
    _ep("pooling", Api.POOLING, Op.CREATE, "POST", "/pooling"),
    _ep("classify", Api.CLASSIFY, Op.CREATE, "POST", "/classify"),
    _ep("models", Api.MODELS, Op.LIST, "GET", "/v1/models"),
    _ep("models.retrieve", Api.MODELS, Op.RETRIEVE, "GET", "/v1/models/{model}"),
)

#: Paths at or under these belong to meshkit; anything else passes through.
_PREFIXES: Final[tuple[tuple[str, ErrorShape], ...]] = (
    ("/v1/chat", "openai"),
    ("/v1/completions", "openai"),
    ("/v1/messages", "anthropic"),
    ("/v1/responses", "openai"),
    ("/v1/conversations", "openai"),
    ("/generate", "openai"),
    ("/v1/tokenize", "openai"),
    ("/tokenize", "openai"),
    ("/v1/detokenize", "openai"),
    ("/detokenize", "openai"),
    ("/v1/models", "openai"),
    ("/v1/embeddings", "openai"),
    ("/v1/rerank", "openai"),
    ("/rerank", "openai"),
    ("/v2/rerank", "openai"),
    ("/v1/score", "openai"),
    ("/score", "openai"),
    ("/pooling", "openai"),
    ("/classify", "openai"),
)

_MODELS: Final = "/v1/models"
_MODELS_PREFIX: Final = _MODELS + "/"
_MODEL_RETRIEVE: Final = next(e for e in ENDPOINTS if e.name == "models.retrieve")
#: the longest model id ``GET /v1/models/{model}`` accepts (characters, decoded)
MAX_MODEL_ID: Final = 512

_ITEM = "{item_id}"
_STATIC: Final[dict[str, list[Endpoint]]] = {}
#: (head, tail, endpoint) for ".../{id}<tail>"; a tail ending in "/" is followed by
#: an item id (the template's "{item_id}")
_RESOURCE: Final[list[tuple[str, str, Endpoint]]] = []
for _e in ENDPOINTS:
    if _e is _MODEL_RETRIEVE:
        continue
    if _e.is_resource:
        _head, _tail = _e.template.split("{id}")
        _RESOURCE.append((_head, _tail.removesuffix(_ITEM), _e))
    else:
        _STATIC.setdefault(_e.template, []).append(_e)

_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,256}")
MAX_RESOURCE_ID: Final = 256
#: the parameter a bad id is reported as, by the path it is under
_ID_PARAM: Final = {"/v1/responses/": "response_id", "/v1/conversations/": "conversation_id"}


@dataclass(frozen=True, slots=True)
class Match:
    """A request resolved to an endpoint (and, for resource operations, its id)."""

    endpoint: Endpoint
    resource_id: str | None = None
    #: the model id of ``GET /v1/models/{model}`` (percent-decoded)
    model: str | None = None
    #: the item of ``/v1/conversations/{id}/items/{item_id}``
    item_id: str | None = None

    @property
    def path(self) -> str:
        return self.endpoint.path(self.resource_id, self.item_id)


#: each endpoint's match without ids, made once: a Match is immutable, so every
#: request to a static path shares its endpoint's (one object less per request)
_BARE: Final[dict[str, Match]] = {e.name: Match(e) for e in ENDPOINTS}


def shape_for_path(path: str) -> ErrorShape:
    """The error shape a client of ``path`` expects (Anthropic under /v1/messages)."""
    for prefix, shape in _PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return shape
    return "openai"


def _under_prefix(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p, _ in _PREFIXES)


def _pick(candidates: list[Endpoint], method: str, path: str) -> Endpoint:
    for e in candidates:
        if method in e.methods:
            return e
    allowed = tuple(sorted({m for e in candidates for m in e.methods}))
    raise MethodNotAllowed(f"{method} is not allowed on {path}", allowed=allowed)


def resolve(method: str, path: str) -> Match | None:
    """Resolve a request line to an endpoint.

    :param method: the HTTP method, upper case.
    :param path: the raw (still percent-encoded) path, without the query string.
    :returns: a :class:`Match`, or ``None`` for a path meshkit does not own.
    :raises UnknownEndpoint: a path under an inference prefix that is not registered.
    :raises MethodNotAllowed: a registered path with another method.
    :raises InvalidRequest: a resource (or item) id that is not ``[A-Za-z0-9_-]{1,256}``.
    """
    static = _STATIC.get(path)
    if static is not None:
        return _BARE[_pick(static, method, path).name]
    if not _under_prefix(path):
        return None
    if path.startswith(_MODELS_PREFIX) and len(path) > len(_MODELS_PREFIX):
        return _model_match(method, path)
    for head, tail, _e in _RESOURCE:
        if not path.startswith(head):
            continue
        rest = path[len(head) :]
        raw_id, sep, sub = rest.partition("/")
        sub_path = sep + sub
        raw_item = None
        if tail.endswith("/"):
            raw_item = sub_path[len(tail) :]
            if not sub_path.startswith(tail) or "/" in raw_item:
                continue
        elif sub_path != tail:
            continue
        rid = _valid_id(raw_id, _ID_PARAM[head])
        item = None if raw_item is None else _valid_id(raw_item, "item_id")
        group = [e for h, t, e in _RESOURCE if h == head and t == tail]
        return Match(_pick(group, method, path), rid, item_id=item)
    raise UnknownEndpoint(f"no inference endpoint at {path}")


def _valid_id(raw: str, param: str) -> str:
    if len(raw) > 3 * MAX_RESOURCE_ID:
        raise InvalidRequest(f"{param.replace('_', ' ')} is too long", param=param)
    return check_id(unquote(raw), param)


def check_id(rid: str, param: str) -> str:
    """``rid`` if it can be a stored object's id (in a path or a body), else a 400."""
    if _ID.fullmatch(rid) is None:
        what = param.replace("_", " ")
        raise InvalidRequest(f"{what} must match [A-Za-z0-9_-]{{1,256}}", param=param)
    return rid


def _model_match(method: str, path: str) -> Match:
    raw = path[len(_MODELS_PREFIX) :]
    if len(raw) > 3 * MAX_MODEL_ID:
        raise InvalidRequest("model id is too long", param="model")
    model = unquote(raw)
    if len(model) > MAX_MODEL_ID:
        raise InvalidRequest("model id is too long", param="model")
    return Match(_pick([_MODEL_RETRIEVE], method, path), model=model)
