"""
The mock worker's trivial tokenizer
===================================

A prompt "token" is a **whitespace-separated word** of the prompt text (``str.split()``),
or a token id when the request carries ids (``prompt: [1, 2, 3]``, SGLang
``input_ids``). The prompt text of a request is every text it carries, in prompt
order: Anthropic ``system`` then ``messages``; Responses ``instructions`` then
``input``; chat ``messages``; completions ``prompt``; SGLang ``text``. Content may be a
string or a list of parts; a part's ``text``, nested ``content`` and (tool) ``output``
strings count.

Token ids (``/tokenize``) are the CRC-32 of the word, so they are stable across
workers and processes; ``/detokenize`` maps back the words this worker has seen.

Generated text is ``"tok0 tok1 ... tok<n-1> "``: token *i* is the word ``tok<i>``
followed by a space.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any
from zlib import crc32

__all__ = [
    "Token",
    "Vocab",
    "count_words",
    "output_pieces",
    "output_text",
    "prompt_size",
    "prompt_tokens",
]

Token = str | int


def _collect(value: Any, out: list[Token]) -> None:
    if isinstance(value, str):
        out.extend(value.split())
    elif isinstance(value, list):
        for part in value:
            if isinstance(part, str):
                out.extend(part.split())
            elif isinstance(part, int) and not isinstance(part, bool):
                out.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    out.extend(text.split())
                content = part.get("content")
                if content is not None:
                    _collect(content, out)
                output = part.get("output")
                if isinstance(output, str):
                    out.extend(output.split())
            elif isinstance(part, list):
                _collect(part, out)


def prompt_tokens(*values: Any) -> list[Token]:
    """The prompt tokens of ``values`` (request fields, in prompt order)."""
    out: list[Token] = []
    for value in values:
        if value is not None:
            _collect(value, out)
    return out


#: Texts at least this long have their word count remembered: the exact count scans a
#: long prompt twice (~190 µs at 64 KiB, most of a mock worker's CPU per request), a
#: lookup hashes it once (~20 µs), and the benchmark's workers see the same prompts again.
CACHE_MIN_CHARS = 4096
#: Counts remembered (whole texts are the keys: at most this many prompts held).
CACHE_ENTRIES = 16
_counts: dict[str, int] = {}


def count_words(text: str) -> int:
    """``len(text.split())`` without building the list."""
    if len(text) < CACHE_MIN_CHARS:
        return _count_words(text)
    n = _counts.get(text)
    if n is None:
        n = _count_words(text)
        if len(_counts) >= CACHE_ENTRIES:
            _counts.clear()
        _counts[text] = n
    return n


def _count_words(text: str) -> int:
    # fast path: ASCII, single spaces
    if (
        text.isascii()
        and "  " not in text
        and "\n" not in text
        and "\t" not in text
        and "\r" not in text
        and "\x0b" not in text
        and "\x0c" not in text
        and "\x1c" not in text
        and "\x1d" not in text
        and "\x1e" not in text
        and "\x1f" not in text
    ):
        if not text:
            return 0
        n = text.count(" ") + 1
        if text[0] == " ":
            n -= 1
        if text[-1] == " ":
            n -= 1
        return n
    return len(text.split())


def _count(value: Any) -> int:
    if isinstance(value, str):
        return count_words(value)
    if not isinstance(value, list):
        return 0
    n = 0
    for part in value:
        if isinstance(part, str):
            n += count_words(part)
        elif isinstance(part, int) and not isinstance(part, bool):
            n += 1
        elif isinstance(part, dict):
            text = part.get("text")
            if isinstance(text, str):
                n += count_words(text)
            content = part.get("content")
            if content is not None:
                n += _count(content)
            output = part.get("output")
            if isinstance(output, str):
                n += count_words(output)
        elif isinstance(part, list):
            n += _count(part)
    return n


def prompt_size(*values: Any) -> int:
    """``len(prompt_tokens(*values))``, cheaper."""
    return sum(_count(v) for v in values if v is not None)


@lru_cache(maxsize=64)
def output_pieces(n: int) -> tuple[str, ...]:
    """The ``n`` generated tokens as text pieces (``"tok0 "``, ``"tok1 "``, ...)."""
    return tuple(f"tok{i} " for i in range(n))


@lru_cache(maxsize=64)
def output_text(n: int) -> str:
    """The text of ``n`` generated tokens."""
    return "".join(output_pieces(n))


class Vocab:
    """Word ↔ id mapping for ``/tokenize`` and ``/detokenize`` (bounded reverse map)."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self._words: dict[int, str] = {}
        self._capacity = capacity

    def encode(self, tokens: list[Token]) -> list[int]:
        ids: list[int] = []
        for tok in tokens:
            if isinstance(tok, int):
                ids.append(tok)
                continue
            tid = crc32(tok.encode("utf-8"))
            if len(self._words) < self._capacity:
                self._words.setdefault(tid, tok)
            ids.append(tid)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self._words.get(i, f"<{i}>") for i in ids)

    def clear(self) -> None:
        self._words.clear()
