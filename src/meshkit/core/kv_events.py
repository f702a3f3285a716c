"""
KV-cache events, as engines publish them
========================================

The wire format of vLLM's KV-event publisher (``vllm/distributed/kv_events.py``,
``ZmqEventPublisher``) and SGLang's (same framing and class names), decoded into
plain values. Sans-I/O: the ZeroMQ subscriber hands the frames in.

Framing (ZeroMQ multipart):

* published: ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian counter
  that starts at 0 and grows by one per batch (a jump is a gap);
* replayed (a DEALER asking the publisher's ROUTER from a sequence number: it sends
  ``[b"", seq as 8 bytes big-endian]``): after the empty delimiter, ``[topic, seq,
  payload]`` per batch (vLLM 0.32, captured) or ``[seq, payload]`` (older vLLM,
  SGLang), then an end marker: seq -1 (8 signed bytes) with an empty payload.

The payload is one msgpack ``KVEventBatch``: ``ts`` (float), ``events`` and the DP
rank (vLLM: ``data_parallel_rank``; SGLang: ``attn_dp_rank``, the third field).
Current vLLM encodes the batch and its events as msgpack *maps*
(``msgspec.Struct`` with ``tag=True``: an event is ``{"type": "BlockStored", ...}``);
older vLLM releases and SGLang encode them as *arrays* (``array_like=True``: the
batch is ``[ts, events, rank]``, an event ``["BlockStored", field, ...]`` in field
order). Both are accepted. Events:

* ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name`` (then optional
  ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``, ...); a hash is an int
  or bytes (``ExternalBlockHash``);
* ``extra_keys``: per block, the keys vLLM hashes with its tokens
  (``kv_cache_utils.generate_block_hash_extra_keys``): the LoRA adapter's name,
  then multimodal identifiers, the request's ``cache_salt`` (first block) and
  prompt-embedding digests. Only the LoRA name can be known from a request's
  text, so a block with any of the others is marked *salted*
  (:attr:`BlockStored.salted`): no request is matched on it. vLLM releases that
  name an adapter by ``lora_id`` only salt every block of it the same way;
* ``BlockRemoved``: ``block_hashes``, ``medium`` (then ``group_idx``);
* ``AllBlocksCleared``: nothing.

Unknown event types are skipped (a newer engine must not break the index); a
payload that is not a batch at all is a :class:`KvEventError`.

Through ``meshkit kv-relay`` (:mod:`meshkit.lifecycle.kv_relay`) the same messages
arrive with the topic frame replaced by :func:`relay_topic` of the engine's
endpoint, so a router subscribes to the engines it routes to and nothing else;
``[topic, PUBLISHER_LOST, b""]`` says the relay lost that engine's connection (a
router treats it as its own dropped connection).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "END_OF_REPLAY",
    "PUBLISHER_LOST",
    "AllBlocksCleared",
    "Batch",
    "BlockRemoved",
    "BlockStored",
    "Frame",
    "KvEventError",
    "decode_batch",
    "decode_frames",
    "decode_replay",
    "relay_topic",
    "replay_request",
    "split",
]

BlockHash = int | bytes

#: the sequence number that ends a replay (``(-1).to_bytes(8, "big", signed=True)``)
END_OF_REPLAY = -1
#: the sequence number of a relay's "this engine's connection was lost" message
PUBLISHER_LOST = -2
_DECODE = msgspec.msgpack.Decoder()
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class KvEventError(ValueError):
    """Frames or a payload that are not a KV-event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None
    #: indices of the blocks hashed with keys a request's text cannot give
    #: (multimodal, cache salt, prompt embeddings; see the module docstring)
    salted: tuple[int, ...] = ()
    #: the engine's ``kv_cache_spec_kind`` of the block's group, if it says
    kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    #: the engine's data-parallel (vLLM) or attention-DP (SGLang) rank, if it says
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded message: ``topic`` is None in a replay reply; a batch of None
    with ``seq == END_OF_REPLAY`` ends a replay, with ``PUBLISHER_LOST`` it is a
    relay's word that the engine's connection was lost."""

    topic: bytes | None
    seq: int
    batch: Batch | None


def split(batches: Sequence[Batch], max_blocks: int) -> list[list[Batch]]:
    """``batches`` cut into runs of at most ``max_blocks`` blocks each (an event
    without blocks counts one), applied one after another to the same effect.

    A ``BlockStored`` longer than that is cut too: each piece hangs from the last
    block of the one before, as the engine's next event would. The subscriber
    applies one run per hold of the routing lock, so no batch, however large,
    holds placement up for longer than ``max_blocks`` blocks take.
    """
    limit = max(1, max_blocks)
    runs: list[list[Batch]] = []
    run: list[Batch] = []
    room = limit
    for batch in batches:
        events: list[Event] = []
        for event in batch.events:
            for piece in _pieces(event, limit):
                weight = _weight(piece)
                if weight > room:
                    if events:
                        run.append(Batch(batch.ts, tuple(events), batch.dp_rank))
                        events = []
                    if run:
                        runs.append(run)
                    run, room = [], limit
                events.append(piece)
                room -= weight
        if events:
            run.append(Batch(batch.ts, tuple(events), batch.dp_rank))
    if run:
        runs.append(run)
    return runs


def _weight(event: Event) -> int:
    if isinstance(event, AllBlocksCleared):
        return 1
    return len(event.block_hashes) or 1


def _pieces(event: Event, limit: int) -> list[Event]:
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= limit:
        return [event]
    hashes = event.block_hashes
    if isinstance(event, BlockRemoved):
        return [
            BlockRemoved(hashes[i : i + limit], event.medium, event.group_idx)
            for i in range(0, len(hashes), limit)
        ]
    size = event.block_size
    if len(event.token_ids) != size * len(hashes):
        return [event]  # malformed: the index counts it whole
    out: list[Event] = []
    for i in range(0, len(hashes), limit):
        out.append(
            BlockStored(
                hashes[i : i + limit],
                event.parent_block_hash if i == 0 else hashes[i - 1],
                event.token_ids[i * size : (i + limit) * size],
                size,
                event.lora_name,
                event.medium,
                event.group_idx,
                tuple(j - i for j in event.salted if i <= j < i + limit),
                event.kind,
            )
        )
    return out


def relay_topic(endpoint: str) -> bytes:
    """The topic a relay publishes ``endpoint``'s messages under. ZeroMQ matches a
    subscription as a prefix of the topic: the NUL end keeps ``tcp://h:5557`` from
    matching ``tcp://h:55570``'s messages (an endpoint holds no NUL)."""
    return endpoint.encode("utf-8", "surrogatepass") + b"\0"


