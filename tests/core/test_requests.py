"""Table tests for :mod:`meshkit.core.requests`: request views, validation, routing text."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.core.endpoints import Match, resolve
from meshkit.core.requests import (
    _REPLACE_COUNTS_MAX,
    RequestView,
    _too_deep,
    check_declared,
    check_media,
    declared_over,
    parse_request,
)
from meshkit.errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType

P = pytest.param


def _match(path: str, method: str = "POST") -> Match:
    m = resolve(method, path)
    assert m is not None
    return m


CHAT = _match("/v1/chat/completions")
COMPLETIONS = _match("/v1/completions")
MESSAGES = _match("/v1/messages")
COUNT_TOKENS = _match("/v1/messages/count_tokens")
RESPONSES = _match("/v1/responses")
GENERATE = _match("/generate")
TOKENIZE = _match("/v1/tokenize")
CANCEL = _match("/v1/responses/resp_1/cancel")
RETRIEVE = _match("/v1/responses/resp_1", "GET")
MODELS = _match("/v1/models", "GET")

ALL_CREATE = [
    P(CHAT, id="chat"),
    P(COMPLETIONS, id="completions"),
    P(MESSAGES, id="messages"),
    P(COUNT_TOKENS, id="count_tokens"),
    P(RESPONSES, id="responses"),
    P(GENERATE, id="generate"),
    P(TOKENIZE, id="tokenize"),
]


def parse(match: Match, obj: Any, *, want_text: bool = True) -> RequestView:
    return parse_request(match, json.dumps(obj).encode(), want_text=want_text)


# --------------------------------------------------------------------------------------
# model / stream / include_usage
# --------------------------------------------------------------------------------------

BASICS = [
    # match, body, model, stream, include_usage
    P(CHAT, {"model": "m", "messages": []}, "m", False, False, id="chat"),
    P(CHAT, {"model": "m", "stream": True}, "m", True, False, id="chat-stream"),
    P(
        CHAT,
        {"model": "m", "stream": True, "stream_options": {"include_usage": True}},
        "m",
        True,
        True,
        id="chat-stream-usage",
    ),
    P(
        CHAT,
        {"stream": False, "stream_options": {"include_usage": True}},
        None,
        False,
        False,
        id="chat-usage-without-stream",
    ),
    P(
        CHAT,
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        None,
        True,
        False,
        id="chat-usage-not-true",
    ),
    P(CHAT, {"stream": None}, None, False, False, id="chat-stream-null"),
    P(COMPLETIONS, {"model": "c", "prompt": "hi"}, "c", False, False, id="completions"),
    P(
        COMPLETIONS,
        {"model": "c", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        "c",
        True,
        True,
        id="completions-usage",
    ),
    P(MESSAGES, {"model": "claude", "stream": True, "messages": []}, "claude", True, False, id="m"),
    P(COUNT_TOKENS, {"model": "claude", "stream": True}, "claude", False, False, id="count"),
    P(RESPONSES, {"model": "r", "input": "hi", "stream": True}, "r", True, False, id="responses"),
    P(GENERATE, {"text": "hi", "stream": True}, None, True, False, id="generate"),
    P(TOKENIZE, {"model": "t", "prompt": "hi"}, "t", False, False, id="tokenize"),
    P(CHAT, {}, None, False, False, id="empty-object"),
]


@pytest.mark.parametrize(("match", "body", "model", "stream", "usage"), BASICS)
def test_model_stream_usage(
    match: Match, body: Any, model: str | None, stream: bool, usage: bool
) -> None:
    v = parse(match, body)
    assert v.model == model
    assert v.stream is stream
    assert v.include_usage is usage
    assert v.api is match.endpoint.api
    assert v.body == json.dumps(body).encode()


@pytest.mark.parametrize(
    "match", [P(CANCEL, id="cancel"), P(RETRIEVE, id="retrieve"), P(MODELS, id="models")]
)
def test_bodyless_operations_are_not_parsed(match: Match) -> None:
    # cancel takes no JSON body; GETs have none: even garbage is not a 400
    v = parse_request(match, b"not json")
    assert v.model is None
    assert v.match is match


# --------------------------------------------------------------------------------------
# routing text in prompt order
# --------------------------------------------------------------------------------------

SYSTEM = "SYSTEM-PROMPT you are terse"
TOOL = {"type": "function", "function": {"name": "TOOL_lookup", "parameters": {}}}
USER = "USER-TURN what is up"

PROMPT_ORDER = [
    P(
        CHAT,
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": USER},
            ],
            "tools": [TOOL],
        },
        id="chat",
    ),
    P(
        MESSAGES,
        {
            "messages": [{"role": "user", "content": USER}],
            "tools": [{"name": "TOOL_lookup", "input_schema": {}}],
            "system": SYSTEM,
        },
        id="messages-system-str",
    ),
    P(
        MESSAGES,
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": USER}]}],
            "tools": [{"name": "TOOL_lookup", "input_schema": {}}],
            "system": [{"type": "text", "text": SYSTEM}],
        },
        id="messages-system-blocks",
    ),
    P(
        RESPONSES,
        {"input": USER, "tools": [TOOL], "instructions": SYSTEM},
        id="responses-input-str",
    ),
    P(
        RESPONSES,
        {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": USER}]}],
            "tools": [TOOL],
            "instructions": SYSTEM,
        },
        id="responses-input-items",
    ),
]


@pytest.mark.parametrize(("match", "body"), PROMPT_ORDER)
def test_routing_text_is_in_prompt_order(match: Match, body: Any) -> None:
    # the JSON puts messages/input first (and alphabetical order would too):
    # the routing text must still start with the system prompt and the tools
    text = parse(match, body).routing_text
    assert SYSTEM in text
    assert "TOOL_lookup" in text
    assert USER in text
    # system, then tools, then the turns: how chat templates render them
    assert text.index(SYSTEM) < text.index("TOOL_lookup") < text.index(USER)


@pytest.mark.parametrize(("match", "body"), PROMPT_ORDER)
def test_routing_text_only_when_wanted(match: Match, body: Any) -> None:
    v = parse(match, body, want_text=False)
    assert v.routing_text == ""
    # the weight is the text's length whether it is built or not
    assert v.prompt_weight == len(parse(match, body).routing_text) > 0


def test_a_role_starts_its_line_of_the_routing_text() -> None:
    """Each message reads "role\ncontent" (the role a part of its own, joined by
    the same newline as the parts); a message without a string role is its content."""
    body = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": ""},
            {"content": "no role"},
            {"role": "assistant", "content": [{"type": "text", "text": "A"}]},
        ]
    }
    v = parse(CHAT, body)
    assert v.routing_text == "system\nS\nuser\n\nno role\nassistant\nA"
    assert v.prompt_weight == len(v.routing_text)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def _chat_body(user: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
        ],
        "tools": [TOOL],
        "temperature": 0.2,
    }


@pytest.mark.parametrize(
    ("match", "make"),
    [
        P(CHAT, _chat_body, id="chat"),
        P(
            MESSAGES,
            lambda u: {
                "messages": [{"role": "user", "content": u}],
                "tools": [{"name": "TOOL_lookup", "input_schema": {}}],
                "system": SYSTEM,
                "max_tokens": 5,
            },
            id="messages",
        ),
        P(
            RESPONSES,
            lambda u: {"input": u, "tools": [TOOL], "instructions": SYSTEM},
            id="responses",
        ),
    ],
)
def test_same_system_and_tools_share_a_routing_prefix(match: Match, make: Any) -> None:
    # seed 000's nit: requests that differ only in the user turn share a prefix that
    # covers the system prompt and the tools (prefix/cache-aware routing relies on it)
    a = parse(match, make("first question about cats")).routing_text
    b = parse(match, make("another, unrelated question")).routing_text
    assert a != b
    prefix = _common_prefix(a, b)
    assert SYSTEM in prefix
    assert "TOOL_lookup" in prefix


def test_chat_tool_calls_and_multimodal_parts_are_kept_stable() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ]
    }
    text = parse(CHAT, body).routing_text
    assert "<image_url>" in text
    assert "data:x" not in text  # binary payloads never copied into routing text
    assert "call_1" in text
    assert text.index("<image_url>") < text.index("call_1") < text.index("tool\n42")


# --------------------------------------------------------------------------------------
# permissive validation (seed 000: ingress narrower than the backends was a bug)
# --------------------------------------------------------------------------------------

PERMISSIVE = [
    P(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, id="no-max-tokens"),
    P(CHAT, {"messages": [], "temperature": 1.7}, id="chat-temp-1.7"),
    P(CHAT, {"messages": [], "top_k": -1}, id="chat-top-k-minus-1"),
    P(MESSAGES, {"model": "c", "messages": []}, id="messages-no-max-tokens"),
    P(MESSAGES, {"messages": [], "temperature": 1.7, "max_tokens": 5}, id="messages-temp-1.7"),
    P(MESSAGES, {"messages": [], "top_k": -1}, id="messages-top-k-minus-1"),
    P(RESPONSES, {"input": "x", "temperature": 1.7, "top_k": -1}, id="responses-sampling"),
    P(COMPLETIONS, {"prompt": "x", "temperature": 2.0, "top_k": -1}, id="completions-sampling"),
    P(
        CHAT,
        {
            "messages": [
                {"role": r, "content": "x"}
                for r in ("developer", "system", "user", "assistant", "tool", "function")
            ]
        },
        id="chat-every-role",
    ),
    P(
        MESSAGES,
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "text", "text": "y"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            ]
        },
        id="anthropic-roles",
    ),
    P(MESSAGES, {"messages": [{"role": "system", "content": "x"}]}, id="anthropic-odd-role"),
    P(CHAT, {"messages": [], "x_vendor": {"a": [1, 2]}, "n": 3}, id="unknown-fields"),
    P(CHAT, {"messages": [], "seed": 1, "logit_bias": {"5": -100}}, id="more-unknown"),
    P(RESPONSES, {"input": "x", "reasoning": {"effort": "high"}}, id="responses-unknown"),
    P(GENERATE, {"text": "x", "sampling_params": {"max_new_tokens": 5}}, id="generate-extra"),
    P(CHAT, {"messages": [], "model": None}, id="model-null"),
    P(CHAT, {"messages": [], "user": None, "tools": None}, id="nulls"),
    P(CHAT, {"messages": [{"role": 5, "content": {"odd": True}}]}, id="odd-message-kept"),
]


@pytest.mark.parametrize(("match", "body"), PERMISSIVE)
def test_permissive_validation(match: Match, body: Any) -> None:
    v = parse(match, body)
    assert v.body == json.dumps(body).encode()
    assert v.api is match.endpoint.api


# --------------------------------------------------------------------------------------
# Responses state
# --------------------------------------------------------------------------------------

STATE = [
    # body, previous_response_id, conversation, item_references
    P({"input": "x"}, None, None, (), id="stateless"),
    P({"input": "x", "previous_response_id": "resp_1"}, "resp_1", None, (), id="prev-id"),
    P({"input": "x", "previous_response_id": ""}, None, None, (), id="prev-id-empty"),
    P({"input": "x", "previous_response_id": None}, None, None, (), id="prev-id-null"),
    P({"input": "x", "conversation": "conv_1"}, None, "conv_1", (), id="conversation-str"),
    P({"input": "x", "conversation": {"id": "conv_2"}}, None, "conv_2", (), id="conversation-obj"),
    P({"input": "x", "conversation": {}}, None, None, (), id="conversation-empty-obj"),
    P(
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        None,
        None,
        ("msg_1",),
        id="item-reference",
    ),
    P(
        {"input": [{"type": None, "id": "msg_2"}]},
        None,
        None,
        ("msg_2",),
        id="item-reference-type-null",
    ),
    P({"input": [{"id": "msg_3"}]}, None, None, ("msg_3",), id="item-reference-id-only"),
    P(
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"id": "msg_4"},
                {"type": "item_reference", "id": "msg_5"},
            ]
        },
        None,
        None,
        ("msg_4", "msg_5"),
        id="mixed-items",
    ),
    P(
        {"input": [{"type": "message", "id": "msg_6", "role": "assistant", "content": "x"}]},
        None,
        None,
        (),
        id="full-message-item-is-not-a-reference",
    ),
    P(
        {"input": [{"id": "msg_7", "role": "user", "content": "x"}]},
        None,
        None,
        (),
        id="item-with-role-is-not-a-reference",
    ),
]


@pytest.mark.parametrize(("body", "prev", "conv", "refs"), STATE)
def test_responses_state_refs(
    body: Any, prev: str | None, conv: str | None, refs: tuple[str, ...]
) -> None:
    v = parse(RESPONSES, body)
    assert v.previous_response_id == prev
    assert v.conversation == conv
    assert v.item_references == refs
    assert v.stateful is bool(prev or conv or refs)
    # what a router that did not place it looks up (an item alone cannot be)
    assert v.state_id == (prev or conv)


@pytest.mark.parametrize(
    ("body", "path"),
    [
        P({"previous_response_id": "resp_1"}, "/v1/responses/resp_1", id="response"),
        P({"conversation": "conv_1"}, "/v1/conversations/conv_1", id="conversation-str"),
        P({"conversation": {"id": "conv_2"}}, "/v1/conversations/conv_2", id="conversation-obj"),
        P({"input": [{"id": "msg_1"}]}, None, id="item-reference"),
        P({"input": "x"}, None, id="stateless"),
    ],
)
def test_the_lookup_path_of_the_referenced_state(body: Any, path: str | None) -> None:
    assert parse(RESPONSES, {"input": "x", **body}).state_path == path


@pytest.mark.parametrize("field", ["previous_response_id", "conversation"])
def test_a_referenced_id_no_stored_object_can_have_is_refused(field: str) -> None:
    # It would be looked up on every origin by that id (quoted into the path).
    with pytest.raises(InvalidRequest) as ei:
        parse(RESPONSES, {"input": "x", field: "c/../x?y"})
    assert ei.value.param == field


@pytest.mark.parametrize("body", [b"", b" \n"])
def test_a_conversation_create_may_have_no_body(body: bytes) -> None:
    m = resolve("POST", "/v1/conversations")
    assert m is not None
    assert parse_request(m, body).body == body
    with pytest.raises(InvalidRequest):
        parse_request(m, b"[1")


def test_a_conversation_create_is_not_read_as_a_response() -> None:
    m = resolve("POST", "/v1/conversations")
    assert m is not None
    v = parse(m, {"items": [{"role": "user", "content": "hi"}], "conversation": "conv_1"})
    assert v.state_id is None
    assert not v.stateful  # it creates state; it references none


@pytest.mark.parametrize(
    "conversation",
    [P("conv_1", id="str"), P({"id": "conv_1"}, id="obj")],
)
def test_previous_response_id_with_conversation_is_400(conversation: Any) -> None:
    with pytest.raises(InvalidRequest) as ei:
        parse(RESPONSES, {"previous_response_id": "r", "conversation": conversation})
    assert ei.value.status == 400
    assert ei.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        P({"input": [{"type": "item_reference", "id": 5}]}, "input", id="ref-id-int"),
        P({"input": [{"type": "item_reference"}]}, "input", id="ref-no-id"),
        P({"input": [{"type": "item_reference", "id": ""}]}, "input", id="ref-id-empty"),
        P({"input": [{"id": 7}]}, "input", id="bare-ref-id-int"),
        P({"input": ["a string item"]}, "input", id="item-not-object"),
        P({"conversation": {"id": 5}}, "conversation", id="conversation-id-int"),
        P({"conversation": 5}, "conversation", id="conversation-int"),
        P({"previous_response_id": 5}, "previous_response_id", id="prev-int"),
    ],
)
def test_bad_state_fields_are_400(body: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as ei:
        parse(RESPONSES, body)
    assert ei.value.param == param


# --------------------------------------------------------------------------------------
# wrong types of routing fields: 400 with a param
# --------------------------------------------------------------------------------------

WRONG_TYPES = [
    P(CHAT, {"model": 5}, "model", id="chat-model-int"),
    P(CHAT, {"model": ["m"]}, "model", id="chat-model-list"),
    P(CHAT, {"stream": "yes"}, "stream", id="chat-stream-str"),
    P(CHAT, {"stream": 1}, "stream", id="chat-stream-int"),
    P(CHAT, {"messages": {}}, "messages", id="chat-messages-obj"),
    P(CHAT, {"messages": "hi"}, "messages", id="chat-messages-str"),
    P(CHAT, {"tools": {}}, "tools", id="chat-tools-obj"),
    P(CHAT, {"stream_options": []}, "stream_options", id="chat-stream-options-list"),
    P(CHAT, {"user": 1}, "user", id="chat-user-int"),
    P(CHAT, {"prompt_cache_key": 1}, "prompt_cache_key", id="chat-cache-key-int"),
    P(COMPLETIONS, {"prompt": 5}, "prompt", id="completions-prompt-int"),
    P(COMPLETIONS, {"prompt": {}}, "prompt", id="completions-prompt-obj"),
    P(MESSAGES, {"system": 5}, "system", id="messages-system-int"),
    P(MESSAGES, {"metadata": "u"}, "metadata", id="messages-metadata-str"),
    P(MESSAGES, {"messages": None}, "messages", id="messages-null"),
    P(RESPONSES, {"input": 5}, "input", id="responses-input-int"),
    P(RESPONSES, {"instructions": []}, "instructions", id="responses-instructions-list"),
    P(GENERATE, {"text": 5}, "text", id="generate-text-int"),
    P(GENERATE, {"input_ids": "1 2"}, "input_ids", id="generate-ids-str"),
    P(GENERATE, {"input_ids": ["a"]}, "input_ids", id="generate-ids-strs"),
    P(GENERATE, {"input_ids": [[1, "a"]]}, "input_ids", id="generate-ids-nested-strs"),
    P(TOKENIZE, {"model": 1}, "model", id="tokenize-model-int"),
    P(COUNT_TOKENS, {"model": {}}, "model", id="count-tokens-model-obj"),
]


@pytest.mark.parametrize(("match", "body", "param"), WRONG_TYPES)
def test_wrong_typed_routing_field_is_400_with_param(match: Match, body: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as ei:
        parse(match, body)
    err = ei.value
    assert (err.status, err.code) == (400, "invalid_request")
    assert err.param == param
    assert json.loads(err.body())["error"]["param"] == param


# --------------------------------------------------------------------------------------
# unusable JSON
# --------------------------------------------------------------------------------------

UNUSABLE = [
    P(b"", id="empty"),
    P(b"   \n", id="whitespace"),
    P(b'{"model": "m"', id="truncated"),
    P(b'{"model": "m"}}', id="trailing-brace"),
    P(b'{"model": "m"} x', id="trailing-garbage"),
    P(b"[]", id="array"),
    P(b"[{}]", id="array-of-object"),
    P(b'"string"', id="string"),
    P(b"42", id="number"),
    P(b"null", id="null"),
    P(b"true", id="true"),
    P(b'{"model": "\xff"}', id="invalid-utf8-in-string"),
    P(b"\xff\xfe{}", id="invalid-utf8-bom"),
    P(b'{"temperature": NaN}', id="nan"),
    P(b'{"temperature": Infinity}', id="infinity"),
    P(b"{'model': 'm'}", id="single-quotes"),
    P(b'{"model": "m",}', id="trailing-comma"),
    P(b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", id="nested-100k-closed"),
    P(b"[" * 100_000, id="nested-100k-open"),
    P(b'{"messages": [' + b"{" * 100_000, id="nested-100k-objects"),
    P(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", id="nested-100k-messages"),
]


@pytest.mark.parametrize("body", UNUSABLE)
@pytest.mark.parametrize("match", ALL_CREATE)
def test_unusable_json_is_400(match: Match, body: bytes) -> None:
    with pytest.raises(InvalidRequest) as ei:
        parse_request(match, body, want_text=True)
    assert ei.value.status == 400
    assert ei.value.code == "invalid_request"


def test_error_message_never_echoes_the_body() -> None:
    secret = b"SECRET-PROMPT-TEXT"
    for body in (b'{"model": "' + secret + b'"', b'{"model": ["' + secret + b'"]}'):
        with pytest.raises(InvalidRequest) as ei:
            parse_request(CHAT, body)
        assert secret.decode() not in ei.value.message
        assert secret not in ei.value.body()


_JSONISH = st.sampled_from([b"{", b"}", b"[", b"]", b'"', b":", b",", b"1", b"null", b" "])


@settings(max_examples=300, deadline=None)
@given(
    match=st.sampled_from([p.values[0] for p in ALL_CREATE]),
    body=st.binary(max_size=200) | st.lists(_JSONISH, max_size=60).map(b"".join),
)
def test_random_bytes_raise_only_invalid_request(match: Match, body: bytes) -> None:
    error: InvalidRequest | None = None
    try:
        v = parse_request(match, body, want_text=True)
    except InvalidRequest as exc:
        error = exc
    if error is not None:
        assert (error.status, error.code) == (400, "invalid_request")
    else:
        assert isinstance(v, RequestView)
        assert v.body is body


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=10,
)
_FIELDS = st.sampled_from(
    [
        "model",
        "stream",
        "messages",
        "tools",
        "system",
        "input",
        "prompt",
        "text",
        "input_ids",
        "conversation",
        "previous_response_id",
        "metadata",
        "stream_options",
        "instructions",
        "user",
        "data_parallel_rank",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    match=st.sampled_from([p.values[0] for p in ALL_CREATE]),
    obj=st.dictionaries(_FIELDS, _JSON_VALUES, max_size=5),
)
def test_random_objects_raise_only_invalid_request(match: Match, obj: dict[str, Any]) -> None:
    # well-formed JSON with routing fields of arbitrary types: a view or a 400
    error: InvalidRequest | None = None
    try:
        v = parse(match, obj)
    except InvalidRequest as exc:
        error = exc
    if error is not None:
        assert error.status == 400
    else:
        assert v.api is match.endpoint.api


# --------------------------------------------------------------------------------------
# media type and content encoding
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ctype", "cenc"),
    [
        P("application/json", None, id="json"),
        P("application/json; charset=utf-8", None, id="json-charset"),
        P("Application/JSON", None, id="json-case"),
        P("application/vnd.x+json", None, id="vendor-json"),
        P("application/problem+json; charset=utf-8", None, id="problem-json"),
        P(None, None, id="missing"),
        P("", None, id="empty"),
        P("application/json", "identity", id="identity"),
        P("application/json", "Identity ", id="identity-case-space"),
        P("application/json", "", id="encoding-empty"),
    ],
)
def test_check_media_accepts(ctype: str | None, cenc: str | None) -> None:
    check_media(ctype, cenc)


@pytest.mark.parametrize(
    ("ctype", "cenc"),
    [
        P("text/plain", None, id="text-plain"),
        P("application/x-www-form-urlencoded", None, id="form"),
        P("multipart/form-data; boundary=x", None, id="multipart"),
        P("application/jsonx", None, id="jsonx"),
        P("application/json", "gzip", id="gzip"),
        P("application/json", "br", id="br"),
        P("application/json", "deflate", id="deflate"),
        P("application/json", "zstd", id="zstd"),
        P(None, "gzip", id="gzip-no-type"),
        P("application/json", "gzip, identity", id="chain"),
    ],
)
def test_check_media_rejects_415(ctype: str | None, cenc: str | None) -> None:
    with pytest.raises(UnsupportedMediaType) as ei:
        check_media(ctype, cenc)
    assert (ei.value.status, ei.value.code) == (415, "unsupported_media_type")


# --------------------------------------------------------------------------------------
# token ids, /generate, routing keys, data_parallel_rank
# --------------------------------------------------------------------------------------

TOKENS = [
    # match, body, token_ids, routing_text
    P(COMPLETIONS, {"prompt": [1, 2, 3]}, [1, 2, 3], "", id="completions-ids"),
    P(COMPLETIONS, {"prompt": [[4, 5], [6]]}, [4, 5], "", id="completions-batch-ids"),
    P(COMPLETIONS, {"prompt": "hello"}, None, "hello", id="completions-text"),
    P(COMPLETIONS, {"prompt": ["a", "b"]}, None, "a\nb", id="completions-text-list"),
    P(COMPLETIONS, {"prompt": [True, False]}, None, "", id="completions-bools-not-ids"),
    P(COMPLETIONS, {"prompt": [[1, True, 2]]}, [1, 2], "", id="completions-batch-bools-dropped"),
    P(COMPLETIONS, {"prompt": []}, None, "", id="completions-empty"),
    P(GENERATE, {"text": "hello"}, None, "hello", id="generate-text"),
    P(GENERATE, {"text": ["first", "second"]}, None, "first", id="generate-text-batch"),
    P(GENERATE, {"input_ids": [7, 8]}, [7, 8], "", id="generate-ids"),
    P(GENERATE, {"input_ids": [[9], [10, 11]]}, [9], "", id="generate-ids-batch"),
]


@pytest.mark.parametrize(("match", "body", "ids", "text"), TOKENS)
def test_token_ids_and_text(match: Match, body: Any, ids: list[int] | None, text: str) -> None:
    v = parse(match, body)
    assert v.token_ids == ids
    assert v.routing_text == text
    if ids:
        assert v.prompt_weight > 0


ROUTING_KEYS = [
    P(CHAT, {"prompt_cache_key": "pck", "safety_identifier": "s", "user": "u"}, "pck", id="c-pck"),
    P(CHAT, {"safety_identifier": "s", "user": "u"}, "s", id="chat-safety"),
    P(CHAT, {"user": "u"}, "u", id="chat-user"),
    P(CHAT, {}, None, id="chat-none"),
    P(CHAT, {"prompt_cache_key": "", "user": "u"}, "u", id="chat-empty-key-falls-back"),
    P(RESPONSES, {"prompt_cache_key": "pck", "user": "u"}, "pck", id="responses-pck"),
    P(RESPONSES, {"safety_identifier": "s"}, "s", id="responses-safety"),
    P(RESPONSES, {"user": "u"}, "u", id="responses-user"),
    P(COMPLETIONS, {"user": "u", "prompt": "x"}, "u", id="completions-user"),
    P(MESSAGES, {"metadata": {"user_id": "uid"}}, "uid", id="messages-user-id"),
    P(MESSAGES, {"metadata": {"user_id": 5}}, None, id="messages-user-id-int"),
    P(MESSAGES, {"metadata": {}}, None, id="messages-no-user-id"),
    P(MESSAGES, {"user": "u"}, None, id="messages-ignores-user"),
]


@pytest.mark.parametrize(("match", "body", "key"), ROUTING_KEYS)
def test_routing_key(match: Match, body: Any, key: str | None) -> None:
    assert parse(match, body).routing_key == key


@pytest.mark.parametrize(
    ("match", "body", "has"),
    [
        P(CHAT, {"data_parallel_rank": 1}, True, id="chat"),
        P(CHAT, {"data_parallel_rank": None}, True, id="chat-null"),
        P(CHAT, {}, False, id="chat-absent"),
        P(COMPLETIONS, {"prompt": "x", "data_parallel_rank": 0}, True, id="completions"),
        P(MESSAGES, {"data_parallel_rank": 2}, True, id="messages"),
        P(RESPONSES, {"data_parallel_rank": 3}, True, id="responses"),
        P(GENERATE, {"text": "x", "data_parallel_rank": 0}, True, id="generate"),
        P(GENERATE, {"text": "x"}, False, id="generate-absent"),
    ],
)
def test_has_dp_rank(match: Match, body: Any, has: bool) -> None:
    assert parse(match, body).has_dp_rank is has


def test_large_realistic_body_parses_quickly() -> None:
    # a 1 MiB prompt: parsed once, the body kept as the same bytes object
    big = os.urandom(384 * 1024).hex()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": big}]}).encode()
    v = parse_request(CHAT, body, want_text=True)
    assert v.body is body
    assert big in v.routing_text


# -- JSON depth ----------------------------------------------------------------------


def _depth(value: Any) -> int:
    """The nesting depth of a decoded JSON value (the top container is 1)."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    # strings full of what the scan looks for: brackets, quotes, backslashes, the
    # bytes of escapes (a newline, a tab, "/", "x")
    | st.text(alphabet='[]{}"\\ ab\n\t/x\u00e9', max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=60,
)


