"""What several policies read from one request: a prefill/decode fleet's policies
together."""

from __future__ import annotations

from meshkit.core.policies import CacheAware, PrefixHash
from meshkit.core.policies.base import Needs, merged
from meshkit.core.policies.simple import PowerOfTwo, RoundRobin


def test_a_policy_that_reads_nothing_adds_nothing() -> None:
    ca = CacheAware(match_chars=4096).needs
    assert merged(RoundRobin().needs, ca, PowerOfTwo().needs) == ca


def test_the_farthest_reader_sets_how_far_the_text_is_read() -> None:
    ph = PrefixHash(prefix_token_count=64, prefix_chars=100, conversation_chars=200).needs
    got = merged(ph, CacheAware(match_chars=4096).needs)
    assert got == Needs(text=True, prefix_tokens=64, prefix_chars=4096, kv_events=True)
    # one that reads the whole text: the whole text
    assert merged(ph, CacheAware().needs).prefix_chars is None
    assert merged(Needs(prefix_tokens=8), Needs(prefix_tokens=32)).prefix_tokens == 32
