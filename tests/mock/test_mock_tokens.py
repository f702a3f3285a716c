"""The mock worker's word count: exact against ``str.split``, with and without its cache."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.mock import tokens
from meshkit.mock.tokens import CACHE_ENTRIES, CACHE_MIN_CHARS, count_words

_pieces = st.lists(
    st.one_of(
        st.sampled_from([" ", "  ", "\n", "\t", "\x1c", "\u3000", "\xa0", "word", "é"]),
        st.text(max_size=8),
    ),
    max_size=40,
)


@given(_pieces)
@settings(max_examples=300)
def test_short_texts_count_like_split(parts: list[str]) -> None:
    text = "".join(parts)
    assert count_words(text) == len(text.split())


@given(_pieces, st.integers(min_value=0, max_value=3))
@settings(max_examples=100)
def test_long_texts_count_like_split_twice(parts: list[str], pad: int) -> None:
    # long enough for the cache: the second call is a hit and must agree
    text = "".join(parts) + " ab" * (CACHE_MIN_CHARS // 3 + 1 + pad)
    assert len(text) >= CACHE_MIN_CHARS
    want = len(text.split())
    assert count_words(text) == want
    assert count_words(text) == want


def test_cache_is_bounded() -> None:
    base = "x " * CACHE_MIN_CHARS
    for i in range(CACHE_ENTRIES * 3):
        assert count_words(base + f"tail{i}") == CACHE_MIN_CHARS + 1
        assert len(tokens._counts) <= CACHE_ENTRIES