@settings(max_examples=400, deadline=None)
@given(_json_values, st.integers(min_value=0, max_value=12), st.booleans())
def test_too_deep_agrees_with_the_decoded_depth(value: Any, limit: int, spaced: bool) -> None:
    body = json.dumps(value, indent=1 if spaced else None).encode()
    assert _too_deep(body, limit) == (_depth(value) > limit)


@pytest.mark.parametrize("depth", [1, 2, 63, 64, 65, 200])
def test_too_deep_counts_alternating_brackets(depth: int) -> None:
    # {"a":[{"a":[ ... ]}]}: two kinds of bracket, one level each
    body = "1"
    for i in range(depth):
        body = "[" + body + "]" if i % 2 else '{"a":' + body + "}"
    assert _too_deep(body.encode(), 64) == (depth > 64)


def test_too_deep_ignores_brackets_inside_strings() -> None:
    body = json.dumps({"x": "[" * 500 + "{" * 500, "y": '\\"[[[[' * 100}).encode()
    assert not _too_deep(body, 4)


@pytest.mark.parametrize("depth", [63, 64, 65, 3000])
def test_too_deep_on_long_chains_and_wide_bodies(depth: int) -> None:
    # a long chain (passes peel little: the accumulate branch) next to wide siblings
    chain = "[" * (depth - 1) + "]" * (depth - 1)
    wide = ",".join(['{"a":[1]}'] * 3000)
    # siblings 10 deep: a pass peels a tenth of them (the accumulate branch too)
    tall = ",".join(["[" * 10 + "]" * 10] * 1000)
    bodies = [
        '{"x":' + chain + "}",
        '{"w":[' + wide + '],"x":' + chain + "}",
        '{"t":[' + tall + '],"x":' + chain + "}",
    ]
    for body in bodies:
        assert _too_deep(body.encode(), 64) == (depth > 64), body[:40]


