"""Table tests for :mod:`meshkit.core.endpoints`: the registry, 404/405/400 and ids."""

from __future__ import annotations

import re
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.core.endpoints import (
    ENDPOINTS,
    Api,
    Match,
    Op,
    StreamFormat,
    resolve,
    shape_for_path,
)
from meshkit.errors import InvalidRequest, MeshError, MethodNotAllowed, UnknownEndpoint

P = pytest.param
A, OP, S = Api, Op, StreamFormat

# --------------------------------------------------------------------------------------
# every registered endpoint
# --------------------------------------------------------------------------------------

RESOLVES = [
    # method, path, api, op, stream format, error shape, canonical path
    P("POST", "/v1/chat/completions", A.CHAT, OP.CREATE, S.OPENAI, "openai", None, id="chat"),
    P("POST", "/v1/completions", A.COMPLETIONS, OP.CREATE, S.OPENAI, "openai", None, id="compl"),
    P("POST", "/v1/messages", A.MESSAGES, OP.CREATE, S.ANTHROPIC, "anthropic", None, id="msgs"),
    P(
        "POST",
        "/v1/messages/count_tokens",
        A.MESSAGES,
        OP.COUNT_TOKENS,
        S.NONE,
        "anthropic",
        None,
        id="count_tokens",
    ),
    P("POST", "/v1/responses", A.RESPONSES, OP.CREATE, S.RESPONSES, "openai", None, id="resp"),
    P(
        "GET",
        "/v1/responses/resp_1",
        A.RESPONSES,
        OP.RETRIEVE,
        S.RESPONSES,
        "openai",
        "resp_1",
        id="resp.retrieve",
    ),
    P(
        "DELETE",
        "/v1/responses/resp_1",
        A.RESPONSES,
        OP.DELETE,
        S.NONE,
        "openai",
        "resp_1",
        id="resp.delete",
    ),
    P(
        "POST",
        "/v1/responses/resp_1/cancel",
        A.RESPONSES,
        OP.CANCEL,
        S.NONE,
        "openai",
        "resp_1",
        id="resp.cancel",
    ),
    P(
        "GET",
        "/v1/responses/resp_1/input_items",
        A.RESPONSES,
        OP.INPUT_ITEMS,
        S.NONE,
        "openai",
        "resp_1",
        id="resp.input_items",
    ),
    P(
        "POST",
        "/v1/conversations",
        A.RESPONSES,
        OP.CREATE_STATE,
        S.NONE,
        "openai",
        None,
        id="conv.create",
    ),
    P(
        "GET",
        "/v1/conversations/conv_1",
        A.RESPONSES,
        OP.RETRIEVE,
        S.NONE,
        "openai",
        "conv_1",
        id="conv.retrieve",
    ),
    P(
        "POST",
        "/v1/conversations/conv_1",
        A.RESPONSES,
        OP.UPDATE,
        S.NONE,
        "openai",
        "conv_1",
        id="conv.update",
    ),
    P(
        "DELETE",
        "/v1/conversations/conv_1",
        A.RESPONSES,
        OP.DELETE,
        S.NONE,
        "openai",
        "conv_1",
        id="conv.delete",
    ),
    P(
        "GET",
        "/v1/conversations/conv_1/items",
        A.RESPONSES,
        OP.LIST,
        S.NONE,
        "openai",
        "conv_1",
        id="conv.items.list",
    ),
    P(
        "POST",
        "/v1/conversations/conv_1/items",
        A.RESPONSES,
        OP.ADD_ITEMS,
        S.NONE,
        "openai",
        "conv_1",
        id="conv.items.create",
    ),
    P(
        "GET",
        "/v1/conversations/conv_1/items/msg_2",
        A.RESPONSES,
        OP.RETRIEVE,
        S.NONE,
        "openai",
        "conv_1",
        id="conv.items.retrieve",
    ),
    P(
        "DELETE",
        "/v1/conversations/conv_1/items/msg_2",
        A.RESPONSES,
        OP.DELETE,
        S.NONE,
        "openai",
        "conv_1",
        id="conv.items.delete",
    ),
    P("POST", "/generate", A.GENERATE, OP.CREATE, S.GENERATE, "openai", None, id="generate"),
    P("POST", "/v1/tokenize", A.TOKENIZE, OP.TOKENIZE, S.NONE, "openai", None, id="tokenize"),
    P("POST", "/tokenize", A.TOKENIZE, OP.TOKENIZE, S.NONE, "openai", None, id="tokenize.bare"),
    P("POST", "/v1/detokenize", A.TOKENIZE, OP.DETOKENIZE, S.NONE, "openai", None, id="detok"),
    P("POST", "/detokenize", A.TOKENIZE, OP.DETOKENIZE, S.NONE, "openai", None, id="detok.bare"),
    P("POST", "/v1/embeddings", A.EMBEDDINGS, OP.CREATE, S.NONE, "openai", None, id="embed"),
    P("POST", "/v1/rerank", A.RERANK, OP.CREATE, S.NONE, "openai", None, id="rerank"),
    P("POST", "/rerank", A.RERANK, OP.CREATE, S.NONE, "openai", None, id="rerank.bare"),
    P("POST", "/v2/rerank", A.RERANK, OP.CREATE, S.NONE, "openai", None, id="rerank.v2"),
    P("POST", "/v1/score", A.SCORE, OP.CREATE, S.NONE, "openai", None, id="score"),
    P("POST", "/score", A.SCORE, OP.CREATE, S.NONE, "openai", None, id="score.bare"),
    P("POST", "/pooling", A.POOLING, OP.CREATE, S.NONE, "openai", None, id="pooling"),
    P("POST", "/classify", A.CLASSIFY, OP.CREATE, S.NONE, "openai", None, id="classify"),
    P("GET", "/v1/models", A.MODELS, OP.LIST, S.NONE, "openai", None, id="models"),
]


