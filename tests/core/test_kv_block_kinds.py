"""Which engine blocks a request can be matched on (:mod:`meshkit.core.kv_index`'s
"what is indexed"): LoRA adapters chain from their own root, salted blocks
(multimodal, cache salt) match no request, other media and partial-attention
groups are not indexed; and :func:`~meshkit.core.kv_events.split`, which bounds
what one hold of the routing lock applies.

The events are encoded with the class definitions of ``vllm/distributed/kv_events.py``
(mirrored in ``test_kv_events``), so the decoder's reading of ``extra_keys``,
``lora_name``, ``medium`` and ``kv_cache_spec_kind`` is held to the wire."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from test_kv_events import ENC, VllmBatch, VllmRemoved, VllmStored

from meshkit.core.kv_events import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    KvEventError,
    decode_batch,
    split,
)
from meshkit.core.kv_index import ROOT, KvIndex, chain, lora_root

PROMPT = list(range(100, 108))  # 4 blocks of 2


def vllm(*events: VllmStored | VllmRemoved) -> Batch:
    """A batch as vLLM publishes it, decoded by meshkit."""
    return decode_batch(ENC(VllmBatch(1.0, list(events))))


def stored(
    hashes: list[int | bytes],
    tokens: list[int],
    *,
    parent: int | None = None,
    lora: str | None = None,
    lora_id: int | None = None,
    extra: list[object] | None = None,
    medium: str | None = "GPU",
    group: int | None = None,
    kind: str | None = None,
) -> VllmStored:
    return VllmStored(
        hashes,
        parent,
        tokens,
        2,
        lora_id,
        medium,
        lora,
        extra_keys=extra,
        group_idx=group,
        kv_cache_spec_kind=kind,
    )


# -- LoRA adapters ----------------------------------------------------------------------


def test_an_adapters_blocks_match_its_requests_and_not_the_base_models() -> None:
    idx = KvIndex(max_blocks=100)
    extra: list[object] = [("ad1",)] * 4  # vLLM puts the adapter's name first in each
    idx.apply("base", vllm(stored([1, 2, 3, 4], PROMPT)))
    idx.apply("lora", vllm(stored([5, 6, 7, 8], PROMPT, lora="ad1", lora_id=1, extra=extra)))
    assert idx.lora_names == frozenset({"ad1"})
    assert idx.root("ad1") == lora_root("ad1") != ROOT and idx.root("base-model") == ROOT
    # matched by keys (prepare computes them from the model's root) ...
    for model, holder in (("base-model", "base"), ("ad1", "lora")):
        keys = {2: chain(PROMPT, 2, idx.root(model))}
        got = idx.match(PROMPT, ["base", "lora"], keys, model)
        assert got == {holder: 8, ({"base", "lora"} - {holder}).pop(): 0}
        # ... and without them (a block size prepare did not know yet)
        assert idx.match(PROMPT, ["base", "lora"], None, model)[holder] == 8


def test_an_adapter_seen_past_the_bound_is_not_matched() -> None:
    idx = KvIndex(max_blocks=100, max_loras=1)
    idx.apply("a", vllm(stored([1], PROMPT[:2], lora="first")))
    idx.apply("b", vllm(stored([2], PROMPT[:2], lora="second")))
    assert idx.lora_names == frozenset({"first"})
    assert idx.match(PROMPT, ["a", "b"], None, "first") == {"a": 2, "b": 0}
    # "second" is keyed from the base root, which holds nothing here
    assert idx.match(PROMPT, ["a", "b"], None, "second") == {"a": 0, "b": 0}


def test_an_adapter_root_is_the_same_in_every_process() -> None:
    code = "from meshkit.core.kv_index import lora_root; print(lora_root('sql-lora'))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "7")
    }
    assert seen == {str(lora_root("sql-lora"))}


def test_an_adapter_named_by_number_only_is_never_matched() -> None:
    (event,) = vllm(stored([1, 2], PROMPT[:4], lora_id=3)).events
    assert isinstance(event, BlockStored) and event.salted == (0, 1)
    idx = KvIndex(max_blocks=100)
    idx.apply("a", Batch(0.0, (event,)))
    assert idx.blocks_of("a") == 2 and idx.match(PROMPT, ["a"]) == {"a": 0}


# -- salted blocks ----------------------------------------------------------------------


def test_extra_keys_beyond_the_adapter_salt_their_blocks() -> None:
    mm = ("img-a", 0)
    (event,) = vllm(
        stored([1, 2, 3, 4], PROMPT, lora="ad1", extra=[("ad1",), ("ad1", mm), None, ("ad1",)])
    ).events
    assert isinstance(event, BlockStored) and event.salted == (1,)
    (salt,) = vllm(stored([1, 2], PROMPT[:4], extra=[("user-salt",), None])).events
    assert isinstance(salt, BlockStored) and salt.salted == (0,)


def test_a_prompt_is_not_matched_on_another_images_placeholder_tokens() -> None:
    # Two blocks of text, then an image's placeholder tokens in the last two blocks.
    idx = KvIndex(max_blocks=100)
    extra: list[object] = [None, None, (("img-a", 0),), (("img-a", 2),)]
    idx.apply("a", vllm(stored([1, 2, 3, 4], PROMPT, extra=extra)))
    # the text before the image matches; the placeholders of another image do not
    assert idx.match(PROMPT, ["a"]) == {"a": 4}
    assert idx.match(PROMPT, ["a"], {2: chain(PROMPT, 2)}) == {"a": 4}
    assert idx.blocks_of("a") == 4  # held, and removed by their engine hashes
    idx.apply("a", vllm(VllmRemoved([3, 4], "GPU")))
    assert idx.blocks_of("a") == 2


@pytest.mark.parametrize("extra", ["ad1", [1], [["ad1"], "x"]])
def test_malformed_extra_keys_are_errors(extra: object) -> None:
    with pytest.raises(KvEventError, match="extra_keys"):
        vllm(stored([1, 2], PROMPT[:4], extra=extra))  # type: ignore[arg-type]


# -- media and groups -------------------------------------------------------------------


def test_another_tier_neither_adds_nor_drops_gpu_blocks() -> None:
    idx = KvIndex(max_blocks=100)
    idx.apply("a", vllm(stored([1, 2], PROMPT[:4])))
    idx.apply("a", vllm(stored([1, 2], PROMPT[:4], medium="CPU")))  # offloaded copy
    idx.apply("a", vllm(stored([9], [7, 7], medium="CPU")))
    assert idx.blocks_of("a") == 2
    idx.apply("a", vllm(VllmRemoved([1, 2], "CPU")))  # the CPU tier let its copy go
    assert idx.match(PROMPT, ["a"]) == {"a": 4}
    idx.apply("a", vllm(VllmRemoved([2], "GPU")))
    assert idx.match(PROMPT, ["a"]) == {"a": 2}
    # an engine that names no medium is its GPU
    idx.apply("b", vllm(stored([1], PROMPT[:2], medium=None)))
    assert idx.match(PROMPT, ["b"]) == {"b": 2}


def test_a_hybrid_models_sliding_window_group_does_not_drop_the_prefix() -> None:
    idx = KvIndex(max_blocks=100)
    full = stored([1, 2, 3, 4], PROMPT, group=0, kind="full_attention")
    window = stored([1, 2, 3, 4], PROMPT, group=1, kind="sliding_window")
    idx.apply("a", vllm(full, window))
    assert idx.blocks_of("a") == 4
    # the window's group lets its old blocks go (a removal names only its group)
    idx.apply("a", vllm(VllmRemoved([1, 2], "GPU", group_idx=1)))
    assert idx.match(PROMPT, ["a"]) == {"a": 8}
    idx.apply("a", vllm(VllmRemoved([3], "GPU", group_idx=0)))
    assert idx.match(PROMPT, ["a"]) == {"a": 4}
    for kind in ("mla_attention", "sink_full_attention", None):
        other = KvIndex(max_blocks=100)
        other.apply("m", vllm(stored([1], PROMPT[:2], group=0, kind=kind)))
        assert other.blocks_of("m") == 1, kind


# -- split: the bound on one hold of the routing lock ------------------------------------


def _random_batches(rng: random.Random, n: int) -> list[Batch]:
    """Batches of long chains, extensions, removals and clears, as an engine sends."""
    out: list[Batch] = []
    heads: list[int] = []
    next_hash = 1
    for b in range(n):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            if roll < 0.6:
                count = rng.randint(1, 40)
                hashes = tuple(range(next_hash, next_hash + count))
                next_hash += count
                parent = rng.choice(heads) if heads and rng.random() < 0.5 else None
                tokens = tuple(rng.randrange(50) for _ in range(2 * count))
                salted = tuple(i for i in range(count) if rng.random() < 0.05)
                events.append(BlockStored(hashes, parent, tokens, 2, salted=salted))
                heads.extend(hashes)
            elif roll < 0.95 and heads:
                gone = tuple(rng.sample(heads, min(len(heads), rng.randint(1, 30))))
                events.append(BlockRemoved(gone))
            else:
                events.append(AllBlocksCleared())
        out.append(Batch(float(b), tuple(events), 0))
    return out


def _weight(batch: Batch) -> int:
    return sum(
        1 if isinstance(e, AllBlocksCleared) else max(1, len(e.block_hashes)) for e in batch.events
    )


@pytest.mark.parametrize("limit", [1, 7, 64, 10_000])
def test_split_runs_are_bounded_and_apply_to_the_same_index(limit: int) -> None:
    rng = random.Random(limit)
    batches = _random_batches(rng, 60)
    whole, pieces = KvIndex(max_blocks=200), KvIndex(max_blocks=200)
    for batch in batches:
        whole.apply("w", batch)
    runs = split(batches, limit)
    assert all(sum(_weight(b) for b in run) <= limit for run in runs)
    for run in runs:
        for batch in run:
            pieces.apply("w", batch)
    probe = [rng.randrange(50) for _ in range(400)]
    assert pieces.blocks_of("w") == whole.blocks_of("w")
    assert pieces._holders == whole._holders  # the same keys, held the same way
    assert pieces.match(probe, ["w"]) == whole.match(probe, ["w"])
    # every event's blocks survive the cut, in order, with their batches' ts
    flat = [
        (b.ts, h)
        for run in runs
        for b in run
        for e in b.events
        if not isinstance(e, AllBlocksCleared)
        for h in e.block_hashes
    ]
    assert flat == [
        (b.ts, h)
        for b in batches
        for e in b.events
        if not isinstance(e, AllBlocksCleared)
        for h in e.block_hashes
    ]


def test_one_long_event_is_cut_into_chained_pieces() -> None:
    tokens = tuple(range(20))
    event = BlockStored(tuple(range(1, 11)), 99, tokens, 2, "ad1", "GPU", 0, (3, 4), None)
    runs = split([Batch(5.0, (event,), 2)], 4)
    pieces = [e for run in runs for b in run for e in b.events]
    assert [len(p.block_hashes) for p in pieces] == [4, 4, 2]  # type: ignore[union-attr]
    first, second, third = pieces
    assert isinstance(second, BlockStored) and isinstance(third, BlockStored)
    assert first.parent_block_hash == 99 and second.parent_block_hash == 4  # type: ignore[union-attr]
    assert second.token_ids == tokens[8:16] and second.salted == (0,)
    assert first.salted == (3,) and third.salted == ()  # type: ignore[union-attr]
    assert {(b.ts, b.dp_rank) for run in runs for b in run} == {(5.0, 2)}
    assert all(p.lora_name == "ad1" for p in pieces)  # type: ignore[union-attr]
