"""
Payload
=======

meshkit forwards the client's original bytes. The one edit it makes is the
data-parallel rank for DP-aware workers: the body *without* a
``data_parallel_rank`` is computed once per request (:func:`rank_base`), and each
attempt only appends the chosen rank (:func:`with_rank`), so a retry never
re-parses or re-serialises the body and key order and bytes are otherwise
unchanged. SGLang reads the body field, vLLM the ``X-data-parallel-rank`` header:
meshkit sends both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

from meshkit.errors import InvalidRequest

__all__ = ["RankBase", "append_fields", "rank_base", "with_rank"]

_WS: Final = b" \t\r\n"


@dataclass(frozen=True, slots=True)
class RankBase:
    """A JSON object's bytes cut before its closing brace."""

    head: bytes  # everything before the final "}" (trailing whitespace dropped)
    empty: bool  # the object has no members


def rank_base(body: bytes, *, has_rank: bool) -> RankBase:
    """Prepare ``body`` (a JSON object) for rank appends.

    :param has_rank: the client sent ``data_parallel_rank`` itself; then (rarely) the
        body is rebuilt once without it, keeping the other keys in their order.
    """
    if has_rank:
        try:
            obj = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:  # pragma: no cover - parsed before
            raise InvalidRequest("request body is not valid JSON") from exc
        if not isinstance(obj, dict):  # pragma: no cover - parsed before
            raise InvalidRequest("request body must be a JSON object")
        obj.pop("data_parallel_rank", None)
        body = msgspec.json.encode(obj)
    end = len(body.rstrip(_WS))
    if end == 0 or body[end - 1 : end] != b"}":
        raise InvalidRequest("request body must be a JSON object")
    head = body[: end - 1].rstrip(_WS)
    return RankBase(head, head.lstrip(_WS) == b"{")


def with_rank(base: RankBase, rank: int) -> bytes:
    """The body with ``"data_parallel_rank": rank`` appended as the last member."""
    return append_fields(base, b'"data_parallel_rank":' + str(rank).encode())


def append_fields(base: RankBase, members: bytes) -> bytes:
    """Append raw JSON members (``"k":v,...``) to the object in ``base``."""
    sep = b"" if base.empty else b","
    return base.head + sep + members + b"}"
