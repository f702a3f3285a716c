"""
Prefix-cache model
==================

An LRU over token-block prefixes, like vLLM's automatic prefix caching: the prompt
is cut into full blocks of ``block_size`` tokens; block *k*'s hash covers its tokens
and the hash of block *k-1*, so a block hit implies the whole prefix before it is
cached. The trailing partial block is never cached.

* ``cached_tokens`` = tokens of the longest run of cached leading blocks, capped
  so that at least one prompt token is always computed (as vLLM does).
* After a request, its blocks are inserted **last block first**, so that under
  pressure the deepest blocks are evicted before the shared prefix.
* Capacity is in tokens (``capacity_tokens // block_size`` blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from meshkit.mock.tokens import Token

__all__ = ["PrefixCache"]


class PrefixCache:
    """LRU of cumulative token-block hashes."""

    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = max(capacity_tokens, 0) // block_size
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def used_tokens(self) -> int:
        return len(self._lru) * self.block_size

    def block_hashes(self, tokens: Sequence[Token]) -> list[int]:
        """Cumulative hashes of the full blocks of ``tokens``."""
        bs = self.block_size
        hashes: list[int] = []
        parent = 0
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = hash((parent, tuple(tokens[start : start + bs])))
            hashes.append(parent)
        return hashes

    def lookup(self, hashes: Sequence[int], n_tokens: int) -> int:
        """Cached tokens for a prompt of ``n_tokens`` with block ``hashes``; touches hits."""
        usable = max(n_tokens - 1, 0) // self.block_size
        hits = 0
        lru = self._lru
        for h in hashes[:usable]:
            if h not in lru:
                break
            lru.move_to_end(h)
            hits += 1
        return hits * self.block_size

    def insert(self, hashes: Sequence[int]) -> None:
        """Insert (or refresh) ``hashes``, evicting least recently used blocks."""
        if self.capacity_blocks == 0:
            return
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > self.capacity_blocks:
                    lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)
