"""
KV-cache events, as vLLM publishes them
=======================================

With ``MockConfig.kv_events`` set, the mock worker publishes its prefix-cache model's
changes the way vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``)
does, so a KV-aware router can be tested against it:

* a ZeroMQ **PUB** socket bound to ``kv_events`` sends multipart
  ``[topic, seq, payload]``: ``seq`` is an 8-byte big-endian counter from 0, one per
  batch; ``payload`` is a msgpack ``KVEventBatch``;
* optionally a **ROUTER** socket bound to ``kv_replay`` answers a replay request
  ``[identity, b"", start_seq (8 bytes big-endian)]`` (what a DEALER sending
  ``[b"", start_seq]`` produces) with every buffered batch whose seq is at least
  ``start_seq``, ``[identity, b"", seq, payload]``, then the end marker
  ``[identity, b"", (-1).to_bytes(8, "big", signed=True), b""]``. The buffer keeps
  the last ``kv_replay_buffer`` batches.

Payload formats (``kv_events_format``):

* ``"map"`` (current vLLM, ``tag=True`` structs): the batch is
  ``{"ts", "events", "data_parallel_rank"}``, each event ``{"type": "BlockStored", ...}``;
* ``"array"`` (older vLLM, SGLang; ``array_like=True``): the batch is
  ``[ts, events, rank]``, each event ``["BlockStored", field, ...]`` in field order.

In maps, fields left at their default (``extra_keys``, ``group_idx``) are omitted,
as ``omit_defaults=True`` does; arrays carry every field (msgspec trims nothing off
an ``array_like`` struct). Block hashes are unsigned 64-bit ints from a seeded
hash chain (:class:`EngineHasher`): like vLLM's, they cannot be recomputed outside
the process, and a restarted worker draws a new seed.

Sending never blocks the request path: the PUB socket is written with ``NOBLOCK``; a
batch it refuses (``zmq.Again``) is counted in ``MockStats.kv_batches_dropped`` and
still kept for replay. The ROUTER socket is serviced on the worker's event loop
(``loop.add_reader`` on the socket's file descriptor). ``zmq`` is imported only when
a publisher is built.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections import deque
from collections.abc import Sequence
from hashlib import blake2b
from typing import TYPE_CHECKING, Any
from zlib import crc32

import msgspec

if TYPE_CHECKING:
    import zmq

    from meshkit.mock.config import MockStats

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineHasher",
    "EventBatch",
    "KVCacheEvent",
    "KVEventBatch",
    "KvEventPublisher",
    "token_ids",
]

#: The sequence number of a replay's end marker.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: vLLM's default PUB high-water mark.
_PUB_HWM = 100_000
_MASK64 = (1 << 64) - 1

# -- the structs (vLLM's names and field order) -----------------------------------------


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged by class name: ``"type": "BlockStored"``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The same, encoded as arrays (older vLLM, SGLang).


class _ArrayBatch(EventBatch, array_like=True):
    pass


class _ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_AS_ARRAY: dict[type[KVCacheEvent], type[KVCacheEvent]] = {
    BlockStored: _ArrayBlockStored,
    BlockRemoved: _ArrayBlockRemoved,
    AllBlocksCleared: _ArrayAllBlocksCleared,
}


def _as_array(event: KVCacheEvent) -> KVCacheEvent:
    return _AS_ARRAY[type(event)](*msgspec.structs.astuple(event))


# -- engine block hashes --------------------------------------------------------------

_encode_ids = msgspec.msgpack.Encoder().encode


class EngineHasher:
    """vLLM-like block hashes: a blake2b chain over (parent hash, token ids), keyed by
    a per-process random seed, as unsigned 64-bit ints."""

    def __init__(self, seed: bytes | None = None) -> None:
        self.seed = os.urandom(16) if seed is None else seed

    def __call__(
        self, parent: int | None, token_ids: Sequence[int], lora: str | None = None
    ) -> int:
        # vLLM hashes a LoRA adapter's name with each of its blocks (extra_keys)
        parts = (parent, token_ids) if lora is None else (parent, token_ids, (lora,))
        digest = blake2b(_encode_ids(parts), key=self.seed, digest_size=8).digest()
        return int.from_bytes(digest, "big")


# -- the publisher ------------------------------------------------------------------


class KvEventPublisher:
    """The PUB (and optional ROUTER replay) sockets of one mock worker.

    Use on the worker's event loop only: :meth:`open` (binds), :meth:`publish`,
    :meth:`close` (unbinds; the sequence and replay buffer are kept, so a stopped and
    started worker continues them), :meth:`reset` (a crashed engine: seq from 0,
    buffer empty). Once bound, the endpoints are those actually bound (port 0 picks
    one) and later opens bind them again.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay: str | None = None,
        topic: str = "",
        fmt: str = "map",
        buffer: int = 10_000,
        stats: MockStats | None = None,
        data_parallel_rank: int = 0,
    ) -> None:
        import zmq

        if fmt not in ("map", "array"):
            raise ValueError("kv_events_format must be 'map' or 'array'")
        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.topic = topic.encode()
        self.array = fmt == "array"
        self.stats = stats
        self.data_parallel_rank = data_parallel_rank
        self._encode = msgspec.msgpack.Encoder().encode
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(buffer, 1))
        self._seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_fd: int | None = None

    @property
    def seq(self) -> int:
        """The sequence number of the next batch."""
        return self._seq

    @property
    def is_open(self) -> bool:
        return self._pub is not None

    async def open(self) -> None:
        """Bind the sockets (retrying briefly while a just-closed port lingers)."""
        if self._pub is not None:
            return
        zmq = self._zmq
        ctx = zmq.Context()
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, _PUB_HWM)
            self.endpoint = await self._bind_retry(pub, self.endpoint)
            router = None
            if self.replay_endpoint is not None:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.SNDHWM, 0)  # a replay is never dropped
                self.replay_endpoint = await self._bind_retry(router, self.replay_endpoint)
        except BaseException:
            ctx.destroy(linger=0)
            raise
        self._ctx, self._pub, self._router = ctx, pub, router
        if router is not None:
            loop = asyncio.get_running_loop()
            fd = router.getsockopt(zmq.FD)
            assert isinstance(fd, int)
            loop.add_reader(fd, self._service_replay)
            self._loop, self._reader_fd = loop, fd
            # The FD is edge-triggered: requests already queued would not wake it.
            loop.call_soon(self._service_replay)

    async def _bind_retry(self, sock: zmq.Socket[bytes], endpoint: str) -> str:
        """Bind ``endpoint``; the endpoint bound. A failure raises :class:`OSError`."""
        zmq = self._zmq
        for attempt in range(100):
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or endpoint.endswith(":0") or attempt == 99:
                    raise OSError(exc.errno, f"cannot bind {endpoint}: {exc.strerror}") from exc
                await asyncio.sleep(0.02)
                continue
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
            return last.decode() if isinstance(last, bytes) else str(last)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Unbind and close the sockets; :meth:`publish` is a no-op until reopened."""
        if self._loop is not None and self._reader_fd is not None:
            self._loop.remove_reader(self._reader_fd)
        self._loop = self._reader_fd = None
        ctx, self._ctx, self._pub, self._router = self._ctx, None, None, None
        if ctx is not None:
            ctx.destroy(linger=0)

    def reset(self) -> None:
        """Forget the sequence and the replay buffer (a restarted engine)."""
        self._seq = 0
        self._buffer.clear()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send ``events`` as one batch (no-op when closed or ``events`` is empty)."""
        pub = self._pub
        if pub is None or not events:
            return
        batch: EventBatch
        if self.array:
            arrays = [_as_array(e) for e in events]
            batch = _ArrayBatch(time.time(), arrays, self.data_parallel_rank)
        else:
            batch = EventBatch(time.time(), list(events), self.data_parallel_rank)
        payload = self._encode(batch)
        seq = self._seq
        self._seq = seq + 1
        self._buffer.append((seq, payload))
        stats = self.stats
        try:
            pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), self._zmq.NOBLOCK)
        except self._zmq.Again:
            if stats is not None:
                stats.kv_batches_dropped += 1
            return
        if stats is not None:
            stats.kv_batches_published += 1

    def _service_replay(self) -> None:
        router = self._router
        if router is None:
            return
        zmq = self._zmq
        while router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request (vLLM logs and ignores it)
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            router.send_multipart((client, b"", END_SEQ, b""))


def token_ids(tokens: Sequence[Any]) -> list[int]:
    """Event token ids for mock tokens: an int as it is (masked to 64 bits when out of
    msgpack's range), a word as its CRC-32 (what the mock's ``/tokenize`` answers)."""
    out: list[int] = []
    for tok in tokens:
        if isinstance(tok, int):
            out.append(tok if -(1 << 63) <= tok <= _MASK64 else tok & _MASK64)
        else:
            out.append(crc32(tok.encode("utf-8")))
    return out
