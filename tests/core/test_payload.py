"""Table tests for :mod:`meshkit.core.payload`: the byte-exact data_parallel_rank append."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.core.payload import RankBase, append_fields, rank_base, with_rank
from meshkit.errors import InvalidRequest

P = pytest.param

APPEND = [
    # body, rank, expected bytes
    P(b"{}", 3, b'{"data_parallel_rank":3}', id="empty"),
    P(b"{ }", 0, b'{"data_parallel_rank":0}', id="empty-space"),
    P(b"{\n}\n", 1, b'{"data_parallel_rank":1}', id="empty-newlines"),
    P(b'{"a":1}', 2, b'{"a":1,"data_parallel_rank":2}', id="one-member"),
    P(
        b'{"model": "m", "stream": true}',
        7,
        b'{"model": "m", "stream": true,"data_parallel_rank":7}',
        id="spaces-kept",
    ),
    P(
        b'{"z":1,"a":2,"m":3}',
        1,
        b'{"z":1,"a":2,"m":3,"data_parallel_rank":1}',
        id="key-order-kept",
    ),
    P(b'{"a":1}  \r\n\t', 4, b'{"a":1,"data_parallel_rank":4}', id="trailing-whitespace"),
    P(b'{"a":1  \n}', 4, b'{"a":1,"data_parallel_rank":4}', id="whitespace-before-brace"),
    P(
        b'{"a": {"b": {"c": []}}}',
        5,
        b'{"a": {"b": {"c": []}},"data_parallel_rank":5}',
        id="nested-objects",
    ),
    P(
        b'{\n  "messages": [\n    {"role": "user", "content": "}"}\n  ]\n}\n',
        6,
        b'{\n  "messages": [\n    {"role": "user", "content": "}"}\n  ],"data_parallel_rank":6}',
        id="pretty-printed-brace-in-string",
    ),
    P(b'{"s":"\\u00e9"}', 1023, b'{"s":"\\u00e9","data_parallel_rank":1023}', id="escapes-kept"),
    P(b'  {"a":1}', 0, b'  {"a":1,"data_parallel_rank":0}', id="leading-space-kept"),
]


@pytest.mark.parametrize(("body", "rank", "expected"), APPEND)
def test_rank_append_is_byte_exact(body: bytes, rank: int, expected: bytes) -> None:
    base = rank_base(body, has_rank=False)
    out = with_rank(base, rank)
    assert out == expected
    assert json.loads(out) == {**json.loads(body), "data_parallel_rank": rank}


def test_base_is_reused_for_every_attempt() -> None:
    body = b'{"model":"m","prompt":"x"}'
    base = rank_base(body, has_rank=False)
    outs = [with_rank(base, r) for r in (0, 1, 0, 5)]
    assert outs[0] == outs[2]
    assert [json.loads(o)["data_parallel_rank"] for o in outs] == [0, 1, 0, 5]
    for o in outs:
        assert o.startswith(b'{"model":"m","prompt":"x",')
    assert body == b'{"model":"m","prompt":"x"}'  # untouched


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        P(
            b'{"b":1,"data_parallel_rank":0,"a":2}',
            b'{"b":1,"a":2,"data_parallel_rank":9}',
            id="middle",
        ),
        P(b'{"data_parallel_rank":5}', b'{"data_parallel_rank":9}', id="only-member"),
        P(b'{"data_parallel_rank":null,"x":[1]}', b'{"x":[1],"data_parallel_rank":9}', id="null"),
        P(
            b'{"x":1,"data_parallel_rank":1,"data_parallel_rank":2}',
            b'{"x":1,"data_parallel_rank":9}',
            id="duplicated-by-client",
        ),
    ],
)
def test_client_rank_removed_once_then_appended(body: bytes, expected: bytes) -> None:
    out = with_rank(rank_base(body, has_rank=True), 9)
    assert out == expected
    assert out.count(b"data_parallel_rank") == 1


@pytest.mark.parametrize(
    "body",
    [
        P(b"[]", id="array"),
        P(b"[1, {}]", id="array-ending-in-object"),
        P(b'"x"', id="string"),
        P(b"1", id="number"),
        P(b"", id="empty"),
        P(b"   ", id="whitespace"),
        P(b"null", id="null"),
        P(b'{"a":1', id="truncated"),
    ],
)
def test_non_object_body_is_invalid_request(body: bytes) -> None:
    with pytest.raises(InvalidRequest) as ei:
        rank_base(body, has_rank=False)
    assert ei.value.status == 400


@pytest.mark.parametrize("body", [P(b"[]", id="array"), P(b"5", id="number")])
def test_non_object_body_with_client_rank_is_invalid_request(body: bytes) -> None:
    with pytest.raises(InvalidRequest):
        rank_base(body, has_rank=True)


def test_append_fields_several_members() -> None:
    assert append_fields(RankBase(b"{", True), b'"a":1,"b":2') == b'{"a":1,"b":2}'
    assert append_fields(RankBase(b'{"x":0', False), b'"a":1') == b'{"x":0,"a":1}'


# --------------------------------------------------------------------------------------
# property: the append never changes anything but the rank
# --------------------------------------------------------------------------------------

_KEYS = st.text(max_size=8).filter(lambda k: k != "data_parallel_rank")
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_KEYS, kids, max_size=4),
    max_leaves=20,
)
_OBJECTS = st.dictionaries(_KEYS, _VALUES, max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    obj=_OBJECTS,
    rank=st.integers(0, 4096),
    indent=st.sampled_from([None, 0, 2]),
    ascii_only=st.booleans(),
    trailing=st.sampled_from(["", " ", "\n", "\r\n\t "]),
)
def test_with_rank_equals_original_plus_rank(
    obj: dict[str, Any], rank: int, indent: int | None, ascii_only: bool, trailing: str
) -> None:
    body = (json.dumps(obj, indent=indent, ensure_ascii=ascii_only) + trailing).encode()
    out = with_rank(rank_base(body, has_rank=False), rank)
    assert json.loads(out) == {**obj, "data_parallel_rank": rank}
    assert list(json.loads(out)) == [*obj, "data_parallel_rank"]
    # the original bytes (up to the closing brace) are a prefix of the result
    head = body.rstrip()[:-1].rstrip()
    assert out.startswith(head)


@settings(max_examples=200, deadline=None)
@given(obj=_OBJECTS, client_rank=_VALUES, rank=st.integers(0, 64), where=st.integers(0, 8))
def test_with_client_rank_equals_original_plus_rank(
    obj: dict[str, Any], client_rank: Any, rank: int, where: int
) -> None:
    items = list(obj.items())
    items.insert(min(where, len(items)), ("data_parallel_rank", client_rank))
    body = json.dumps(dict(items)).encode()
    out = with_rank(rank_base(body, has_rank=True), rank)
    assert json.loads(out) == {**obj, "data_parallel_rank": rank}
    assert list(json.loads(out)) == [*obj, "data_parallel_rank"]