@pytest.mark.parametrize(("method", "path", "api", "op", "fmt", "shape", "rid"), RESOLVES)
def test_registered_endpoint_resolves(
    method: str, path: str, api: Api, op: Op, fmt: StreamFormat, shape: str, rid: str | None
) -> None:
    m = resolve(method, path)
    assert isinstance(m, Match)
    ep = m.endpoint
    assert (ep.api, ep.op, ep.stream_format, ep.shape) == (api, op, fmt, shape)
    assert method in ep.methods
    assert m.resource_id == rid
    assert m.path == path
    assert ep.is_resource is (rid is not None)
    assert shape_for_path(path) == shape


def test_table_covers_the_whole_registry() -> None:
    covered = set()
    for p in RESOLVES:
        method, path = cast(str, p.values[0]), cast(str, p.values[1])
        m = resolve(method, path)
        assert m is not None
        covered.add(m.endpoint.name)
    for p in MODEL_RETRIEVES:
        m = resolve(cast(str, p.values[0]), cast(str, p.values[1]))
        assert m is not None
        covered.add(m.endpoint.name)
    assert covered == {e.name for e in ENDPOINTS}


# GET /v1/models/{model}: any model id (the SDK percent-encodes "/"), answered by the
# mesh from the merged listing; the path forwarded is the listing's
MODEL_RETRIEVES = [
    P("GET", "/v1/models/m", "m", id="plain"),
    P("GET", "/v1/models/Qwen%2FQwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", id="sdk-slash"),
    P("GET", "/v1/models/org/model", "org/model", id="raw-slash"),
    P("GET", "/v1/models/%2Fdata%2Fmodels%2Fqwen", "/data/models/qwen", id="vllm-path-id"),
    P("GET", "/v1/models/llama3:8b", "llama3:8b", id="colon"),
    P("GET", "/v1/models/%2e%2e", "..", id="dots-are-just-an-id"),
]


@pytest.mark.parametrize(("method", "path", "model"), MODEL_RETRIEVES)
def test_model_retrieve_resolves(method: str, path: str, model: str) -> None:
    m = resolve(method, path)
    assert m is not None
    assert m.endpoint.name == "models.retrieve"
    assert (m.endpoint.api, m.endpoint.op) == (Api.MODELS, Op.RETRIEVE)
    assert m.model == model
    assert m.resource_id is None
    assert m.path == "/v1/models"  # the id is never forwarded
    assert not m.endpoint.is_resource


@pytest.mark.parametrize("method", ["POST", "DELETE", "PUT"])
def test_model_retrieve_other_methods_are_405(method: str) -> None:
    with pytest.raises(MethodNotAllowed) as ei:
        resolve(method, "/v1/models/m")
    assert ei.value.allowed == ("GET",)


@pytest.mark.parametrize(
    "raw",
    [P("x" * 513, id="decoded-over-512"), P("%41" * 513, id="raw-over-3x512")],
)
def test_model_id_over_the_bound_is_400(raw: str) -> None:
    assert resolve("GET", "/v1/models/" + "x" * 512) is not None  # at the bound
    with pytest.raises(InvalidRequest) as ei:
        resolve("GET", "/v1/models/" + raw)
    assert ei.value.param == "model"