def replay_request(start_seq: int) -> bytes:
    """What a DEALER sends the publisher's ROUTER to replay from ``start_seq``."""
    return int(start_seq).to_bytes(8, "big")


def decode_frames(frames: Sequence[bytes]) -> Frame:
    """A published ``[topic, seq, payload]`` or a replayed ``[seq, payload]``."""
    if len(frames) == 3:
        topic, seq, payload = frames
    elif len(frames) == 2:
        topic, (seq, payload) = None, frames
    else:
        raise KvEventError(f"a KV-event message has 2 or 3 frames, not {len(frames)}")
    if len(seq) != 8:
        raise KvEventError("the sequence frame is not 8 bytes")
    number = int.from_bytes(seq, "big", signed=True)
    if number == END_OF_REPLAY and not payload:
        # vLLM 0.32's replay replies carry the topic frame, its end marker an empty one.
        return Frame(None, number, None)
    if number == PUBLISHER_LOST and not payload and topic is not None:
        return Frame(bytes(topic), number, None)
    if number < 0:
        raise KvEventError("a negative sequence number outside a replay's end")
    return Frame(bytes(topic) if topic is not None else None, number, decode_batch(payload))


def decode_replay(frames: Sequence[bytes]) -> Frame:
    """One reply a DEALER receives from the publisher's ROUTER: the empty delimiter,
    then ``[topic, seq, payload]`` (vLLM 0.32 keeps the topic) or ``[seq, payload]``
    (older vLLM, SGLang); the end marker's topic and payload are empty."""
    if frames and not frames[0]:
        frames = frames[1:]
    return decode_frames(frames)


