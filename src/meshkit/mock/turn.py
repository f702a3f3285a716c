"""
One generation ("turn") as the API modules see it
=================================================

:class:`Turn` holds what every API renders: the model name, prompt/cached/output
token counts, whether the output was cut by the request's max tokens, and the
data-parallel rank the request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit.mock.tokens import output_pieces, output_text

__all__ = ["Event", "Turn", "max_tokens"]

#: A stream event: ``(is_token, bytes)``. Token events get the generation delays.
Event = tuple[bool, bytes]


@dataclass(slots=True)
class Turn:
    model: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    #: The request's max tokens cut the output short.
    truncated: bool
    rank: int | None
    fingerprint: str
    created: int
    #: Seconds it waits for KV room before it starts (the cache model's queue).
    queued_s: float = 0.0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def text(self) -> str:
        return output_text(self.output_tokens)

    @property
    def pieces(self) -> tuple[str, ...]:
        return output_pieces(self.output_tokens)


def max_tokens(obj: Any, *keys: str) -> int | None:
    """The first integer among ``obj[key]`` for ``keys`` (a request's max-tokens field)."""
    if not isinstance(obj, dict):
        return None
    for key in keys:
        value = obj.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
