"""
Which worker holds which prompt prefix, from its KV events
==========================================================

An engine's own block hashes cannot be recomputed outside it (vLLM seeds them per
process), so the index keeps **its own block keys**: a block's key is a hash of its
parent's key and its token ids, chained from the root, the same in every process
that sees the same tokens (:func:`chain`). A ``BlockStored`` event says which
engine hash stands for which block; the index maps it to its key, so a later
``BlockRemoved`` (engine hashes only) finds what to drop. A request's token ids go
through the same chain, per block size, and :meth:`KvIndex.match` tells, for each
worker, how many leading tokens it holds.

Bounded: at most ``max_blocks`` (worker, block) entries in all, the least recently
stored going first (a match does not refresh: the engines' own evictions arrive as
``BlockRemoved``, so the bound only bites when it is smaller than their caches). A
``BlockStored`` whose parent the index does not know (evicted, or stored before
meshkit subscribed) cannot be chained and is skipped: it is counted
(:attr:`KvIndex.unchained`). A worker's block size is learnt from its events; a
change (a restarted engine with another configuration) clears what it held.

Pure: the subscriber feeds it decoded batches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from meshkit.core.kv_events import AllBlocksCleared, Batch, BlockHash, BlockRemoved, BlockStored

__all__ = ["ROOT", "KvIndex", "chain"]

#: the parent key of a prompt's first block
ROOT = 0
_NOBODY: frozenset[str] = frozenset()


def _key(parent: int, tokens: Sequence[int]) -> int:
    # CPython's tuple hash over ints is the same in every process (no hash seed: that
    # randomises str and bytes only) and every 64-bit CPython since 3.8, 8x cheaper
    # than a blake2b of the same ints; 61-bit keys make collisions negligible here.
    return hash((parent, *tokens))


def chain(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The keys of the full blocks of ``token_ids`` (a partial last block has none,
    as engines cache only full blocks)."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class KvIndex:
    """The blocks each worker holds (see the module docstring)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max(1, max_blocks)
        #: (worker id, key) → the engine's hash for it, least recently stored first
        self._entries: OrderedDict[tuple[str, int], BlockHash] = OrderedDict()
        #: per worker: engine hash → key, and the keys it holds
        self._by_hash: dict[str, dict[BlockHash, int]] = {}
        self._keys: dict[str, set[int]] = {}
        #: key → the workers holding it (one lookup per block when matching)
        self._holders: dict[int, set[str]] = {}
        self.block_sizes: dict[str, int] = {}
        #: stored blocks skipped: their parent was unknown
        self.unchained = 0
        #: entries dropped to stay within max_blocks
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def blocks_of(self, worker_id: str) -> int:
        return len(self._keys.get(worker_id, ()))

    # -- events ---------------------------------------------------------------------------

    def apply(self, worker_id: str, batch: Batch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(worker_id, event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._remove(worker_id, h)
            elif isinstance(event, AllBlocksCleared):
                self.clear(worker_id)

    def clear(self, worker_id: str) -> None:
        """Forget ``worker_id``'s blocks (cleared, a sequence gap, a restart, removal)."""
        for key in self._keys.pop(worker_id, set()):
            self._entries.pop((worker_id, key), None)
            self._unhold(key, worker_id)
        self._by_hash.pop(worker_id, None)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet."""
        self.clear(worker_id)
        self.block_sizes.pop(worker_id, None)

    def _stored(self, worker_id: str, event: BlockStored) -> None:
        size = event.block_size
        if self.block_sizes.get(worker_id, size) != size:
            self.clear(worker_id)
        self.block_sizes[worker_id] = size
        if len(event.token_ids) != size * len(event.block_hashes):
            self.unchained += len(event.block_hashes)
            return
        by_hash = self._by_hash.setdefault(worker_id, {})
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            known = by_hash.get(event.parent_block_hash)
            if known is None:
                self.unchained += len(event.block_hashes)
                return
            parent = known
        keys = self._keys.setdefault(worker_id, set())
        tokens = event.token_ids
        for i, h in enumerate(event.block_hashes):
            parent = _key(parent, tokens[i * size : (i + 1) * size])
            by_hash[h] = parent
            keys.add(parent)
            self._holders.setdefault(parent, set()).add(worker_id)
            entry = (worker_id, parent)
            self._entries[entry] = h
            self._entries.move_to_end(entry)
        while len(self._entries) > self.max_blocks:
            (wid, key), h = self._entries.popitem(last=False)
            self._keys.get(wid, set()).discard(key)
            self._by_hash.get(wid, {}).pop(h, None)
            self._unhold(key, wid)
            self.evicted += 1

    def _remove(self, worker_id: str, engine_hash: BlockHash) -> None:
        key = self._by_hash.get(worker_id, {}).pop(engine_hash, None)
        if key is not None:
            self._keys.get(worker_id, set()).discard(key)
            self._entries.pop((worker_id, key), None)
            self._unhold(key, worker_id)

    def _unhold(self, key: int, worker_id: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[key]

    # -- lookups --------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], worker_ids: Iterable[str]) -> dict[str, int]:
        """Per worker, how many leading tokens of ``token_ids`` it holds (0: none,
        or no events from it). Keys are computed block by block only while some
        worker still holds the prefix: a prompt that shares only its first blocks
        costs those blocks, not its length."""
        out: dict[str, int] = {}
        by_size: dict[int, set[str]] = {}
        for wid in worker_ids:
            out[wid] = 0
            size = self.block_sizes.get(wid)
            if size is not None and self._keys.get(wid):
                by_size.setdefault(size, set()).add(wid)
        holders = self._holders
        for size, alive in by_size.items():
            parent = ROOT
            for n, start in enumerate(range(0, len(token_ids) - size + 1, size), 1):
                parent = _key(parent, token_ids[start : start + size])
                alive = alive & holders.get(parent, _NOBODY)
                if not alive:
                    break
                for w in alive:
                    out[w] = n * size
        return out
