"""
KV-event subscribers
====================

One task per worker that names a publisher (``Worker(kv_events=...)``), on the
lifecycle thread's loop: a ZeroMQ SUB socket connected to the engine's publisher
(all topics), or with ``kv.relay`` to ``meshkit kv-relay`` (the engine's topic
there, :mod:`meshkit.lifecycle.kv_relay`), each message decoded
(:mod:`meshkit.core.kv_events`) and applied to the fleet's
:class:`~meshkit.core.kv_index.KvIndex` under the routing lock, at most
``kv.apply_blocks`` blocks per hold (a bigger batch, a replayed gap, even one long
event is applied in pieces, the loop turning between them) so a burst never
stalls placement for longer than one piece takes.

Sequence numbers grow by one per batch; what breaks that is handled so the index
never claims a block the engine may have dropped:

* **a gap** (a jump forward: ZeroMQ dropped messages past ``kv.receive_hwm`` for
  a subscriber that fell behind, or the connection broke): the missed batches are
  asked of the replay endpoint (``kv_replay``, a DEALER to the publisher's
  ROUTER) within ``kv.replay_timeout_s``; without a replay endpoint, or when it
  cannot fill the gap, the worker's entries are dropped and rebuilt from the
  events that follow (``mesh_kv_gaps_total{outcome="cleared"}``);
* **a restart** (the sequence goes back: the engine came back, its cache empty):
  the worker's entries are dropped. An engine process that ended drops the
  connection too, which ends the task (below): its entries go even when the new
  engine's counter ran past the old one's before meshkit heard it (by numbers
  alone a gap, which a replay of the new engine's batches would "fill");
* **subscribing**: with a replay endpoint, what the publisher still buffers is
  replayed at once (their live copies arriving after are skipped), so blocks
  stored before meshkit subscribed, even on an idle engine, are known;
* a payload that does not decode counts ``mesh_kv_errors_total`` and is treated
  as a gap (its events are lost);
* a message over ``kv.max_message_bytes``: libzmq drops the connection and does
  not connect again, so the dropped connection ends the task (its monitor says
  so) and it is started again like one that failed; together with
  ``kv.receive_hwm`` this bounds what a publisher can make a subscriber queue;
* a worker that leaves the fleet, or names another publisher, has its task
  cancelled and its entries dropped (:meth:`Fleet.remove` / ``Fleet.replace``).

The tasks follow the fleet: :meth:`KvSubscribers.sync` runs every second and on a
fleet change; a task that ended on an error is started again there (the worker's
entries dropped, then replayed or rebuilt). Nothing here is on a request's path: a
slow or dead publisher only leaves the index behind (the ``cache_aware`` match then
falls back to its own tree for workers without entries).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from meshkit.core.kv_events import (
    END_OF_REPLAY,
    PUBLISHER_LOST,
    Batch,
    KvEventError,
    decode_frames,
    decode_replay,
    relay_topic,
    replay_request,
    split,
)
from meshkit.core.workers import Worker
from meshkit.errors import ConfigError

if TYPE_CHECKING:
    from meshkit.config import KvConfig
    from meshkit.router import Router

__all__ = ["KvSubscribers", "require_zmq"]

log = logging.getLogger("meshkit.kv")

_SYNC_S = 1.0
#: "to the end": a first replay takes everything the publisher still buffers
_ALL = 1 << 62
_Key = tuple[str, str, str | None]


def require_zmq() -> Any:
    """pyzmq's asyncio module, or a ConfigError saying which extra brings it."""
    try:
        import zmq.asyncio
    except ImportError:
        raise ConfigError(
            "workers.kv_events", "KV events need pyzmq: pip install 'meshkit[kv]'"
        ) from None
    return zmq.asyncio