def test_every_registry_entry_resolves_from_its_template() -> None:
    for ep in ENDPOINTS:
        for method in ep.methods:
            m = resolve(method, ep.path("abc-1_Z", "it-2") if ep.is_resource else ep.template)
            assert m is not None
            assert m.endpoint is ep


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_conversation_item_resolves_with_both_ids(method: str) -> None:
    m = resolve(method, "/v1/conversations/conv%5F1/items/msg_%32")
    assert m is not None
    assert m.endpoint.name == f"conversations.items.{'retrieve' if method == 'GET' else 'delete'}"
    assert (m.resource_id, m.item_id) == ("conv_1", "msg_2")
    assert m.path == "/v1/conversations/conv_1/items/msg_2"  # rebuilt from both, decoded


def test_the_answers_that_are_state_objects() -> None:
    # Affinity learns the id of these answers: the origin that gave it holds it.
    names = {e.name for e in ENDPOINTS if e.answers_state}
    assert names == {
        "responses",
        "responses.retrieve",
        "responses.cancel",
        "conversations.create",
        "conversations.retrieve",
        "conversations.update",
        "conversations.items.delete",
    }


# --------------------------------------------------------------------------------------
# 404 under inference prefixes, None elsewhere
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        P("/v1/chat", id="chat-prefix-itself"),
        P("/v1/chat/completion", id="chat-typo"),
        P("/v1/chat/completions/", id="chat-trailing-slash"),
        P("/v1/chat/completions/x", id="chat-subpath"),
        P("/v1/completions/x", id="completions-subpath"),
        P("/v1/messages/batches", id="messages-batches"),
        P("/v1/messages/count_tokens/x", id="count-tokens-subpath"),
        P("/v1/responses/resp_1/other", id="responses-unknown-sub"),
        P("/v1/responses/resp_1/cancel/x", id="responses-cancel-subpath"),
        P("/v1/responses/resp_1/", id="responses-trailing-slash"),
        P("/v1/conversations/conv_1/", id="conversation-trailing-slash"),
        P("/v1/conversations/conv_1/other", id="conversation-unknown-sub"),
        P("/v1/conversations/conv_1/items/msg_1/x", id="conversation-item-subpath"),
        P("/v1/conversations/conv_1/items/msg_1/", id="conversation-item-trailing-slash"),
        P("/generate/x", id="generate-subpath"),
        P("/v1/tokenize/x", id="tokenize-subpath"),
        P("/detokenize/x", id="detokenize-subpath"),
        P("/v1/models/", id="models-trailing-slash"),
    ],
)
def test_unknown_path_under_inference_prefix_is_404(path: str) -> None:
    with pytest.raises(UnknownEndpoint) as ei:
        resolve("POST", path)
    assert ei.value.status == 404
    assert ei.value.code == "unknown_endpoint"


@pytest.mark.parametrize(
    "path",
    [
        P("/", id="root"),
        P("/health", id="health"),
        P("/v1/files", id="files"),
        P("/v1/chatx", id="chatx-not-under-chat"),
        P("/v1/completionsx", id="completionsx"),
        P("/v1/messagesx", id="messagesx"),
        P("/v1/conversationsx", id="conversationsx"),
        P("/generatex", id="generatex"),
        P("/docs", id="docs"),
        P("/v2/chat/completions", id="v2"),
        P("/V1/chat/completions", id="case-sensitive"),
        P("//v1/chat/completions", id="double-slash"),
        P("/v1/chat%2Fcompletions", id="encoded-slash-not-decoded"),
        P("", id="empty"),
    ],
)
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_non_inference_paths_pass_through(method: str, path: str) -> None:
    assert resolve(method, path) is None


# --------------------------------------------------------------------------------------
# 405 with Allow
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        P("GET", "/v1/chat/completions", b"POST", id="chat-get"),
        P("PUT", "/v1/completions", b"POST", id="completions-put"),
        P("GET", "/v1/messages", b"POST", id="messages-get"),
        P("GET", "/v1/messages/count_tokens", b"POST", id="count-tokens-get"),
        P("GET", "/v1/responses", b"POST", id="responses-get"),
        P("POST", "/v1/responses/resp_1", b"DELETE, GET", id="resource-post"),
        P("PATCH", "/v1/responses/resp_1", b"DELETE, GET", id="resource-patch"),
        P("GET", "/v1/responses/resp_1/cancel", b"POST", id="cancel-get"),
        P("POST", "/v1/responses/resp_1/input_items", b"GET", id="input-items-post"),
        P("GET", "/v1/conversations", b"POST", id="conversations-get"),
        P("PUT", "/v1/conversations/c_1", b"DELETE, GET, POST", id="conversation-put"),
        P("DELETE", "/v1/conversations/c_1/items", b"GET, POST", id="conversation-items-delete"),
        P("POST", "/v1/conversations/c_1/items/m_1", b"DELETE, GET", id="conversation-item-post"),
        P("GET", "/generate", b"POST", id="generate-get"),
        P("GET", "/v1/tokenize", b"POST", id="tokenize-get"),
        P("POST", "/v1/models", b"GET", id="models-post"),
        P("HEAD", "/v1/models", b"GET", id="models-head"),
    ],
)
def test_wrong_method_is_405_with_allow(method: str, path: str, allow: bytes) -> None:
    with pytest.raises(MethodNotAllowed) as ei:
        resolve(method, path)
    err = ei.value
    assert (err.status, err.code) == (405, "method_not_allowed")
    headers = dict(err.headers())
    assert headers[b"allow"] == allow
    assert headers[b"content-type"] == b"application/json"


