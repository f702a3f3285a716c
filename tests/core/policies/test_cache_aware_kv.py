"""cache_aware on KV events: the engines' own blocks win over this router's tree
for the workers that publish them; the others keep the tree."""

from __future__ import annotations

from types import SimpleNamespace

from meshkit.core.kv_events import Batch, BlockStored
from meshkit.core.kv_index import KvIndex, chain
from meshkit.core.policies import CacheAware

PROMPT = list(range(1, 65))  # 64 tokens: 4 blocks of 16
TEXT = "user\n" + " ".join(map(str, PROMPT))


def store(idx: KvIndex, worker_id: str, ids: list[int], h0: int = 1000) -> None:
    n = len(ids) // 16
    hashes = tuple(h0 + i for i in range(n))
    idx.apply(worker_id, Batch(0.0, (BlockStored(hashes, None, tuple(ids[: n * 16]), 16),)))


def test_events_name_the_worker_that_holds_the_prompt(kit: SimpleNamespace) -> None:
    cands = kit.cands(3)
    a, b, c = cands
    # No load bound: this is about which match counts, not about balance.
    p = CacheAware(load_factor=None)
    # This router sent the prompt to a (its tree says a) ...
    p.on_placed(a, kit.view(TEXT), 0.0)
    # ... but the engines say b holds it (another router sent it there).
    idx = KvIndex(1000)
    for cand in cands:
        idx.apply(cand.worker.id, Batch(0.0, ()))
    store(idx, b.worker.id, PROMPT)
    store(idx, a.worker.id, [9] * 16, h0=1)  # a publishes too, but holds another prompt
    store(idx, c.worker.id, [8] * 16, h0=2)
    v = kit.view(TEXT, prompt_ids=PROMPT)
    assert p.select(kit.ctx(cands, v, kv=idx)) is b
    # precomputed keys (as prepare computes them) give the same answer
    v.kv_keys = {16: chain(PROMPT, 16)}
    assert p.select(kit.ctx(cands, v, kv=idx)) is b
    # without events the tree decides
    assert p.select(kit.ctx(cands, kit.view(TEXT))) is a


def test_a_worker_without_events_keeps_the_tree(kit: SimpleNamespace) -> None:
    a, b = kit.cands(2)
    p = CacheAware()
    p.on_placed(a, kit.view(TEXT), 0.0)  # a publishes nothing: the tree speaks for it
    idx = KvIndex(1000)
    store(idx, b.worker.id, PROMPT[:16])  # b holds a quarter of it
    v = kit.view(TEXT, prompt_ids=PROMPT)
    assert p.select(kit.ctx([a, b], v, kv=idx)) is a


def test_a_hot_holder_spills_and_a_miss_goes_to_the_least_loaded(kit: SimpleNamespace) -> None:
    a, b, c = kit.cands(3)
    idx = KvIndex(1000)
    store(idx, b.worker.id, PROMPT)
    store(idx, a.worker.id, [7] * 16, h0=1)
    store(idx, c.worker.id, [6] * 16, h0=2)
    p = CacheAware()
    v = kit.view(TEXT, prompt_ids=PROMPT)
    hot = {b.key: 20, a.key: 1, c.key: 0}
    assert p.select(kit.ctx([a, b, c], v, load=hot, kv=idx)) is c
    other = [5] * 64
    miss = kit.view("user\nfive", prompt_ids=other)
    load = {a.key: 2, b.key: 1, c.key: 3}
    assert p.select(kit.ctx([a, b, c], miss, load=load, kv=idx)) is b