class KvSubscribers:
    """The subscriber tasks of one Mesh (see the module docstring)."""

    def __init__(self, router: Router, config: KvConfig) -> None:
        self.router = router
        self.config = config
        self._tasks: dict[_Key, asyncio.Task[None]] = {}
        self._ctx: Any = None
        self._poke: asyncio.Event | None = None
        self._warned = False

    @staticmethod
    def wanted(workers: tuple[Worker, ...]) -> bool:
        return any(w.kv_events for w in workers)

    def poke(self) -> None:
        """(the loop) The fleet changed: sync now."""
        if self._poke is not None:
            self._poke.set()

    async def run(self) -> None:
        self._poke = asyncio.Event()
        try:
            while True:
                self.sync()
                self.check_silence()
                with contextlib.suppress(TimeoutError):  # not wait_for: see Lifecycle
                    async with asyncio.timeout(self._tick_s):
                        await self._poke.wait()
                self._poke.clear()
        finally:
            tasks = list(self._tasks.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.clear()
            if self._ctx is not None:
                self._ctx.destroy(linger=0)
                self._ctx = None

    @property
    def _tick_s(self) -> float:
        # often enough to see a silence within a fifth of kv.silence_s
        silence = self.config.silence_s
        return min(_SYNC_S, max(0.05, silence / 5)) if silence else _SYNC_S

    def check_silence(self) -> None:
        for worker_id in self.router.kv_silent():
            self.router.metrics.kv_silent.labels(worker_id).set(1)
            log.warning(
                "kv events: nothing from %s's publisher in %g s after a request was "
                "placed there; it is matched on this router's tree until it publishes "
                "(vLLM binds only an endpoint with a * host, tcp://*:5557; is prefix "
                "caching on?)",
                worker_id,
                self.config.silence_s,
            )

    def sync(self) -> None:
        want = {(w.id, w.kv_events, w.kv_replay): w for w in self.router.workers if w.kv_events}
        for key in [k for k in self._tasks if k not in want]:
            self._tasks.pop(key).cancel()
        for key, task in list(self._tasks.items()):
            if task.done():  # a bug or a socket error ended it: start it again
                del self._tasks[key]
                if not task.cancelled() and task.exception() is not None:
                    log.warning(
                        "kv events: the subscriber of %s stopped: %r", key[0], task.exception()
                    )
                self.router.kv_clear(key[0])
        fresh = [k for k in want if k not in self._tasks]
        if not fresh:
            return
        if self._ctx is None:
            try:
                zmq_asyncio = require_zmq()
            except ConfigError as exc:
                if not self._warned:
                    self._warned = True
                    log.warning("%s", exc)
                return
            self._ctx = zmq_asyncio.Context()
        for key in fresh:
            wid, events, replay = key
            assert events is not None
            task = asyncio.ensure_future(self._follow(wid, events, replay))
            self._tasks[key] = task

    # -- one worker -----------------------------------------------------------------------

    async def _follow(self, worker_id: str, endpoint: str, replay: str | None) -> None:
        import zmq
        import zmq.asyncio

        metrics = self.router.metrics
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        relay = self.config.relay
        # Through a relay, this engine's messages only (the relay's topic for it).
        sub.setsockopt(zmq.SUBSCRIBE, b"" if relay is None else relay_topic(endpoint))
        topic: bytes | None = None  # of a replay asked of the relay
        if self.config.relay_replay is not None:
            replay, topic = self.config.relay_replay, relay_topic(endpoint)
        # libzmq drops a connection that sent a message over MAXMSGSIZE and does
        # not connect again: the task ends, and sync() starts a new subscription.
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(endpoint if relay is None else relay)
        via = "" if relay is None else f" through the relay at {relay}"
        log.info("kv events: subscribed to %s%s for %s", endpoint, via, worker_id)
        expected: int | None = None
        #: batches the first replay brought (number -> its ts): their live copies
        #: may still arrive; one with another ts is a restarted publisher's
        window: dict[int, float] = {}
        try:
            if replay is not None:
                # Subscribed first, then asked: what the publisher stored before
                # (or while) meshkit joined is not missed, even on an idle engine.
                got = await self._replay(replay, 0, _ALL, topic)
                if got is not None:
                    await self._apply(worker_id, got[1], endpoint)
                    metrics.kv_batches.labels(worker_id).inc(len(got[1]))
                    # From here on a batch the SUB missed while joining is a gap.
                    expected = got[0] + len(got[1])
                    window = {got[0] + i: b.ts for i, b in enumerate(got[1])}
                    self.router.kv_attach(worker_id)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    raise ConnectionError(
                        "the publisher's connection was dropped (it went away, or sent a "
                        f"message over kv.max_message_bytes = {self.config.max_message_bytes})"
                    )
                messages: list[list[bytes]] = []
                # What is queued already, up to one read's worth.
                while len(messages) < self.config.apply_batch and (
                    sub.getsockopt(zmq.EVENTS) & zmq.POLLIN
                ):
                    messages.append(await sub.recv_multipart(copy=True))
                batches: list[Batch] = []
                for frames in messages:
                    try:
                        frame = decode_frames(frames)
                    except KvEventError:
                        # Its events are lost: start the worker afresh from the next.
                        metrics.kv_errors.labels(worker_id).inc()
                        batches.clear()
                        self.router.kv_clear(worker_id)
                        expected, window = None, {}
                        continue
                    if frame.seq == PUBLISHER_LOST:
                        # What the monitor says of a direct connection: start again.
                        raise ConnectionError("the relay lost the publisher's connection")
                    if frame.batch is None:
                        continue
                    seq = frame.seq
                    if expected is not None and seq < expected:
                        if window.get(seq) == frame.batch.ts:
                            continue  # already applied from the first replay
                        metrics.kv_gaps.labels(worker_id, "restart").inc()
                        log.info("kv events: %s restarted its publisher", worker_id)
                        batches.clear()
                        self.router.kv_clear(worker_id)
                    elif expected is not None and seq > expected:
                        await self._gap(worker_id, replay, batches, expected, seq, topic)
                    window = {}
                    batches.append(frame.batch)
                    expected = seq + 1
                if batches:
                    if await self._apply(worker_id, batches, endpoint):
                        metrics.kv_silent.labels(worker_id).set(0)
                        log.info("kv events: %s publishes again", worker_id)
                    metrics.kv_batches.labels(worker_id).inc(len(batches))
                    age = metrics.kv_age.labels(worker_id)
                    # vLLM stamps a batch with time.time() as it publishes a step's
                    # events (0.32, vllm/v1/core/sched/scheduler.py, update_from_output:
                    # KVEventBatch(ts=time.time(), events=events)).
                    now = time.time()
                    for batch in batches:
                        # A clock behind the engine's reads as fresh, not negative.
                        age.observe(max(0.0, now - batch.ts))
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _apply(self, worker_id: str, batches: list[Batch], endpoint: str) -> bool:
        """``batches`` into the index, at most ``kv.apply_blocks`` blocks per hold of
        the routing lock. True when the worker's publisher had been silent."""
        heard = False
        for i, run in enumerate(split(batches, self.config.apply_blocks)):
            if i:
                await asyncio.sleep(0)  # the routing lock is free between pieces
            heard = self.router.kv_apply(worker_id, run, endpoint) or heard
        return heard

    async def _gap(
        self,
        worker_id: str,
        replay: str | None,
        batches: list[Batch],
        start: int,
        end: int,
        topic: bytes | None,
    ) -> None:
        """Batches ``start`` to ``end - 1`` were missed: replay them, or forget."""
        if replay is not None:
            got = await self._replay(replay, start, end, topic)
            if got is not None and got[0] == start and got[0] + len(got[1]) == end:
                batches.extend(got[1])
                self.router.metrics.kv_gaps.labels(worker_id, "replayed").inc()
                return
        self.router.metrics.kv_gaps.labels(worker_id, "cleared").inc()
        log.info(
            "kv events: %s missed batches %d-%d; its entries are rebuilt", worker_id, start, end - 1
        )
        batches.clear()
        self.router.kv_clear(worker_id)

    async def _replay(
        self, endpoint: str, start: int, end: int, topic: bytes | None = None
    ) -> tuple[int, list[Batch]] | None:
        """The batches from ``start`` (or the first the publisher still has after it)
        to ``end - 1``, in order and without a hole: (the first's number, them).
        None when the replay fails, times out or has a hole. ``topic``: asked of a
        relay, which engine's (:mod:`meshkit.lifecycle.kv_relay`)."""
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        first: int | None = None
        got: list[Batch] = []
        try:
            dealer.connect(endpoint)
            async with asyncio.timeout(self.config.replay_timeout_s):
                # vLLM's ROUTER reads [identity, b"", seq]: a DEALER sends the empty
                # delimiter itself and receives it back before each reply.
                request = [b"", replay_request(start)]
                await dealer.send_multipart(request if topic is None else [*request, topic])
                while True:
                    frame = decode_replay(await dealer.recv_multipart())
                    if frame.seq == PUBLISHER_LOST:
                        return None  # a relay that kept nothing of this engine
                    if frame.seq == END_OF_REPLAY or frame.seq >= end:
                        break
                    if frame.batch is None or frame.seq < start:
                        continue
                    if first is None:
                        first = frame.seq
                    elif frame.seq != first + len(got):
                        return None
                    got.append(frame.batch)
        except (TimeoutError, KvEventError, zmq.ZMQError):
            return None
        finally:
            dealer.close(linger=0)
        # An empty answer is an answer: nothing from ``start`` on was published yet.
        return (first if first is not None else start, got)
