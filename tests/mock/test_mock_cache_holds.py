"""Running requests hold their KV blocks (``MockConfig.cache_holds_running``), as in vLLM."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import cast

import httpx2
import pytest

from meshkit.demo import TOKENIZER
from meshkit.mock import MockConfig, MockWorkerThread
from meshkit.mock.cache import PrefixCache
from meshkit.mock.kv_publisher import BlockStored, KVCacheEvent
from meshkit.mock.tokens import prompt_tokens
from meshkit.testing.fleet import samples


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def words(tag: str, n: int) -> list[str]:
    return prompt_tokens(" ".join(f"{tag}{i}" for i in range(n)))  # type: ignore[return-value]


def test_held_blocks_outlive_newer_ones() -> None:
    clock = Clock()
    cache = PrefixCache(capacity_tokens=64, block_size=16, clock=clock)  # 4 blocks
    a = cache.block_hashes(words("a", 33))
    cache.admit(a, words("a", 33), 33, 10.0)  # 2 full blocks + the partial one: 3 held
    assert cache.held_blocks == 3
    for tag in ("b", "c"):
        cache.insert(cache.block_hashes(words(tag, 32)))
    # without the hold, a's blocks were the least recently used
    assert cache.lookup(a, 33) == 32
    assert len(cache) == 3  # a's 2 blocks and one of c's: the partial block takes room
    assert cache.overfull == 0
    clock.now = 10.0
    assert cache.held_blocks == 0
    cache.insert(cache.block_hashes(words("d", 64)))
    assert cache.lookup(a, 33) == 0  # released, then evicted like any cached block


def test_without_holds_the_same_sequence_evicts() -> None:
    cache = PrefixCache(capacity_tokens=64, block_size=16)
    a = cache.block_hashes(words("a", 33))
    cache.insert(a)
    for tag in ("b", "c"):
        cache.insert(cache.block_hashes(words(tag, 32)))
    assert cache.lookup(a, 33) == 0


def test_output_blocks_take_room_and_release_frees_last_block_first() -> None:
    clock = Clock()
    cache = PrefixCache(capacity_tokens=64, block_size=16, clock=clock)
    x = cache.block_hashes(words("x", 32))
    cache.admit(x, words("x", 32), 32 + 48, 5.0)  # 2 prompt + 3 output: more than the cache
    cache.insert(cache.block_hashes(words("y", 32)))
    assert len(cache) == 2  # only x's held blocks stay; y's were evicted at once
    assert cache.held_blocks == 5
    assert cache.overfull == 1  # larger than the cache: an engine would refuse it
    clock.now = 5.0
    cache.insert(cache.block_hashes(words("y", 32)))
    cache.insert(cache.block_hashes(words("z", 16)))  # one block too many
    # vLLM frees a finished request's blocks last block first: x's tail goes first
    assert cache.lookup(x, 33) == 16


def test_holds_overlap_by_reference_count() -> None:
    clock = Clock()
    cache = PrefixCache(capacity_tokens=64, block_size=16, clock=clock)
    shared = cache.block_hashes(words("s", 32))
    cache.admit(shared, words("s", 32), 32, 1.0)
    cache.admit(shared, words("s", 32), 32, 3.0)
    clock.now = 2.0  # one holder left
    for tag in ("b", "c"):
        cache.insert(cache.block_hashes(words(tag, 32)))
    assert cache.lookup(shared, 33) == 32
    clock.now = 3.0
    assert cache.held_blocks == 0
    cache.clear()
    assert len(cache) == 0


PER_TOKEN_MS = 400.0


@pytest.fixture
def http() -> Iterator[httpx2.Client]:
    with httpx2.Client(timeout=10) as c:
        yield c


@pytest.mark.parametrize("holds", [True, False])
def test_worker_keeps_a_running_prompt_cached(holds: bool, http: httpx2.Client) -> None:
    """A long request runs while three other prompts pass through a 6-block cache: with
    holds its prompt is still cached for the next turn, without it is evicted."""
    config = MockConfig(
        cache_tokens=96,
        block_size=16,
        output_tokens=4,
        per_token_ms=PER_TOKEN_MS,
        cache_holds_running=holds,
    )
    with MockWorkerThread(config) as m:
        url = m.url + "/v1/completions"
        a = " ".join(f"a{i}" for i in range(40))
        slow = threading.Thread(target=lambda: http.post(url, json={"prompt": a}))
        slow.start()
        try:
            while m.worker.stats.in_flight < 1 and slow.is_alive():
                threading.Event().wait(0.005)
            metrics = samples(http.get(m.url + "/metrics").content)
            usage = next(v for k, v in metrics.items() if k.startswith("vllm:kv_cache_usage"))
            for tag in ("b", "c", "d"):  # each fits beside the long one: none waits
                other = " ".join(f"{tag}{i}" for i in range(32))
                assert http.post(url, json={"prompt": other, "max_tokens": 1}).status_code == 200
            again = http.post(url, json={"prompt": a, "max_tokens": 1}).json()["usage"]
            running = m.worker.stats.in_flight
        finally:
            slow.join()
    assert running == 1  # the long request was still running throughout
    cached = again["prompt_tokens_details"]["cached_tokens"]
    if holds:
        assert cached == 32
        assert usage == 0.5  # 2 prompt blocks + the partial block with the output, of 6
    else:
        assert cached == 0
        assert usage == 2 / 6  # without holds the mock reports the cached share


# -- outputs join the cache (MockConfig.cache_outputs) ---------------------------------


def test_output_blocks_are_stored_when_the_request_ends() -> None:
    clock = Clock()
    batches: list[list[KVCacheEvent]] = []
    cache = PrefixCache(capacity_tokens=1024, block_size=16, events=batches.append, clock=clock)
    prompt = words("p", 40)
    full = prompt + words("tok", 16)
    keys = cache.block_hashes(prompt)
    cache.admit(keys, prompt, 56, 2.0, then=(cache.block_hashes(full), full))
    assert cache.lookup(cache.block_hashes(full), 57) == 32  # the answer is not cached yet
    stored_prompt = batches[-1][-1]
    assert isinstance(stored_prompt, BlockStored)
    clock.now = 2.0
    assert cache.held_blocks == 0  # ends the request: its output is stored
    assert cache.lookup(cache.block_hashes(full), 57) == 48
    (event,) = batches[-1]
    assert isinstance(event, BlockStored)
    # one new block, chained on the prompt's last full block, as vLLM reports it
    assert event.parent_block_hash == stored_prompt.block_hashes[-1]
    assert len(event.token_ids) == 16


@pytest.mark.parametrize(("outputs", "holds"), [(True, False), (True, True), (False, False)])
def test_next_turn_hits_the_previous_answer(
    outputs: bool, holds: bool, http: httpx2.Client
) -> None:
    config = MockConfig(
        cache_tokens=4096,
        output_tokens=16,
        cache_outputs=outputs,
        cache_holds_running=holds,
        per_token_ms=2.0 * holds,  # the answer is stored when its hold ends
    )
    with MockWorkerThread(config) as m:
        url = m.url + "/v1/completions"
        first = " ".join(f"w{i}" for i in range(40))
        answer = http.post(url, json={"prompt": first}).json()["choices"][0]["text"]
        nxt = first + " " + answer + " " + " ".join(f"n{i}" for i in range(10))
        usage = http.post(url, json={"prompt": nxt}).json()["usage"]
    # 40 prompt words + 16 answer words: 3 full blocks, 2 of them the first prompt's
    assert usage["prompt_tokens_details"]["cached_tokens"] == (48 if outputs else 32)


def test_next_chat_turn_hits_the_answer_through_the_tokenizer(http: httpx2.Client) -> None:
    """With an engine tokenizer the output is cached as the ids the next turn's chat
    template renders for it."""

    tiny = TOKENIZER
    config = MockConfig(
        cache_tokens=4096, output_tokens=16, cache_outputs=True, tokenizer=str(tiny)
    )
    with MockWorkerThread(config) as m:
        url = m.url + "/v1/chat/completions"
        msgs = [{"role": "user", "content": " ".join(f"w{i}" for i in range(30))}]
        r1 = http.post(url, json={"messages": msgs}).json()
        msgs += [r1["choices"][0]["message"], {"role": "user", "content": "and then"}]
        usage = http.post(url, json={"messages": msgs}).json()["usage"]
    first = r1["usage"]["prompt_tokens"]
    # the cached tokens reach past the first prompt's full blocks into the answer
    assert usage["prompt_tokens_details"]["cached_tokens"] > first // 16 * 16


@pytest.mark.parametrize("holds", [True, False])
def test_published_events_describe_the_cache_exactly(holds: bool) -> None:
    """Fed to meshkit's KV index, the events name exactly the blocks the cache holds
    after every request: also when a request's own cached blocks are pushed out and
    put back by its insert (a crowded cache, held blocks, stored answers)."""
    import random
    import time

    import msgspec

    from meshkit.core.kv_events import decode_batch
    from meshkit.core.kv_index import KvIndex, _h64
    from meshkit.mock.kv_publisher import AllBlocksCleared, BlockRemoved, KVEventBatch

    clock = Clock()
    index = KvIndex(10**6)
    encode = msgspec.msgpack.Encoder().encode

    def sink(events: list[KVCacheEvent]) -> None:
        # (the cache's events are the concrete kinds the decoding struct lists)
        kinds = cast("list[BlockStored | BlockRemoved | AllBlocksCleared]", events)
        batch = KVEventBatch(ts=time.time(), events=kinds, data_parallel_rank=None)
        index.apply("w", decode_batch(encode(batch)))

    cache = PrefixCache(4000, 32, events=sink, clock=clock)
    rng = random.Random(7)
    convs = [[rng.randrange(1000) for _ in range(rng.randrange(200, 900))] for _ in range(12)]
    for step in range(400):
        clock.now += 0.005
        c = rng.randrange(len(convs))
        prompt = convs[c]
        full = prompt + [rng.randrange(1000) for _ in range(64)]
        keys = cache.block_hashes(prompt)
        cache.lookup(keys, len(prompt))
        then = (cache.block_hashes(full), full)
        if holds:  # (some wait for room: their blocks are stored when they start)
            cache.admit(keys, prompt, len(full), 0.03, then=then)
        else:  # the answer is stored at the next change, the prompt now
            cache.admit((), (), 0, 0.0, then=then)
            cache.insert(keys, prompt)
        convs[c] = full + [rng.randrange(1000) for _ in range(40)]
        if len(convs[c]) > 3000:
            convs[c] = convs[c][:300]
        held = {_h64(v) for v in cache._lru.values() if v is not None}
        assert set(index._workers["w"].entries) == held, f"step {step}"
    assert (cache.queued > 0) == holds  # the crowd made requests wait


# -- requests wait for room (the waiting queue) -----------------------------------------


def test_a_request_that_does_not_fit_waits_for_the_running_one() -> None:
    clock = Clock()
    batches: list[list[KVCacheEvent]] = []
    cache = PrefixCache(capacity_tokens=64, block_size=16, events=batches.append, clock=clock)
    a, b = words("a", 32), words("b", 32)
    ka, kb = cache.block_hashes(a), cache.block_hashes(b)
    assert cache.admit(ka, a, 48, 10.0) == 0.0  # 2 prompt blocks + 1 for the output
    assert cache.admit(kb, b, 48, 1.0) == 10.0  # 3 more do not fit beside a's 3
    assert cache.waiting == 1
    assert cache.lookup(kb, 33) == 0  # not started: its prompt is not computed yet
    reported = len(batches)
    clock.now = 10.0
    assert cache.waiting == 0
    assert cache.held_blocks == 3  # b's, a's are released
    assert len(batches) > reported  # b's blocks are reported when it starts
    assert cache.lookup(kb, 33) == 32
    assert cache.overfull == 0


def test_waiting_requests_start_in_arrival_order() -> None:
    clock = Clock()
    cache = PrefixCache(capacity_tokens=64, block_size=16, clock=clock)
    a, b, c = words("a", 32), words("b", 32), words("c", 16)
    cache.admit(cache.block_hashes(a), a, 48, 10.0)
    cache.admit(cache.block_hashes(b), b, 48, 5.0)
    clock.now = 1.0
    # c's one block would fit beside a's three now, but b waits ahead of it
    assert cache.admit(cache.block_hashes(c), c, 16, 1.0) == 9.0
    assert cache.waiting == 2
    clock.now = 10.0
    assert cache.waiting == 0
    assert cache.held_blocks == 4  # b's three and c's one run together


def test_a_shared_prefix_needs_no_room_twice() -> None:
    """A request whose prompt blocks a running request holds needs only its own."""
    clock = Clock()
    cache = PrefixCache(capacity_tokens=80, block_size=16, clock=clock)  # 5 blocks
    shared = words("s", 48)
    keys = cache.block_hashes(shared)
    assert cache.admit(keys, shared, 64, 10.0) == 0.0  # 3 prompt blocks + 1 output
    assert cache.admit(keys, shared, 64, 10.0) == 0.0  # 3 shared + 1 output: 5 in all
    assert cache.held_blocks == 5
    assert cache.admit(cache.block_hashes(words("t", 16)), words("t", 16), 16, 1.0) == 10.0


@pytest.mark.parametrize(("blocks", "start"), [(6, 2.0), (5, 10.0)])
def test_a_shared_prefix_released_while_waiting_is_needed_again(blocks: int, start: float) -> None:
    clock = Clock()
    cache = PrefixCache(capacity_tokens=16 * blocks, block_size=16, clock=clock)
    shared, x = words("s", 48), words("x", 16)
    keys = cache.block_hashes(shared)
    cache.admit(keys, shared, 64, 2.0)  # 3 prompt blocks + 1 output, until 2 s
    cache.admit(cache.block_hashes(x), x, 16, 10.0)  # 1 block, until 10 s
    # 3 shared + 2 output blocks: 2 more than the 5 in use do not fit; when the first
    # request ends, its 3 shared blocks are this one's to hold: 1 + 5 in use then
    assert cache.admit(keys, shared, 80, 1.0) == start


def test_time_passing_during_an_admission_does_not_overfill() -> None:
    """The clock moves between reads (a live worker): a request that ends after the
    cache caught up on the past must still be running when the next one is placed."""

    class Ticking(Clock):
        def __call__(self) -> float:
            self.now += 1.0
            return self.now - 1.0

    clock = Ticking()
    cache = PrefixCache(capacity_tokens=64, block_size=16, clock=clock)
    a, b = words("a", 32), words("b", 32)
    cache.admit(cache.block_hashes(a), a, 48, 1.5)  # 3 of 4 blocks, read at 0: ends at 1.5
    assert cache.admit(cache.block_hashes(b), b, 48, 1.0) == 0.5  # read at 1: waits for a
    assert cache.overfull == 0


def test_a_request_larger_than_the_cache_runs_once_the_rest_has_ended() -> None:
    clock = Clock()
    cache = PrefixCache(capacity_tokens=64, block_size=16, clock=clock)
    a, big = words("a", 16), words("g", 64)
    cache.admit(cache.block_hashes(a), a, 16, 2.0)
    assert cache.admit(cache.block_hashes(big), big, 80, 1.0) == 2.0
    clock.now = 2.0
    assert cache.held_blocks == 5
    assert cache.overfull == 1  # 5 blocks in a 4-block cache: nothing left to evict


def test_worker_reports_a_waiting_request(http: httpx2.Client) -> None:
    """Two requests that do not fit together: the second waits, its answer comes after
    the first one's although it is far shorter, and the worker's metrics say so as
    vLLM's do (``num_requests_waiting``)."""
    config = MockConfig(
        cache_tokens=64,
        block_size=16,
        output_tokens=16,
        per_token_ms=PER_TOKEN_MS / 4,
        cache_holds_running=True,
    )
    with MockWorkerThread(config) as m:
        url = m.url + "/v1/completions"
        codes: list[int] = []
        sent: dict[str, float] = {}
        answered: dict[str, float] = {}

        def send(tag: str) -> None:
            prompt = " ".join(f"{tag}{i}" for i in range(32))
            short = {"max_tokens": 1} if tag == "b" else {}  # 33 tokens: still 3 blocks
            sent[tag] = time.monotonic()
            codes.append(http.post(url, json={"prompt": prompt, **short}).status_code)
            answered[tag] = time.monotonic()

        threads = [threading.Thread(target=send, args=(tag,)) for tag in ("a", "b")]
        for n, t in enumerate(threads, 1):
            t.start()
            while m.worker.stats.in_flight < n and t.is_alive():
                threading.Event().wait(0.005)
        try:
            metrics = samples(http.get(m.url + "/metrics").content)
        finally:
            for t in threads:
                t.join()
    value = {k.split("{")[0]: v for k, v in metrics.items()}
    assert codes == [200, 200]
    # b waited for a's blocks before its one token: it cannot answer before a has
    # ended (without the wait in its delay it answers at once). A bound from the
    # clock, not the order the two threads append their answers in: b's one token
    # comes as a ends, so that order was a race.
    a_lasts = (config.output_tokens - 1) * config.per_token_ms / 1000
    assert answered["b"] >= sent["a"] + a_lasts
    assert value["vllm:num_requests_waiting"] == 1
    assert value["vllm:num_requests_running"] == 1
