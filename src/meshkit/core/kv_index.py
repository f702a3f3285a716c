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
as ``BlockRemoved``). Then a worker's new block **replaces its newest entry**: a
leaf, since a block's ancestors are always stored before it, so every other chain
stays whole. Its oldest entries are the roots of its hottest prompts (stored once,
then only hit, and hits send no event); dropping them, as an LRU by store time
would, leaves every later block under them with no parent to chain to, and the
index drained to nothing while the engines still held all of it
(``benchmarks/MULTI_ROUTER_LONG.md``, "The index's bound"). A new block that hangs
from the newest entry cannot replace it and stays out, as do its descendants: the
engine holds them, and what it later stores under them cannot be chained.

The share makes what the index holds of a worker a function of that worker's own
events, so every router (every ``serve --processes`` child) holds the same blocks,
whatever order the workers' events reach it in. Kept blocks stay a prefix of what
each engine holds, which :meth:`KvIndex.match` relies on. Only when a worker has
needed room for ``max_blocks`` new blocks with no removal from its engine (a
publisher that does not report what it drops) does it drop its oldest entries
instead. It is counted per worker because engines that start empty together all
store past their shares before any is full enough to evict: counted over the
group, that looked like a silent publisher and dropped the hot roots (and one
silent publisher among reporting ones was never found). What is dropped or left
out is counted (:attr:`KvIndex.evicted`).

What a request can be matched on, and so what is indexed, is a block of a
prompt's tokens on the engine's GPU, in a group whose attention keeps the whole
prefix, chained from the root of the model the request names:

* **LoRA adapters**: vLLM hashes an adapter's blocks with its name, so the same
  tokens under an adapter and under the base model are different blocks. An
  adapter's chain starts from a root of its own (:func:`lora_root`); a request
  whose ``model`` is an adapter name the index has seen in events is keyed from
  it (:meth:`KvIndex.root`), any other from :data:`ROOT`.
* **Salted blocks** (multimodal inputs, a ``cache_salt``, prompt embeddings; see
  :mod:`meshkit.core.kv_events`) get keys no request's tokens produce: a prompt
  with image A is never matched on image B's placeholder tokens.
* **Other media** (``medium`` other than ``"GPU"``: an offloading connector's CPU
  tier) are not indexed: their stores and removals name the same engine hashes as
  the GPU's, and a CPU-tier removal must not drop a block the GPU holds.
* **Groups of partial attention** (``kv_cache_spec_kind`` sliding window, Mamba,
  chunked local...: hybrid models publish one group per kind) drop old blocks as
  a matter of course; their stores and removals are not indexed, and the group
  numbers they use are remembered so their removals (which carry no kind) are
  skipped too.

A ``BlockStored`` whose parent the index does not know (left out, or stored before
meshkit subscribed) cannot be chained and is skipped: it is counted
(:attr:`KvIndex.unchained`). A worker's block size is learnt from its events; a
change (a restarted engine with another configuration) clears what it held.

Layout, for memory and for the match loop: each worker has a bit; a key maps to
the bit mask of the workers holding it, so following a prompt's chain is one dict
lookup and one ``&`` per block. A worker's entries are one ordered dict from its
engine's hash (64 bits of it) to the key, in the order first stored, so its newest
and oldest entries are at hand.

Pure: the subscriber feeds it decoded batches, under the router's lock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from meshkit.core.kv_events import AllBlocksCleared, Batch, BlockHash, BlockRemoved, BlockStored

__all__ = ["ROOT", "KvIndex", "chain", "lora_root"]

#: the parent key of a prompt's first block
ROOT: Final = 0
_MASK64: Final = (1 << 64) - 1
#: a salted block's key: ``(parent, _SALT, *tokens)`` is one longer than any
#: unsalted block's tuple, so no request's tokens give it
_SALT: Final = -2
#: the media a request is matched on (None: an engine that does not say)
_MATCHED_MEDIA: Final = frozenset({None, "GPU"})
#: ``kv_cache_spec_kind`` values whose groups keep a prompt's whole prefix
#: (vLLM's ``KVCacheSpecKind``; "unknown" kept: better a match than none)
_WHOLE_PREFIX: Final = frozenset(
    {None, "full_attention", "mla_attention", "sink_full_attention", "unknown"}
)
#: partial-attention group numbers remembered per worker (engines have a handful)
_MAX_GROUPS: Final = 64


def _key(parent: int, tokens: Sequence[int]) -> int:
    # CPython's tuple hash over ints is the same in every process (no hash seed: that
    # randomises str and bytes only) and every 64-bit CPython since 3.8, 8x cheaper
    # than a blake2b of the same ints; 61-bit keys make collisions negligible here.
    return hash((parent, *tokens))


def lora_root(name: str) -> int:
    """The root an adapter's chains start from: the same in every process (a str's
    ``hash`` is seeded per process), never :data:`ROOT`."""
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=b"meshkit-lora").digest()
    return (int.from_bytes(digest, "big") >> 3) | 1