def decode_batch(payload: bytes) -> Batch:
    """One msgpack ``KVEventBatch`` (map or array form, see the module docstring)."""
    try:
        raw = _DECODE.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventError(f"not msgpack: {exc}") from None
    except RecursionError:
        # ~1,000 nested arrays in a kilobyte: not a batch, and not a reason for the
        # subscriber to die (in a replay reply it would again at every restart).
        raise KvEventError("msgpack nested too deeply for a KV-event batch") from None
    if isinstance(raw, dict):
        ts, events, rank = (
            raw.get("ts"),
            raw.get("events"),
            raw.get("data_parallel_rank", raw.get("attn_dp_rank")),
        )
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvEventError("a KV-event batch is a map or an array of [ts, events, rank]")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise KvEventError("a KV-event batch needs a numeric ts and a list of events")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise KvEventError("the batch's rank is not an integer")
    out = [e for e in (_event(x) for x in events) if e is not None]
    return Batch(float(ts), tuple(out), rank)


def _fields(raw: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """The tag and the fields of a tagged map or a tagged array."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        return (tag, raw) if isinstance(tag, str) else None
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:], strict=False))
    return None


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not all(_is_hash(h) for h in value):
        raise KvEventError("block_hashes must be a list of ints or bytes")
    return tuple(value)


def _is_hash(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, bytes)


def _tokens(value: Any) -> list[int]:
    """Token ids; SGLang's bigram-keyed caches (EAGLE) send ``[token, next]`` pairs
    instead, of which the first is the block's token."""
    if not isinstance(value, list):
        raise KvEventError("token_ids must be a list")
    out = []
    for t in value:
        if isinstance(t, list) and t:
            t = t[0]
        if not isinstance(t, int) or isinstance(t, bool):
            raise KvEventError("token_ids must be ints (or [token, next] pairs)")
        out.append(t)
    return out


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _salted(extra: Any, lora: str | None, lora_id: int | None, n: int) -> tuple[int, ...]:
    """The blocks whose extra keys hold more than the LoRA name (module docstring)."""
    if lora is None and lora_id is not None:
        return tuple(range(n))  # an adapter named by number only: never matched
    if extra is None:
        return ()
    if not isinstance(extra, list):
        raise KvEventError("extra_keys must be a list (one entry per block) or nil")
    out = []
    for i, keys in enumerate(extra[:n]):
        if keys is None:
            continue
        if not isinstance(keys, list):
            raise KvEventError("an extra_keys entry must be an array or nil")
        rest = keys[1:] if lora is not None and keys and keys[0] == lora else keys
        if rest:
            out.append(i)
    return tuple(out)


def _event(raw: Any) -> Event | None:
    tagged = _fields(raw, _STORED_FIELDS)
    if tagged is None:
        raise KvEventError("a KV event is a tagged map or a tagged array")
    tag, f = tagged
    if tag == "BlockStored":
        parent = f.get("parent_block_hash")
        tokens = f.get("token_ids")
        size = f.get("block_size")
        if parent is not None and not _is_hash(parent):
            raise KvEventError("parent_block_hash must be an int, bytes or nil")
        tokens = _tokens(tokens)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise KvEventError("block_size must be a positive integer")
        hashes = _hashes(f.get("block_hashes"))
        lora = _opt_str(f.get("lora_name"))
        return BlockStored(
            hashes,
            parent,
            tuple(tokens),
            size,
            lora,
            _opt_str(f.get("medium")),
            _opt_int(f.get("group_idx")),
            _salted(f.get("extra_keys"), lora, _opt_int(f.get("lora_id")), len(hashes)),
            _opt_str(f.get("kv_cache_spec_kind")),
        )
    if tag == "BlockRemoved":
        if isinstance(raw, list):  # its own field order, not BlockStored's
            f = dict(zip(_REMOVED_FIELDS, raw[1:], strict=False))
        return BlockRemoved(
            _hashes(f.get("block_hashes")), _opt_str(f.get("medium")), _opt_int(f.get("group_idx"))
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type from a newer engine
