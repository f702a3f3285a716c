"""KV-cache events in the engines' own wire format (:mod:`meshkit.core.kv_events`).

The publishers' classes are mirrored here with msgspec exactly as the engines define
them (vLLM ``vllm/distributed/kv_events.py``: tagged *map* structs today,
``array_like`` in older releases; SGLang ``sglang/srt/disaggregation/kv_events.py``:
``array_like``, ``attn_dp_rank``), and a few payloads are pinned as bytes so the
decoder is held to the wire, not to this file's encoder.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from meshkit.core.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    KvEventError,
    decode_batch,
    decode_frames,
    replay_request,
)

# -- vLLM today: maps, a "type" tag ---------------------------------------------------


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VllmCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmStored | VllmRemoved | VllmCleared]
    data_parallel_rank: int | None = None


# -- older vLLM and SGLang: positional arrays -------------------------------------------


class ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class ArrayStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class ArrayRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class ArrayCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class SglangBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayStored | ArrayRemoved | ArrayCleared]
    attn_dp_rank: int | None = None


ENC = msgspec.msgpack.encode


def test_current_vllm_maps_decode() -> None:
    batch = VllmBatch(
        1.5,
        [
            VllmStored([11, b"\x00\x01"], None, [1, 2, 3, 4], 2, None, "GPU", "adapter"),
            VllmRemoved([11], "GPU", group_idx=0),
            VllmCleared(),
        ],
        data_parallel_rank=3,
    )
    got = decode_batch(ENC(batch))
    assert got == Batch(
        1.5,
        (
            BlockStored((11, b"\x00\x01"), None, (1, 2, 3, 4), 2, "adapter", "GPU"),
            BlockRemoved((11,), "GPU", 0),
            AllBlocksCleared(),
        ),
        3,
    )


def test_array_batches_of_older_vllm_and_sglang_decode() -> None:
    batch = SglangBatch(
        2.0,
        [ArrayStored([7, 8], 6, [5, 6, 7, 8], 2, None, "GPU"), ArrayRemoved([7]), ArrayCleared()],
        attn_dp_rank=1,
    )
    raw = ENC(batch)
    assert msgspec.msgpack.decode(raw)[1][0][0] == "BlockStored"  # positional, tag first
    got = decode_batch(raw)
    assert got.dp_rank == 1 and got.ts == 2.0
    assert got.events == (
        BlockStored((7, 8), 6, (5, 6, 7, 8), 2, None, "GPU"),
        BlockRemoved((7,), None),
        AllBlocksCleared(),
    )


def test_sglang_bigram_token_pairs_give_their_first_token() -> None:
    raw = ENC(SglangBatch(0.0, [ArrayStored([1], None, [[5, 6], [6, 7]], 2, None)]))
    (stored,) = decode_batch(raw).events
    assert isinstance(stored, BlockStored) and stored.token_ids == (5, 6)


# Pinned payloads (hex), as the publishers' msgspec encoders write them.
#: vLLM today: {"ts": 1.5, "events": [{"type": "BlockStored", block_hashes [1, 2],
#: parent nil, token_ids [1, 2, 3, 4], block_size 2, lora_id nil, medium "GPU",
#: lora_name nil}]}
VLLM_MAP = bytes.fromhex(
    "82a27473cb3ff8000000000000a66576656e74739188a474797065ab426c6f636b53746f726564ac"
    "626c6f636b5f686173686573920102b1706172656e745f626c6f636b5f68617368c0a9746f6b656e"
    "5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da34750"
    "55a96c6f72615f6e616d65c0"
)
#: an array batch: [1.5, [["BlockRemoved", [3]], ["AllBlocksCleared"]], 0]
ARRAY = bytes.fromhex("93cb3ff8000000000000" + "92" + "92ac426c6f636b52656d6f76656491" + "03")
ARRAY += bytes.fromhex("91b0416c6c426c6f636b73436c656172656400")


def test_pinned_bytes() -> None:
    got = decode_batch(VLLM_MAP)
    assert got == Batch(1.5, (BlockStored((1, 2), None, (1, 2, 3, 4), 2, None, "GPU"),), None)
    arr = decode_batch(ARRAY)
    assert arr == Batch(1.5, (BlockRemoved((3,)), AllBlocksCleared()), 0)


def test_frames_published_and_replayed() -> None:
    payload = ENC(VllmBatch(1.0, [VllmCleared()]))
    pub = decode_frames([b"kv@w1", (41).to_bytes(8, "big"), payload])
    assert (pub.topic, pub.seq) == (b"kv@w1", 41)
    assert pub.batch is not None and pub.batch.events == (AllBlocksCleared(),)
    rep = decode_frames([(7).to_bytes(8, "big"), payload])  # no topic in a replay
    assert rep.topic is None and rep.seq == 7 and rep.batch is not None
    end = decode_frames([END_OF_REPLAY.to_bytes(8, "big", signed=True), b""])
    assert end.seq == END_OF_REPLAY and end.batch is None
    assert replay_request(42) == b"\x00" * 7 + b"\x2a"


def test_an_unknown_event_type_is_skipped() -> None:
    raw = ENC({"ts": 1.0, "events": [{"type": "BlockMoved", "x": 1}, {"type": "AllBlocksCleared"}]})
    assert decode_batch(raw).events == (AllBlocksCleared(),)


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ([b"x"], "2 or 3 frames"),
        ([b"t", b"\x00" * 4, b""], "8 bytes"),
        ([b"t", (-5).to_bytes(8, "big", signed=True), ENC([1.0, []])], "negative"),
    ],
)
def test_bad_frames(frames: list[bytes], says: str) -> None:
    with pytest.raises(KvEventError, match=says):
        decode_frames(frames)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        ENC("hello"),
        ENC([1.0]),
        ENC({"ts": "now", "events": []}),
        ENC({"ts": 1.0, "events": [7]}),
        ENC({"ts": 1.0, "events": [], "data_parallel_rank": "zero"}),
        ENC({"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [1.5]}]}),
        ENC(
            {
                "ts": 1.0,
                "events": [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": ["a"],
                        "block_size": 1,
                    }
                ],
            }
        ),
        ENC(
            {
                "ts": 1.0,
                "events": [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [1],
                        "block_size": 0,
                    }
                ],
            }
        ),
    ],
)
def test_bad_payloads_are_kv_event_errors(payload: bytes) -> None:
    with pytest.raises(KvEventError):
        decode_batch(payload)
