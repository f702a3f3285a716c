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
  request's simulated generation time (:meth:`PrefixCache.admit` takes it), and its
  blocks go back to the free end last block first, as vLLM frees them.
* Requests wait for room (:meth:`PrefixCache.admit`): a request whose blocks do not
  fit beside the running requests' starts when enough of them have ended, first come
  first served, as vLLM's scheduler keeps it in its waiting queue
  (``vllm/v1/core/sched/scheduler.py``: a waiting request whose slots cannot be
  allocated stops the pass). Its prompt blocks are stored and held from its start;
  its cache hit is counted when it arrives. The mock takes the output's blocks at
  the start too, where vLLM takes them as it decodes and preempts a running request
  when they run out: the mock waits a little earlier and never preempts. Only a
  request larger than the whole cache runs beside others anyway, counted in
  ``overfull``.
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
from dataclasses import dataclass

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

#: Timeline kinds: a running request ends before a waiting one starts.
_END, _START = 0, 1

#: Receives one batch of events per cache change.
EventSink = Callable[[list[KVCacheEvent]], None]
#: Block keys and the tokens they were cut from, stored when a request ends.
_Store = tuple[Sequence[int], Sequence[Token]]
#: KV events name the device tier the blocks live on.
MEDIUM = "GPU"


@dataclass(frozen=True, slots=True)
class _Request:
    """A request that holds blocks while it runs."""

    keys: tuple[int, ...]
    #: Its prompt's tokens, stored when it starts.
    tokens: Sequence[Token]
    #: Blocks it takes beyond its full prompt blocks (the partial one, the output).
    extra: int
    #: How long it runs once started.
    seconds: float
    then: _Store | None
    #: the LoRA adapter it runs under (its blocks are the adapter's own)
    lora: str | None = None


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
        #: What happens next, soonest first: ``(when, kind, seq, request)``; kind
        #: ``_END`` (a running request ends) sorts before ``_START`` (a waiting one
        #: starts) at the same instant, so a start finds the room it waited for.
        self._timeline: list[tuple[float, int, int, _Request]] = []
        #: Requests admitted but not started (vLLM's waiting queue).
        self._waiting = 0
        #: Requests that have waited for room.
        self.queued = 0
        #: The latest start given to a waiting request: later ones start no sooner.
        self._tail = 0.0
        self._seq = 0
        self._clock = clock
        #: Requests larger than the whole cache, run beside others anyway (an engine
        #: would refuse them): every block is evicted as soon as it is released.
        self.overfull = 0
        #: Where KV events go (``None`` = not tracked).
        self.events = events
        self.hasher = EngineHasher()
        self._lora_ids: dict[str, int] = {}

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

    @property
    def waiting(self) -> int:
        """Requests waiting for room (vLLM's ``num_requests_waiting``)."""
        self._expire()
        return self._waiting

    def admit(
        self,
        hashes: Sequence[int],
        tokens: Sequence[Token],
        n_tokens: int,
        seconds: float,
        *,
        then: _Store | None = None,
        lora: str | None = None,
    ) -> float:
        """A request of ``n_tokens`` (prompt and output) whose full prompt blocks are
        ``hashes`` (cut from ``tokens``) runs for ``seconds`` once its blocks fit beside
        the running requests' and every request waiting before it has started. From its
        start until its end its blocks are stored and held (never evicted). Returns the
        seconds it waits (0.0 when it starts now).

        ``then`` (the block keys and tokens of prompt and output) is stored when the
        request ends: vLLM caches the full blocks of what it generated too, so the next
        turn of a conversation can hit the previous answer.
        """
        now = self._clock()
        self._expire(now)  # (the same instant: the walk below must see nothing past due)
        extra = max(-(-n_tokens // self.block_size) - len(hashes), 0)
        request = _Request(tuple(hashes), tokens, extra, seconds, then, lora)
        start = self._start_time(request, now)
        if start <= now:
            self._begin(request, now)
            self._store(request.keys, tokens, lora)
            return 0.0
        self._tail = start
        self._waiting += 1
        self.queued += 1
        self._seq += 1
        heapq.heappush(self._timeline, (start, _START, self._seq, request))
        return start - now

    def _start_time(self, request: _Request, now: float) -> float:
        """When ``request`` fits: walk the timeline, as the counts would change, until
        the blocks it needs are free."""
        held, cap = self._held, self.capacity_blocks
        mine = set(request.keys)
        need = request.extra + sum(1 for h in mine if h not in held)
        used = len(held) + self._extra
        at = max(now, self._tail)
        if used + need <= cap and not self._waiting:
            return now
        counts: dict[int, int] = {}
        timeline = list(self._timeline)
        heapq.heapify(timeline)
        while timeline:
            when, kind, seq, other = timeline[0]
            if when > at:
                if used + need <= cap:
                    return at
                at = when
            heapq.heappop(timeline)
            step = 1 if kind == _START else -1
            for h in set(other.keys):
                before = counts.get(h, held.get(h, 0))
                counts[h] = before + step
                if before == 0 or before + step == 0:  # a block taken or given back
                    used += step
                    if h in mine:  # (what others hold, it need not take)
                        need -= step
            used += step * other.extra
            if kind == _START:
                heapq.heappush(timeline, (when + other.seconds, _END, seq, other))
        return at  # larger than the cache: runs once the rest has ended

    def _begin(self, request: _Request, now: float) -> None:
        held = self._held
        for h in request.keys:
            held[h] = held.get(h, 0) + 1
        self._extra += request.extra
        if len(held) + self._extra > self.capacity_blocks:
            self.overfull += 1  # nothing left to evict for it
        self._seq += 1
        heapq.heappush(self._timeline, (now + request.seconds, _END, self._seq, request))

    def _expire(self, now: float | None = None) -> None:
        timeline = self._timeline
        if not timeline:
            return
        if now is None:
            now = self._clock()
        held, lru = self._held, self._lru
        while timeline and timeline[0][0] <= now:
            when, kind, _, request = heapq.heappop(timeline)
            if kind == _START:
                self._waiting -= 1
                self._begin(request, when)
                self._store(request.keys, request.tokens, request.lora)
                continue
            self._extra -= request.extra
            for h in reversed(request.keys):
                count = held[h] - 1
                if count:
                    held[h] = count
                    continue
                del held[h]
                if h in lru:
                    lru.move_to_end(h)
            if request.then is not None:
                self._store(*request.then, request.lora)

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
        return [(key, lru.pop(key)) for key in victims]

    def block_hashes(self, tokens: Sequence[Token], lora: str | None = None) -> list[int]:
        """Cumulative hashes of the full blocks of ``tokens`` (under LoRA adapter
        ``lora``: other blocks than the base model's, as in vLLM)."""
        bs = self.block_size
        hashes: list[int] = []
        parent = 0 if lora is None else hash(("lora", lora))
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

    def insert(
        self,
        hashes: Sequence[int],
        tokens: Sequence[Token] | None = None,
        lora: str | None = None,
    ) -> None:
        """Insert (or refresh) ``hashes``, evicting least recently used blocks.

        With an event sink, ``tokens`` (the prompt the hashes were cut from) name the
        stored blocks' token ids.
        """
        if self.capacity_blocks == 0:
            return
        self._expire()
        self._store(hashes, tokens, lora)

    def _store(
        self, hashes: Sequence[int], tokens: Sequence[Token] | None, lora: str | None = None
    ) -> None:
        sink = self.events
        if sink is not None and tokens is not None:
            self._insert_reporting(hashes, tokens, sink, lora)
            return
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._make_room()

    def _insert_reporting(
        self, hashes: Sequence[int], tokens: Sequence[Token], sink: EventSink, lora: str | None
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
                parent = self.hasher(parent, block, lora)
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
                        lora_id=None if lora is None else self._lora_id(lora),
                        medium=MEDIUM,
                        lora_name=lora,
                        # vLLM: each block's extra keys, the adapter's name first
                        extra_keys=None if lora is None else [[lora]] * len(run),
                    )
                )
                run = []
        if events:
            sink(events)

    def _lora_id(self, name: str) -> int:
        """vLLM numbers adapters from 1 as it loads them."""
        return self._lora_ids.setdefault(name, len(self._lora_ids) + 1)

    def clear(self) -> None:
        """Drop every block (reported as ``AllBlocksCleared`` when events are on)."""
        self._lru.clear()
        self._held.clear()
        self._timeline.clear()
        self._waiting = 0
        self._tail = 0.0
        self._extra = 0
        if self.events is not None:
            self.events([AllBlocksCleared()])

    def __len__(self) -> int:
        return len(self._lru)