def test_405_on_bad_resource_id_prefers_400() -> None:
    # the id is validated before the method: a bad id never reaches a worker either way
    with pytest.raises(InvalidRequest):
        resolve("PATCH", "/v1/responses/a%2Fb")


# --------------------------------------------------------------------------------------
# resource ids
# --------------------------------------------------------------------------------------

VALID_IDS = [
    P("resp_1", "resp_1", id="plain"),
    P("a", "a", id="one-char"),
    P("A-z_0-9", "A-z_0-9", id="all-classes"),
    P("x" * 256, "x" * 256, id="256-chars"),
    P("resp%5F1", "resp_1", id="encoded-underscore"),
    P("%72%65%73%70", "resp", id="fully-encoded"),
    P("%41bc", "Abc", id="encoded-upper"),
    P("-", "-", id="dash"),
]


@pytest.mark.parametrize(("raw", "decoded"), VALID_IDS)
@pytest.mark.parametrize(
    ("method", "template"),
    [
        P("GET", "/v1/responses/{id}", id="retrieve"),
        P("DELETE", "/v1/responses/{id}", id="delete"),
        P("POST", "/v1/responses/{id}/cancel", id="cancel"),
        P("GET", "/v1/responses/{id}/input_items", id="input_items"),
        P("GET", "/v1/conversations/{id}", id="conversation"),
        P("POST", "/v1/conversations/{id}/items", id="conversation-items"),
    ],
)
def test_valid_resource_ids(method: str, template: str, raw: str, decoded: str) -> None:
    m = resolve(method, template.replace("{id}", raw))
    assert m is not None
    assert m.resource_id == decoded
    # the forwarded path is rebuilt from the template and the decoded id
    assert m.path == template.replace("{id}", decoded)
    assert m.endpoint.template == template


@pytest.mark.parametrize(("raw", "decoded"), VALID_IDS)
def test_valid_item_ids(raw: str, decoded: str) -> None:
    m = resolve("GET", f"/v1/conversations/conv_1/items/{raw}")
    assert m is not None
    assert m.item_id == decoded
    assert m.path == f"/v1/conversations/conv_1/items/{decoded}"


INVALID_IDS = [
    P("a%2Fb", id="encoded-slash"),
    P("a%2fb", id="encoded-slash-lower"),
    P("..", id="dot-dot"),
    P("%2e%2e", id="encoded-dot-dot"),
    P("%2E%2E", id="encoded-dot-dot-upper"),
    P(".", id="dot"),
    P("x" * 257, id="257-chars"),
    P("%78" * 257, id="257-chars-encoded"),
    P("x" * 800, id="way-too-long"),
    P("", id="empty"),
    P("%00", id="nul"),
    P("a%00b", id="nul-inside"),
    P("caf%C3%A9", id="unicode-encoded"),
    P("café", id="unicode-raw"),
    P("%EF%BC%A1", id="fullwidth-A"),
    P("a%20b", id="space"),
    P("a%3Fb", id="encoded-question"),
    P("a%23b", id="encoded-hash"),
    P("a%0A", id="encoded-newline"),
    P("a\n", id="raw-trailing-newline"),
    P("a%2Fcancel", id="encoded-slash-subresource"),
    P("%252F", id="double-encoded-decodes-to-percent"),
    P("a.b", id="dot-inside"),
    P("a%5Cb", id="backslash"),
]


@pytest.mark.parametrize("raw", INVALID_IDS)
@pytest.mark.parametrize(
    ("method", "template"),
    [
        P("GET", "/v1/responses/{id}", id="retrieve"),
        P("POST", "/v1/responses/{id}/cancel", id="cancel"),
        P("GET", "/v1/responses/{id}/input_items", id="input_items"),
    ],
)
def test_invalid_resource_ids_are_400(method: str, template: str, raw: str) -> None:
    with pytest.raises(InvalidRequest) as ei:
        resolve(method, template.replace("{id}", raw))
    assert ei.value.status == 400
    assert ei.value.param == "response_id"