@pytest.mark.parametrize("depth", [63, 64, 65, 300])
@pytest.mark.parametrize("extra", [-1, 0, 1, 40_000])
def test_too_deep_either_side_of_the_replace_count_bound(depth: int, extra: int) -> None:
    # the same chain padded to just under, at and just over the size up to which
    # brackets are counted with replace (find past it), and far past it
    chain = json.dumps(_chain(depth), separators=(",", ":"))
    frame = '{"p":"","x":' + chain + "}"
    size = _REPLACE_COUNTS_MAX + extra
    body = ('{"p":"' + "x" * (size - len(frame)) + '","x":' + chain + "}").encode()
    assert len(body) == size
    assert _too_deep(body, 64) == (depth + 1 > 64) == (_depth(json.loads(body)) > 64)


@pytest.mark.parametrize(
    "string",
    [
        rb'"\/\b\f\n\r\t\u005b\\\"[[["',  # every escape, then brackets in the string
        rb'"ends in a backslash \\"',
        rb'"\\\""',  # an escaped backslash, an escaped quote
        rb'"\n"',
        rb'"\u00e9\ubfbf"',  # hex digits that are escape letters too
        rb'"x\\\\\nx"',
    ],
)
def test_too_deep_reads_every_escape(string: bytes) -> None:
    # each string next to a structure 4 deep, on either side, in bodies with more
    # openers than are counted before a scan
    for body in (
        b'{"s":' + string + b',"d":[[[1]]],"w":[' + b"{}," * 40 + b"{}]}",
        b'{"d":[[[' + string + b"]]]," + b'"w":[' + b"[]," * 40 + b"[]]}",
    ):
        depth = _depth(json.loads(body))
        assert depth == 4
        assert _too_deep(body, 3)
        assert not _too_deep(body, 4)


