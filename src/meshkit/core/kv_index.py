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

Bounded per *group* (the model a worker serves: a hot model must not push a cold
one's blocks out): at most ``max_blocks`` (worker, block) entries each, and each
worker at most its share, ``max_blocks`` over the workers of its group. The bound
bites only when it is smaller than the engines' caches (their own evictions arrive
as ``BlockRemoved``), and then a worker at its share **takes no new blocks** until
its engine's removals make room: what the index holds stays. Dropping the least
recently stored instead would drop the roots of the hottest prompts first (stored
once, then only hit, and hits send no event): every later block under them would
have no parent to chain to, and the index would drain to nothing while the engines
still hold all of it (``benchmarks/MULTI_ROUTER_LONG.md``, "The index's bound").
The share makes what the index holds of a worker a function of that worker's own
events, so every router (every ``serve --processes`` child) holds the same blocks
whatever order the workers' events reach it in; a budget shared first-come would
differ from router to router. Kept blocks stay a prefix of what each engine holds,
which :meth:`KvIndex.match` relies on. A block left out still leaves a hole (the
engine holds it, and its later children cannot be chained) until the engine drops
and stores it again: a budget under the fleet's caches costs hit rate either way,
only less this way. Only when a group has turned away ``max_blocks`` blocks with no
removal since (a publisher that does not report what it drops) does it drop its
least recently stored to take new ones. Both are counted (:attr:`KvIndex.evicted`).

A ``BlockStored`` whose parent the index does not know (left out, or stored before
meshkit subscribed) cannot be chained and is skipped: it is counted
(:attr:`KvIndex.unchained`). A worker's block size is learnt from its events; a
change (a restarted engine with another configuration) clears what it held.

Layout, for memory and for the match loop: each worker has a bit; a key maps to
the bit mask of the workers holding it, so following a prompt's chain is one dict
lookup and one ``&`` per block. A group's entries are one ordered dict from
``(bit, engine hash)`` packed in one int to the key. Clearing one worker walks its
group's entries (rare: a gap without replay, ``AllBlocksCleared``, removal).

Pure: the subscriber feeds it decoded batches, under the router's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from meshkit.core.kv_events import AllBlocksCleared, Batch, BlockHash, BlockRemoved, BlockStored

__all__ = ["ROOT", "KvIndex", "chain"]

#: the parent key of a prompt's first block
ROOT = 0
_MASK64 = (1 << 64) - 1
#: candidate sets whose masks are remembered (cleared when a block size or a bit changes)
_MAX_MASKS = 256


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


def _h64(h: BlockHash) -> int:
    # vLLM sends 64-bit ints (signed or not) or bytes digests; 64 bits of a digest
    # name a block as well as all of it, and fit the packed entry key.
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & _MASK64


class _Worker:
    __slots__ = ("bit", "block_size", "count", "group", "shift")

    def __init__(self, bit: int, group: str) -> None:
        self.bit = bit
        self.shift = (bit + 1) << 64  # the packed entry key's high part
        self.group = group
        self.count = 0
        self.block_size: int | None = None