def chain(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The keys of the full blocks of ``token_ids`` (a partial last block has none,
    as engines cache only full blocks), from ``parent`` (:data:`ROOT`, or an
    adapter's :func:`lora_root`)."""
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
    __slots__ = ("bit", "block_size", "crowded", "entries", "group", "partial")

    def __init__(self, bit: int, group: str) -> None:
        self.bit = bit
        self.group = group
        #: the engine's groups of partial attention (their events are not indexed)
        self.partial: set[int] = set()
        self.block_size: int | None = None
        #: new blocks that found no room since its engine last reported a removal
        self.crowded = 0
        #: engine hash (64 bits) → key, in the order first stored: a block's
        #: ancestors are always older than it, so the newest entry is a leaf
        self.entries: OrderedDict[int, int] = OrderedDict()


class KvIndex:
    """The blocks each worker holds (see the module docstring).

    :param max_blocks: entries per group (model).
    :param max_loras: adapter names remembered (:meth:`root`); an adapter seen
        past it is not matched.
    """

    def __init__(self, max_blocks: int, max_loras: int = 4096, max_worker_sets: int = 256) -> None:
        self.max_blocks = max(1, max_blocks)
        self.max_loras = max(0, max_loras)
        #: candidate sets whose masks are remembered (``kv.max_worker_sets``; the
        #: memo is also cleared when a block size or a bit changes)
        self.max_worker_sets = max(1, max_worker_sets)
        #: the adapter names seen in events (replaced, not changed: read off the lock)
        self.lora_names: frozenset[str] = frozenset()
        self._workers: dict[str, _Worker] = {}
        #: workers per group (a worker's share of the budget is max_blocks / this)
        self._peers: dict[str, int] = {}
        self._by_bit: dict[int, str] = {}
        self._free_bits: list[int] = []
        #: per group: entries held by its workers
        self._sizes: dict[str, int] = {}
        #: key → bit mask of the workers holding it
        self._holders: dict[int, int] = {}
        #: per candidate set: bit masks by block size (the fleet's sets recur)
        self._masks: dict[tuple[str, ...], dict[int, int]] = {}
        #: stored blocks skipped: their parent was unknown, or the event was malformed
        self.unchained = 0
        #: blocks left out, or entries replaced, to stay within max_blocks
        self.evicted = 0

    def __len__(self) -> int:
        return sum(self._sizes.values())

    @property
    def block_sizes(self) -> dict[str, int]:
        return {w: s.block_size for w, s in self._workers.items() if s.block_size is not None}

    def would_store(self, worker_id: str, keys: Mapping[int, Sequence[int]] | None) -> bool:
        """Whether serving a prompt with these block ``keys`` (per block size) should
        make ``worker_id``'s engine publish: the prompt fills a block of the worker's
        size that the worker does not hold yet. A prompt it holds whole is a prefix
        hit and stores nothing (``kv_silence`` must not wait for it). Unknown counts
        as yes: keys not computed, or a block size not seen yet (then any size's
        block)."""
        if keys is None:
            return True
        w = self._workers.get(worker_id)
        if w is None or w.block_size is None:
            return any(keys.values())
        own = keys.get(w.block_size)
        if not own:
            return False
        # An engine that holds a prefix's last block holds the blocks before it.
        return not (self._holders.get(own[-1], 0) >> w.bit) & 1

    def root(self, model: str | None) -> int:
        """The root of ``model``'s chains: its adapter's, if events named it one."""
        return lora_root(model) if model is not None and model in self.lora_names else ROOT

    def sizes(self) -> frozenset[int]:
        """The block sizes in use (prepare computes a request's keys for each)."""
        return frozenset(s.block_size for s in self._workers.values() if s.block_size)

    def blocks_of(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return len(w.entries) if w is not None else 0

    def covers(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s events are in the index: it is subscribed (what it
        holds is known, if only to be nothing yet)."""
        return worker_id in self._workers

    def attach(self, worker_id: str, group: str = "") -> None:
        """A subscription to ``worker_id``'s events began: until it stores a block it
        is known to hold none (its matches are 0, not this router's guesses)."""
        self._worker(worker_id, group)

    def group_sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    # -- events ---------------------------------------------------------------------------

    def apply(self, worker_id: str, batch: Batch, group: str = "") -> None:
        w = self._worker(worker_id, group)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(w, event)
            elif isinstance(event, BlockRemoved):
                if event.medium not in _MATCHED_MEDIA or event.group_idx in w.partial:
                    continue
                # The publisher reports what it drops (held here or not): no fallback.
                w.crowded = 0
                entries = w.entries
                for h in event.block_hashes:
                    key = entries.pop(_h64(h), None)
                    if key is not None:
                        self._unhold(key, w)
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
            self._sizes.setdefault(group, 0)
        elif w.group != group:
            self._regroup(w, group)
        return w

    def _regroup(self, w: _Worker, group: str) -> None:
        """``w``'s models changed: learnt after its events began (the replay on
        joining came first), or an adapter loaded. Its engine holds what it held
        (another model is another engine process, whose publisher starts over), so
        its entries move to the new group's budget, its newest (leaves) dropped
        past it. Cleared, a router that joined before its first probe's model list
        lost all the engine's history."""
        held = len(w.entries)
        self._sizes[w.group] -= held
        self._leave(w.group)
        w.group = group
        self._peers[group] = self._peers.get(group, 0) + 1
        self._sizes[group] = self._sizes.get(group, 0) + held
        share = max(1, self.max_blocks // self._peers[group])
        entries = w.entries
        while entries and (len(entries) > share or self._sizes[group] > self.max_blocks):
            self._unhold(entries.popitem()[1], w)
            self.evicted += 1

    def _leave(self, group: str) -> None:
        left = self._peers[group] - 1
        if left:
            self._peers[group] = left
        else:
            del self._peers[group]

    def _clear(self, w: _Worker) -> None:
        if w.entries:
            holders, off = self._holders, ~(1 << w.bit)
            for key in w.entries.values():
                mask = holders.get(key, 0) & off
                if mask:
                    holders[key] = mask
                else:
                    holders.pop(key, None)
            self._sizes[w.group] -= len(w.entries)
            w.entries.clear()
            w.crowded = 0

    def _stored(self, w: _Worker, event: BlockStored) -> None:
        if event.medium not in _MATCHED_MEDIA:
            return
        if event.kind not in _WHOLE_PREFIX:
            if event.group_idx is not None and len(w.partial) < _MAX_GROUPS:
                w.partial.add(event.group_idx)
            return
        size = event.block_size
        if w.block_size != size:
            if w.block_size is not None:
                self._clear(w)
            w.block_size = size
            self._masks.clear()
        hashes = [_h64(h) for h in event.block_hashes]
        if len(event.token_ids) != size * len(hashes):
            self.unchained += len(hashes)
            return
        entries = w.entries
        held = None if event.parent_block_hash is None else _h64(event.parent_block_hash)
        if held is None:
            parent = ROOT if event.lora_name is None else self._lora(event.lora_name)
        else:
            known = entries.get(held)
            if known is None:
                self.unchained += len(hashes)
                return
            parent = known
        fresh = sum(1 for h in hashes if h not in entries)
        room = fresh and self._room(w, fresh, held, hashes)
        holders = self._holders
        bit = 1 << w.bit
        tokens = event.token_ids
        salted: frozenset[int] | tuple[()] = frozenset(event.salted) if event.salted else ()
        for i, h in enumerate(hashes):
            block = tokens[i * size : (i + 1) * size]
            parent = hash((parent, _SALT, *block)) if i in salted else _key(parent, block)
            old = entries.get(h)
            if old == parent:
                continue  # stored again: it keeps its place (its children are newer)
            if old is None:
                if not room:
                    # This block and the rest of the event (its descendants) stay out.
                    self.evicted += len(hashes) - i
                    return
                room -= 1
                self._sizes[w.group] += 1
            else:  # the engine named another block with this hash: a new leaf now
                self._unhold(entries.pop(h), w)
                self._sizes[w.group] += 1
            entries[h] = parent
            holders[parent] = holders.get(parent, 0) | bit

    def _lora(self, name: str) -> int:
        if name not in self.lora_names and len(self.lora_names) < self.max_loras:
            self.lora_names = self.lora_names | {name}
        return lora_root(name)

    def _room(self, w: _Worker, fresh: int, parent: int | None, own: list[int]) -> int:
        """How many of ``fresh`` new blocks ``w`` takes, making room for them.

        Within its share and the group's budget, all. Past them, each new block
        replaces ``w``'s newest entry, a leaf (the end of the turn stored last),
        unless that is the block the new ones hang from (or one this event names
        again, which its new blocks may hang from). A worker that has needed
        room for a whole budget of blocks with no removal from its engine has a
        publisher that does not report what it drops: there its oldest entries
        go, as the likeliest gone from the engine.
        """
        entries = w.entries
        share = max(1, self.max_blocks // self._peers[w.group])
        free = min(share - len(entries), self.max_blocks - self._sizes[w.group])
        if free >= fresh:
            return fresh
        taken = max(0, free)
        need = fresh - taken
        w.crowded += need
        oldest = w.crowded > self.max_blocks
        again = set(own)
        while need and entries:
            h = next(iter(entries)) if oldest else next(reversed(entries))
            if h == parent or h in again:
                break
            self._unhold(entries.pop(h), w)
            self.evicted += 1
            need -= 1
            taken += 1
        return taken

    def _unhold(self, key: int, w: _Worker) -> None:
        """``w`` no longer holds ``key`` (its entry is already gone)."""
        self._sizes[w.group] -= 1
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
        model: str | None = None,
    ) -> dict[str, int]:
        """Per worker, how many leading tokens of ``token_ids`` it holds (0: none,
        or no events from it).

        :param keys: the prompt's block keys per block size, when computed already
            (prepare does, off the lock); else they are computed block by block,
            only while some worker still holds the prefix.
        :param model: the request's model: the keys computed here start from its
            :meth:`root` (prepare's did).
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
            if len(self._masks) >= self.max_worker_sets:
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
            parent = self.root(model)
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
