"""``meshkit.core.unbound.count_upto``: a one-byte count, capped, by ``replace``."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshkit.core.unbound import count_upto


@given(
    st.binary(max_size=300) | st.text(alphabet="[{\r\n a", max_size=300).map(str.encode),
    st.sampled_from([b"[", b"{", b"\r", b"\n", b"a"]),
    st.integers(min_value=0, max_value=320),
)
def test_count_upto_is_the_count_capped_at_the_limit(data: bytes, byte: bytes, limit: int) -> None:
    assert count_upto(data, byte, limit) == min(data.count(byte), limit)
