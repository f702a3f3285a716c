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
* Running requests hold their blocks (``MockConfig.cache_holds_running``): as in
  vLLM, a block in use by a running request cannot be evicted, and the blocks a
  running request needs beyond its cached prompt blocks (the partial last block, the
  output) take room from the cache (vLLM's ``KVCacheManager`` allocates every block
  of a running sequence from the one pool its cached free blocks live in;
  ``vllm/v1/core/block_pool.py``: only blocks with no reference sit in the free
  queue, and a new allocation evicts the free queue's head). A hold ends after the
  request's simulated generation time (:meth:`PrefixCache.hold` takes it), and its
  blocks go back to the free end last block first, as vLLM frees them. When running
  requests need more blocks than the cache has, the mock holds them anyway (vLLM
  would keep the request waiting) and counts it in ``overfull``: past that point
  every block is evicted as soon as it is released, so the mock's hit rates there are
  far below an engine's.
* Outputs (``MockConfig.cache_outputs``): when a request ends, the full blocks of its
  prompt and output are stored, as vLLM caches the blocks it generates
  (``KVCacheManager.cache_blocks`` runs as decoding fills blocks); a conversation's
  next turn repeats the answer in its prompt and hits them.

KV events (``MockConfig.kv_events``): with an ``events`` sink set, each block also
carries an *engine hash* (:class:`~meshkit.mock.kv_publisher.EngineHasher`, seeded
per process like vLLM's), and every change is handed to the sink as one batch of
vLLM events: an :meth:`PrefixCache.insert` reports a ``BlockRemoved`` per evicted
block (in eviction order, least recently used first) **then** one ``BlockStored`` per
run of consecutive newly stored blocks (``parent_block_hash`` = the engine hash of
the block before the run, ``None`` for the prompt's first block); a block both stored
and evicted by the same insert is not reported. :meth:`PrefixCache.clear` reports
``AllBlocksCleared``.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from meshkit.mock.kv_publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHasher,
    KVCacheEvent,
    token_ids,
)
from meshkit.mock.tokens import Token

__all__ = ["EventSink", "PrefixCache"]

#: Receives one batch of events per cache change.
EventSink = Callable[[list[KVCacheEvent]], None]
#: Block keys and the tokens they were cut from, stored when a request ends.
_Store = tuple[Sequence[int], Sequence[Token]]
#: KV events name the device tier the blocks live on.
MEDIUM = "GPU"


class PrefixCache:
    """LRU of cumulative token-block hashes (each mapped to its engine hash when
    events are on, else to ``None``)."""

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int = 16,
        *,
        events: EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = max(capacity_tokens, 0) // block_size
        self._lru: OrderedDict[int, int | None] = OrderedDict()
        #: Block key -> running requests holding it (never evicted while held).
        self._held: dict[int, int] = {}
        #: Blocks running requests hold beyond their cached prompt blocks.
        self._extra = 0
        #: Running requests, soonest end first: ``(until, seq, block keys, extra
        #: blocks, what to store when it ends)``.
        self._holds: list[tuple[float, int, tuple[int, ...], int, _Store | None]] = []
        self._seq = 0
        self._clock = clock
        #: Inserts that found only held blocks to evict: running requests held more
        #: than the cache, where vLLM would keep requests waiting and the mock, which
        #: does not, evicts every block as soon as it is released.
        self.overfull = 0
        #: Where KV events go (``None`` = not tracked).
        self.events = events
        self.hasher = EngineHasher()

    def reseed(self) -> None:
        """Draw a new engine-hash seed (a restarted engine); clear first."""
        self.hasher = EngineHasher()

    @property
    def used_tokens(self) -> int:
        return len(self._lru) * self.block_size

    @property
    def held_blocks(self) -> int:
        """Blocks running requests hold (vLLM's ``kv_cache_usage_perc`` numerator)."""
        self._expire()
        return len(self._held) + self._extra

    def hold(
        self,
        hashes: Sequence[int],
        n_tokens: int,
        seconds: float,
        *,
        then: _Store | None = None,
    ) -> None:
        """A request of ``n_tokens`` (prompt and output) whose full prompt blocks are
        ``hashes`` runs for ``seconds``: its blocks stay in the cache until then.

        ``then`` (the block keys and tokens of prompt and output) is stored when the
        request ends: vLLM caches the full blocks of what it generated too, so the next
        turn of a conversation can hit the previous answer.

        Call before :meth:`insert`, so that the insert makes room for the request's
        other blocks and does not evict its own.
        """
        self._expire()
        held = self._held
        for h in hashes:
            held[h] = held.get(h, 0) + 1
        extra = max(-(-n_tokens // self.block_size) - len(hashes), 0)
        self._extra += extra
        self._seq += 1
        until = self._clock() + seconds
        heapq.heappush(self._holds, (until, self._seq, tuple(hashes), extra, then))

    def _expire(self) -> None:
        holds = self._holds
        if not holds:
            return
        now = self._clock()
        held, lru = self._held, self._lru
        while holds and holds[0][0] <= now:
            _, _, keys, extra, then = heapq.heappop(holds)
            self._extra -= extra
            for h in reversed(keys):
                count = held[h] - 1
                if count:
                    held[h] = count
                    continue
                del held[h]
                if h in lru:
                    lru.move_to_end(h)
            if then is not None:
                self._store(*then)

    def _make_room(self) -> list[tuple[int, int | None]]:
        """Evict least recently used blocks no running request holds until the cache
        fits (or only held blocks are left)."""
        lru, held = self._lru, self._held
        need = len(lru) + self._extra - self.capacity_blocks
        if need <= 0:
            return []
        if not held:
            return [lru.popitem(last=False) for _ in range(min(need, len(lru)))]
        victims: list[int] = []
        for key in lru:  # oldest first; a held block keeps its place until released
            if key not in held:
                victims.append(key)
                if len(victims) == need:
                    break
        if len(victims) < need:
            self.overfull += 1
        return [(key, lru.pop(key)) for key in victims]

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
        self._expire()  # a request that has ended has stored its answer
        usable = max(n_tokens - 1, 0) // self.block_size
        hits = 0
        lru = self._lru
        for h in hashes[:usable]:
            if h not in lru:
                break
            lru.move_to_end(h)
            hits += 1
        return hits * self.block_size

    def insert(self, hashes: Sequence[int], tokens: Sequence[Token] | None = None) -> None:
        """Insert (or refresh) ``hashes``, evicting least recently used blocks.

        With an event sink, ``tokens`` (the prompt the hashes were cut from) name the
        stored blocks' token ids.
        """
        if self.capacity_blocks == 0:
            return
        self._expire()
        self._store(hashes, tokens)

    def _store(self, hashes: Sequence[int], tokens: Sequence[Token] | None) -> None:
        sink = self.events
        if sink is not None and tokens is not None:
            self._insert_reporting(hashes, tokens, sink)
            return
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._make_room()

    def _insert_reporting(
        self, hashes: Sequence[int], tokens: Sequence[Token], sink: EventSink
    ) -> None:
        lru = self._lru
        bs = self.block_size
        n = len(hashes)
        # engine hashes, in chain order: a cached block keeps its own, a new one chains
        # from its parent's
        engine: list[int] = []
        ids: list[list[int] | None] = [None] * n
        present = [False] * n
        parent: int | None = None
        for i, key in enumerate(hashes):
            known = lru.get(key)
            if key in lru and known is not None:
                present[i] = True
                parent = known
            else:
                block = token_ids(tokens[i * bs : (i + 1) * bs])
                ids[i] = block
                parent = self.hasher(parent, block)
            engine.append(parent)
        evicted: list[tuple[int, int | None]] = []
        added: set[int] = set()
        for i in range(n - 1, -1, -1):
            key = hashes[i]
            if key in lru:
                if not present[i]:
                    lru[key] = engine[i]  # cached before events were on
                lru.move_to_end(key)
            else:
                lru[key] = engine[i]
                if not present[i]:
                    # (a cached block this insert pushed out and put back is not new:
                    # if pushed out again, its removal is reported)
                    added.add(key)
                evicted.extend(self._make_room())
        events: list[KVCacheEvent] = [
            BlockRemoved(block_hashes=[value], medium=MEDIUM)
            for key, value in evicted
            if value is not None and key not in added and key not in lru
        ]
        run: list[int] = []
        for i in range(n + 1):
            if i < n and not present[i] and hashes[i] in lru:
                run.append(i)
                continue
            if run:
                first = run[0]
                block_ids: list[int] = []
                for j in run:
                    block_ids.extend(ids[j] or ())
                events.append(
                    BlockStored(
                        block_hashes=[engine[j] for j in run],
                        parent_block_hash=engine[first - 1] if first > 0 else None,
                        token_ids=block_ids,
                        block_size=bs,
                        lora_id=None,
                        medium=MEDIUM,
                        lora_name=None,
                    )
                )
                run = []
        if events:
            sink(events)

    def clear(self) -> None:
        """Drop every block (reported as ``AllBlocksCleared`` when events are on)."""
        self._lru.clear()
        self._held.clear()
        self._holds.clear()
        self._extra = 0
        if self.events is not None:
            self.events([AllBlocksCleared()])

    def __len__(self) -> int:
        return len(self._lru)