class KvIndex:
    """The blocks each worker holds (see the module docstring).

    :param max_blocks: entries per group (model).
    """

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max(1, max_blocks)
        self._workers: dict[str, _Worker] = {}
        #: workers per group (a worker's share of the budget is max_blocks / this)
        self._peers: dict[str, int] = {}
        self._by_bit: dict[int, str] = {}
        self._free_bits: list[int] = []
        #: per group: packed (bit, engine hash) → key, least recently stored first
        self._entries: dict[str, OrderedDict[int, int]] = {}
        #: key → bit mask of the workers holding it
        self._holders: dict[int, int] = {}
        #: per candidate set: bit masks by block size (the fleet's sets recur)
        self._masks: dict[tuple[str, ...], dict[int, int]] = {}
        #: per group: blocks turned away at the bound since its last removal
        self._turned_away: dict[str, int] = {}
        #: stored blocks skipped: their parent was unknown, or the event was malformed
        self.unchained = 0
        #: blocks left out, or entries dropped, to stay within max_blocks
        self.evicted = 0

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())

    @property
    def block_sizes(self) -> dict[str, int]:
        return {w: s.block_size for w, s in self._workers.items() if s.block_size is not None}

    def sizes(self) -> frozenset[int]:
        """The block sizes in use (prepare computes a request's keys for each)."""
        return frozenset(s.block_size for s in self._workers.values() if s.block_size)

    def blocks_of(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.count if w is not None else 0

    def covers(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s events are in the index: it is subscribed (what it
        holds is known, if only to be nothing yet)."""
        return worker_id in self._workers

    def attach(self, worker_id: str, group: str = "") -> None:
        """A subscription to ``worker_id``'s events began: until it stores a block it
        is known to hold none (its matches are 0, not this router's guesses)."""
        self._worker(worker_id, group)

    def group_sizes(self) -> dict[str, int]:
        return {g: len(e) for g, e in self._entries.items()}

    # -- events ---------------------------------------------------------------------------

    def apply(self, worker_id: str, batch: Batch, group: str = "") -> None:
        w = self._worker(worker_id, group)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(w, event)
            elif isinstance(event, BlockRemoved):
                entries = self._entries.get(w.group)
                if entries is not None:
                    for h in event.block_hashes:
                        key = entries.pop(w.shift | _h64(h), None)
                        if key is not None:
                            self._unhold(key, w)
                            self._turned_away[w.group] = 0
            elif isinstance(event, AllBlocksCleared):
                self._clear(w)

    def clear(self, worker_id: str) -> None:
        """Forget ``worker_id``'s blocks (cleared, a sequence gap, a restart)."""
        w = self._workers.get(worker_id)
        if w is not None:
            self._clear(w)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet (its bit is free again)."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._clear(w)
            self._leave(w.group)
            del self._by_bit[w.bit]
            self._free_bits.append(w.bit)
            self._masks.clear()

    def _worker(self, worker_id: str, group: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._by_bit)
            w = self._workers[worker_id] = _Worker(bit, group)
            self._by_bit[bit] = worker_id
            self._masks.clear()
            self._peers[group] = self._peers.get(group, 0) + 1
        elif w.group != group:
            self._clear(w)
            self._leave(w.group)
            w.group = group
            self._peers[group] = self._peers.get(group, 0) + 1
        return w

    def _leave(self, group: str) -> None:
        left = self._peers[group] - 1
        if left:
            self._peers[group] = left
        else:
            del self._peers[group]

    def _clear(self, w: _Worker) -> None:
        entries = self._entries.get(w.group)
        if entries and w.count:
            lo, hi = w.shift, w.shift + (1 << 64)
            mine = [k for k in entries if lo <= k < hi]
            for packed in mine:
                self._unhold(entries.pop(packed), w)
            self._turned_away[w.group] = 0
        w.count = 0

    def _stored(self, w: _Worker, event: BlockStored) -> None:
        size = event.block_size
        if w.block_size != size:
            if w.block_size is not None:
                self._clear(w)
            w.block_size = size
            self._masks.clear()
        if len(event.token_ids) != size * len(event.block_hashes):
            self.unchained += len(event.block_hashes)
            return
        entries = self._entries.get(w.group)
        if entries is None:
            entries = self._entries[w.group] = OrderedDict()
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            known = entries.get(w.shift | _h64(event.parent_block_hash))
            if known is None:
                self.unchained += len(event.block_hashes)
                return
            parent = known
        holders = self._holders
        bit = 1 << w.bit
        tokens = event.token_ids
        share = max(1, self.max_blocks // self._peers[w.group])
        for i, h in enumerate(event.block_hashes):
            parent = _key(parent, tokens[i * size : (i + 1) * size])
            packed = w.shift | _h64(h)
            old = entries.pop(packed, None)
            if (
                old is None
                and (w.count >= share or len(entries) >= self.max_blocks)
                and not self._room(w.group, entries)
            ):
                # This block and the rest of the event (its descendants) stay out.
                left = len(event.block_hashes) - i
                self._turned_away[w.group] = self._turned_away.get(w.group, 0) + left
                self.evicted += left
                return
            if old is None:
                w.count += 1
            elif old != parent:
                self._unhold(old, w)
                w.count += 1
            entries[packed] = parent
            holders[parent] = holders.get(parent, 0) | bit

    def _room(self, group: str, entries: OrderedDict[int, int]) -> bool:
        """Whether a block over the bound (its worker's share, or the group's budget
        while a joining worker shrinks the shares) gets in: only once the group has
        turned away a whole budget of blocks with no removal since (a publisher that
        does not report what it drops), and then in place of the least recently
        stored."""
        if self._turned_away.get(group, 0) < self.max_blocks:
            return False
        if entries:
            packed, key = entries.popitem(last=False)
            self._unhold(key, self._workers[self._by_bit[(packed >> 64) - 1]])
            self.evicted += 1
        return True

    def _unhold(self, key: int, w: _Worker) -> None:
        w.count -= 1
        mask = self._holders.get(key, 0) & ~(1 << w.bit)
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    # -- lookups --------------------------------------------------------------------------

    def match(
        self,
        token_ids: Sequence[int],
        worker_ids: Iterable[str],
        keys: Mapping[int, Sequence[int]] | None = None,
    ) -> dict[str, int]:
        """Per worker, how many leading tokens of ``token_ids`` it holds (0: none,
        or no events from it).

        :param keys: the prompt's block keys per block size, when computed already
            (prepare does, off the lock); else they are computed block by block,
            only while some worker still holds the prefix.
        """
        ids = tuple(worker_ids)
        out = dict.fromkeys(ids, 0)
        by_size = self._masks.get(ids)
        if by_size is None:
            by_size = {}
            for wid in ids:
                w = self._workers.get(wid)
                if w is not None and w.block_size is not None:
                    by_size[w.block_size] = by_size.get(w.block_size, 0) | (1 << w.bit)
            if len(self._masks) >= _MAX_MASKS:
                self._masks.clear()
            self._masks[ids] = by_size
        holders = self._holders
        for size, alive in by_size.items():
            known = keys.get(size) if keys is not None else None
            if known is not None:
                # Most workers share no block at all: one lookup tells them apart.
                alive &= holders.get(known[0], 0) if known else 0
                if alive:
                    self._search(out, known, alive, 1, len(known), size)
                continue
            parent = ROOT
            n = 0
            for n, start in enumerate(range(0, len(token_ids) - size + 1, size), 1):
                parent = _key(parent, token_ids[start : start + size])
                left = alive & holders.get(parent, 0)
                if left != alive:
                    self._credit(out, alive & ~left, (n - 1) * size)
                    alive = left
                    if not alive:
                        break
            if alive:
                self._credit(out, alive, n * size)
        return out

    def _search(
        self, out: dict[str, int], keys: Sequence[int], mask: int, lo: int, hi: int, size: int
    ) -> None:
        """Credit each worker of ``mask`` with its held prefix of ``keys``, known to be
        ``lo`` to ``hi`` blocks long, by bisection: an engine holding block *k* holds
        the blocks before it (it caches prefixes and evicts their ends first), so a
        long cached prompt costs a few lookups per distinct depth, not one per block."""
        holders = self._holders
        while mask:
            if lo == hi:
                if lo:
                    self._credit(out, mask, lo * size)
                return
            mid = (lo + hi + 1) // 2
            deeper = mask & holders.get(keys[mid - 1], 0)
            if deeper and deeper != mask:
                self._search(out, keys, deeper, mid, hi, size)
                mask &= ~deeper
                hi = mid - 1
            elif deeper:
                lo = mid
            else:
                hi = mid - 1

    def _credit(self, out: dict[str, int], mask: int, tokens: int) -> None:
        by_bit = self._by_bit
        while mask:
            low = mask & -mask
            out[by_bit[low.bit_length() - 1]] = tokens
            mask ^= low