@pytest.mark.parametrize("raw", INVALID_IDS)
@pytest.mark.parametrize(
    ("method", "template", "param"),
    [
        P("GET", "/v1/conversations/{id}", "conversation_id", id="conversation"),
        P("GET", "/v1/conversations/{id}/items", "conversation_id", id="items"),
        P("DELETE", "/v1/conversations/{id}/items/msg_1", "conversation_id", id="item-conv"),
        P("GET", "/v1/conversations/conv_1/items/{id}", "item_id", id="item"),
    ],
)
def test_invalid_conversation_and_item_ids_are_400(
    method: str, template: str, param: str, raw: str
) -> None:
    with pytest.raises(InvalidRequest) as ei:
        resolve(method, template.replace("{id}", raw))
    assert ei.value.status == 400
    assert ei.value.param == param


def test_match_path_is_canonical_not_client_bytes() -> None:
    m = resolve("GET", "/v1/responses/%72esp_%31/input_items")
    assert m is not None
    assert m.path == "/v1/responses/resp_1/input_items"
    assert "%" not in m.path


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        P("/v1/messages", "anthropic", id="messages"),
        P("/v1/messages/count_tokens", "anthropic", id="count_tokens"),
        P("/v1/messages/anything/else", "anthropic", id="under-messages"),
        P("/v1/messagesx", "openai", id="not-under-messages"),
        P("/v1/chat/completions", "openai", id="chat"),
        P("/v1/responses/x", "openai", id="responses"),
        P("/whatever", "openai", id="other"),
    ],
)
def test_shape_for_path(path: str, shape: str) -> None:
    assert shape_for_path(path) == shape


def test_404_under_messages_renders_anthropic_shape() -> None:
    path = "/v1/messages/batches"
    with pytest.raises(UnknownEndpoint) as ei:
        resolve("POST", path)
    body = ei.value.body(shape_for_path(path))
    assert body.startswith(b'{"type":"error"')


# --------------------------------------------------------------------------------------
# property: resolve never leaves the registry
# --------------------------------------------------------------------------------------

_TEMPLATES = {e.template for e in ENDPOINTS}
_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,256}")
_SEGMENTS = st.sampled_from(
    [
        "v1",
        "chat",
        "completions",
        "messages",
        "count_tokens",
        "responses",
        "cancel",
        "input_items",
        "conversations",
        "items",
        "generate",
        "tokenize",
        "detokenize",
        "models",
        "",
        ".",
        "..",
        "%2e%2e",
        "%2F",
        "%2f",
        "%00",
        "resp_1",
        "%41",
        "x" * 300,
        "é",
    ]
)


@st.composite
def _paths(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        segs = draw(st.lists(_SEGMENTS | st.text(max_size=8), min_size=1, max_size=6))
        return "/" + "/".join(segs)
    prefix = draw(
        st.sampled_from(
            [
                "/v1/responses/",
                "/v1/conversations/",
                "/v1/conversations/conv_1/items/",
                "/v1/chat/",
                "/v1/messages/",
                "/generate",
                "/v1/models/",
                "/",
            ]
        )
    )
    return prefix + draw(st.text(max_size=40))


@settings(max_examples=400, deadline=None)
@given(method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "HEAD"]), path=_paths())
def test_resolve_never_leaves_the_registry(method: str, path: str) -> None:
    error: MeshError | None = None
    try:
        m = resolve(method, path)
    except (UnknownEndpoint, MethodNotAllowed, InvalidRequest) as exc:
        error = exc
    if error is not None:
        assert error.status in (400, 404, 405)
        return
    if m is None:
        return
    assert m.endpoint.template in _TEMPLATES
    assert method in m.endpoint.methods
    if m.endpoint.is_resource:
        assert m.resource_id is not None
        assert _ID_RE.fullmatch(m.resource_id)
        expected = m.endpoint.template.replace("{id}", m.resource_id)
        if "{item_id}" in expected:
            assert m.item_id is not None
            assert _ID_RE.fullmatch(m.item_id)
            expected = expected.replace("{item_id}", m.item_id)
        else:
            assert m.item_id is None
        assert m.path == expected
    elif m.model is not None:
        assert m.endpoint.name == "models.retrieve"
        assert m.path == "/v1/models"  # the model id is never forwarded
    else:
        assert m.resource_id is None
        assert m.path == m.endpoint.template
    assert ".." not in m.path
    assert "%" not in m.path
