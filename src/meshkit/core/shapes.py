"""
Wire shapes
===========

The msgspec types meshkit decodes JSON with: request bodies
(:mod:`meshkit.core.requests`) and response events (:mod:`meshkit.core.streams`).
They live apart from the code that reads them because a compiled build
(``hatch_build.py``) compiles those modules with mypyc, which does not build msgspec
``Struct`` classes: defined in a compiled module, a Struct loses the field types
msgspec reads.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "Answer",
    "AnyBody",
    "ChatBody",
    "CompletionBody",
    "GenerateBody",
    "Indexed",
    "Json",
    "Lifecycle",
    "LifecycleResponse",
    "MessagesBody",
    "ResponsesBody",
    "StateAnswer",
]

Json = Any

# -- request bodies: only what routing reads; unknown fields are skipped --------


class ChatBody(msgspec.Struct):
    model: str | None = None
    messages: list[Json] = []
    tools: list[Json] | None = None
    stream: bool | None = None
    stream_options: dict[str, Json] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    data_parallel_rank: Json = msgspec.UNSET


class CompletionBody(msgspec.Struct):
    model: str | None = None
    prompt: str | list[Json] | None = None
    stream: bool | None = None
    stream_options: dict[str, Json] | None = None
    user: str | None = None
    data_parallel_rank: Json = msgspec.UNSET


class MessagesBody(msgspec.Struct):
    model: str | None = None
    system: str | list[Json] | None = None
    tools: list[Json] | None = None
    messages: list[Json] = []
    stream: bool | None = None
    metadata: dict[str, Json] | None = None
    data_parallel_rank: Json = msgspec.UNSET


class ResponsesBody(msgspec.Struct):
    model: str | None = None
    instructions: str | None = None
    tools: list[Json] | None = None
    input: str | list[Json] | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Json] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    data_parallel_rank: Json = msgspec.UNSET


class GenerateBody(msgspec.Struct):
    model: str | None = None
    text: str | list[str] | None = None
    input_ids: list[Json] | None = None
    stream: bool | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    data_parallel_rank: Json = msgspec.UNSET


class AnyBody(msgspec.Struct):
    model: str | None = None
    data_parallel_rank: Json = msgspec.UNSET


# -- response events ------------------------------------------------------------


class LifecycleResponse(msgspec.Struct):
    """The ``response`` of a Responses lifecycle event: only what the books read."""

    id: Any = None
    usage: Any = None
    error: Any = None
    #: ``true``: generated in the background (its usage is counted once, not per read)
    background: Any = None


class Lifecycle(msgspec.Struct):
    """A Responses lifecycle event (``response.created``, ``response.completed``...)."""

    response: LifecycleResponse | None = None


#: a key the answer does not have (a ``Raw`` of no bytes)
NO_RAW = msgspec.Raw(b"")


class Answer(msgspec.Struct):
    """A whole (non-streamed) JSON answer, as far as the books read it: decoding
    only these skips building the rest (the choices, their messages, a pooling
    answer's vectors).

    The keys that carry output (every format's, as ``streams._body_has_output``
    reads them) are kept as raw bytes, never decoded: only whether they are there
    and empty is read.
    """

    usage: Any = None
    meta_info: Any = None
    error: Any = None
    object: Any = None
    id: Any = None
    choices: msgspec.Raw = NO_RAW
    output: msgspec.Raw = NO_RAW
    content: msgspec.Raw = NO_RAW
    output_ids: msgspec.Raw = NO_RAW
    text: msgspec.Raw = NO_RAW


class StateAnswer(Answer):
    """A whole answer that is a stored Response (a create's, or a read of one):
    also whether it was generated in the background, and its status."""

    status: Any = None
    background: Any = None


class Indexed(msgspec.Struct):
    """A streamed chat chunk's choice ``index``, and nothing else."""

    index: Any = 0