def _agent_body(extra: Any) -> bytes:
    """An agent's session: 100 turns of tool calls whose arguments and results are
    JSON inside strings (escaped quotes, brackets), ~1,000 brackets in ~44 KiB:
    more openers than are counted before a scan, with ``extra`` as one more field."""
    messages: list[Any] = [{"role": "system", "content": "be brief"}]
    for i in range(100):
        args = json.dumps({"q": f"find {i}", "opts": {"tags": ["a", "b"], "n": [i]}})
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": args}}
        messages.append({"role": "user", "content": [{"type": "text", "text": f"[{i}] {{go}}"}]})
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": json.dumps([args])})
    return json.dumps({"model": "m", "messages": messages, "extra": extra}).encode()


def _chain(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


@pytest.mark.parametrize("depth", [62, 63, 64, 200])
def test_too_deep_in_a_long_agent_session(depth: int) -> None:
    # the body's own nesting is 6 (itself, "messages", a message, "tool_calls", a
    # call, "function"); a chain under "extra" (depth + 1 with the body) decides,
    # and the same chain inside a string (as tool arguments carry JSON) never does
    nested = _agent_body(_chain(depth))
    assert len(nested) > 40_000
    assert nested.count(b"{") + nested.count(b"[") > 1_000
    assert _too_deep(nested, 64) == (depth + 1 > 64) == (_depth(json.loads(nested)) > 64)
    assert not _too_deep(_agent_body(json.dumps(_chain(depth))), 64)


# -- a declared Content-Length (every mode's 413 before the body) ----------------------


@pytest.mark.parametrize(
    ("value", "over"),
    [
        (b"8192", False),  # at the bound
        (b"8193", True),
        (b" 8193\t", True),  # optional whitespace around the digits
        (b"08193", True),
        (b"0" * 30 + b"8192", False),  # leading zeros are digits too, not a huge number
        (b"0" * 30, False),
        (b"0", False),
        (b"9" * 19, True),  # past 10**18: over without converting it
        (b"1" * 5000, True),  # int() would refuse it (> 4,300 digits) with a ValueError
        # Not a length: nothing is declared (the server's parser refuses the head)
        (b"+8193", False),
        (b"8_193", False),
        (b"-1", False),
        (b"", False),
        (b"  ", False),
        (b"12 34", False),
        ("８１９３".encode(), False),  # digits outside ASCII
    ],
)
def test_declared_over(value: bytes, over: bool) -> None:
    assert declared_over(value, 8192) is over


def test_check_declared_reads_the_first_length_only() -> None:
    check_declared([(b"content-type", b"application/json")], 10)
    check_declared([(b"content-length", b"10"), (b"content-length", b"11")], 10)
    with pytest.raises(RequestTooLarge, match="request body is over 10 bytes"):
        check_declared([(b"host", b"x"), (b"content-length", b"1" * 5000)], 10)
