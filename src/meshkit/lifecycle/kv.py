"""
KV-event subscribers
====================

One task per worker that names a publisher (``Worker(kv_events=...)``), on the
lifecycle thread's loop: a ZeroMQ SUB socket connected to the engine's publisher
(all topics), or with ``kv.relay`` to ``meshkit kv-relay`` (the engine's topic
there, :mod:`meshkit.lifecycle.kv_relay`; with several relays, to the next when
the one in use is lost: :meth:`KvSubscribers._take`), each message decoded
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
  so) and it is started again like one that failed; so does a publisher that
  answers none of ZeroMQ's heartbeats for ``kv.heartbeat_s`` (a host gone without
  closing its connections); together with
  ``kv.receive_hwm`` this bounds what a publisher can make a subscriber queue;
* a worker that leaves the fleet, or names another publisher, has its task
  cancelled and its entries dropped (:meth:`Fleet.remove` / ``Fleet.replace``).

The tasks follow the fleet: :meth:`KvSubscribers.sync` runs every second and on a
fleet change; a task that ended on an error is started again there (the worker's
entries dropped, then replayed or rebuilt; when it was every relay that went, not
the engine, the worker is matched on the approximate tree until its events come
again: its engine's cache is unknown, not empty). Nothing here is on a request's path: a
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
from meshkit.core.kv_stream import BatchStream
from meshkit.core.workers import Worker
from meshkit.errors import ConfigError

if TYPE_CHECKING:
    from meshkit.config import KvConfig
    from meshkit.router import Router

__all__ = ["KvSubscribers", "require_zmq", "subscriber"]

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


def subscriber(ctx: Any, config: KvConfig, topic: bytes) -> Any:
    """A SUB socket of ``ctx`` to a publisher or a relay, bounded by ``config``
    (``kv.receive_hwm`` messages of at most ``kv.max_message_bytes``), not yet
    connected. The routers' subscribers and the relay's take theirs from here."""
    import zmq

    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, config.receive_hwm)
    sub.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    if config.heartbeat_s:
        # ZMTP pings (libzmq >= 4.2): a peer that stops answering (a host gone
        # without closing its connections, a stopped process) drops the
        # connection, which the monitor reports like any other.
        ms = max(1, int(config.heartbeat_s * 1000))
        sub.setsockopt(zmq.HEARTBEAT_IVL, max(1, ms // 3))
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
        # Pings start after the handshake: a peer that accepts the connection and
        # then answers nothing would otherwise hold it for libzmq's 30 s default.
        sub.setsockopt(zmq.HANDSHAKE_IVL, ms)
    return sub


class _Lost(Exception):
    """The source of a worker's events is gone; ``engine``: a relay said it lost
    the engine's connection (it went away, or restarted)."""

    def __init__(self, reason: str, *, engine: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.engine = engine


class _RelayGone(ConnectionError):
    """Every relay of a worker was lost (not the engine): see :meth:`KvSubscribers.sync`."""


class _Source:
    """One place a worker's events come from: where the SUB connects, what it
    subscribes to (all, or a relay's topic for the engine), where replays are
    asked and with which topic (a relay's replay endpoint needs it); ``others``:
    the other relays' replay endpoints, asked for a gap this one cannot fill."""

    __slots__ = ("connect", "engine", "others", "replay", "subscribe", "topic")

    def __init__(
        self, connect: str, replay: str | None, topic: bytes | None, subscribe: bytes
    ) -> None:
        self.connect = connect
        self.replay = replay
        self.topic = topic
        self.subscribe = subscribe
        self.others: tuple[str, ...] = ()
        #: a relay's: the engine's own replay endpoint (the worker's kv_replay)
        self.engine: str | None = None


class _Followed(BatchStream):
    """A worker's :class:`BatchStream` as its subscriber follows it: also how many
    reads brought batches (a move to another relay tells by it whether the one
    before was heard from)."""

    __slots__ = ("heard",)

    def __init__(self, trail: int) -> None:
        super().__init__(trail)
        self.heard = 0

    def clear(self, router: Router, worker_id: str) -> None:
        router.kv_clear(worker_id)
        self.reset()


class KvSubscribers:
    """The subscriber tasks of one Mesh (see the module docstring)."""

    def __init__(self, router: Router, config: KvConfig) -> None:
        self.router = router
        self.config = config
        self._tasks: dict[_Key, asyncio.Task[None]] = {}
        self._ctx: Any = None
        self._poke: asyncio.Event | None = None
        self._warned = False
        #: relays left since a batch last came through them: one warning per
        #: relay lost, not one per worker (bounded by the kv.relay list)
        self._left: set[str] = set()

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
                if not task.cancelled() and isinstance(task.exception(), _RelayGone):
                    self.router.kv_detach(key[0])
                else:
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

    def _sources(self, endpoint: str, replay: str | None) -> list[_Source]:
        """Where ``endpoint``'s events come from, in the order tried: the engine
        itself, or each ``kv.relay`` (its replay endpoint, else the engine's)."""
        relays = self.config.relays
        if not relays:
            return [_Source(endpoint, replay, None, b"")]
        topic = relay_topic(endpoint)
        replays = self.config.relay_replays
        if not replays:
            return [_Source(relay, replay, None, topic) for relay in relays]
        sources = [
            _Source(relay, rep, topic, topic) for relay, rep in zip(relays, replays, strict=True)
        ]
        for i, source in enumerate(sources):
            source.others = replays[i + 1 :] + replays[:i]
            source.engine = replay
        return sources

    async def _follow(self, worker_id: str, endpoint: str, replay: str | None) -> None:
        """Follow the worker's publisher, through its relays in turn: when the one
        in use goes away or says it lost the engine, the next takes over
        (:meth:`_take`). Ends (the worker's entries then dropped by :meth:`sync`)
        when the only source is lost, or when every relay in a row is lost before
        one is heard from."""
        sources = self._sources(endpoint, replay)
        stream = _Followed(self.config.trail_batches)
        turn = unheard = 0
        moved: _Lost | None = None
        while True:
            i = turn % len(sources)
            heard = stream.heard
            try:
                await self._take(worker_id, endpoint, sources[i], stream, moved)
            except _Lost as exc:
                # A relay gone says nothing of the engine (its cache is likely whole):
                # the worker is matched on this router's tree until events come again.
                # A lost engine (or its only connection) may have restarted: it holds
                # nothing until its events say otherwise.
                gone = _RelayGone if sources[i].subscribe and not exc.engine else ConnectionError
                if len(sources) == 1:
                    raise gone(exc.reason) from None
                unheard = 0 if stream.heard != heard else unheard + 1
                if unheard >= len(sources):
                    raise gone(f"no relay answers ({exc.reason})") from None
                turn, moved = turn + 1, exc
                left, to = sources[i].connect, sources[turn % len(sources)].connect
                if left in self._left:
                    log.info("kv events: %s's events move to the relay at %s", worker_id, to)
                else:
                    self._left.add(left)
                    log.warning(
                        "kv events: the relay at %s (%s); the events of its workers move "
                        "to the next relay (%s's to %s; the others' moves logged at info)",
                        left,
                        exc.reason,
                        worker_id,
                        to,
                    )

    async def _take(
        self,
        worker_id: str,
        endpoint: str,
        source: _Source,
        stream: _Followed,
        moved: _Lost | None,
    ) -> None:
        """Apply what ``source`` carries of ``endpoint`` until it is lost (:class:`_Lost`).

        ``moved``: why the relay before this one was left. Numbers are the engine's
        whichever relay carries them (:class:`~meshkit.core.kv_stream.BatchStream`),
        so the stream goes on where it stood: this relay's replay endpoint is asked
        for what came after, and a batch it still carries that was taken already is
        a copy, skipped. A relay that cannot vouch for what came after (no such
        batches kept, it lost the engine too, or never knew it) has the worker's
        entries dropped; so has a move off a relay that lost the engine when there
        is no replay endpoint to ask (the engine may have restarted). Without
        those, a relay that went away is followed by the next as by one
        connection: a batch missed between them is a gap."""
        import zmq
        import zmq.asyncio

        config = self.config
        sub = subscriber(self._ctx, config, source.subscribe)
        # libzmq drops a connection that sent a message over MAXMSGSIZE and does
        # not connect again: the task ends, and sync() starts a new subscription.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(source.connect)
        relayed = source.subscribe != b""
        via = f" through the relay at {source.connect}" if relayed else ""
        log.info("kv events: subscribed to %s%s for %s", endpoint, via, worker_id)
        # With another relay to turn to, one not reached within kv.heartbeat_s is passed.
        reach = config.heartbeat_s if relayed and len(config.relays) > 1 else 0.0
        connected = False
        try:
            if moved is not None and stream.expected is not None:
                await self._move(worker_id, endpoint, source, stream, moved.engine)
            if stream.expected is None and source.replay is not None:
                # Subscribed first, then asked: what the publisher stored before
                # (or while) meshkit joined is not missed, even on an idle engine.
                got = await self._replay(source.replay, 0, _ALL, source.topic)
                if got is None and source.engine is not None:
                    # The relay kept nothing of it (it follows the engine since
                    # lately, or only since a router asked): the engine's own buffer.
                    got = await self._replay(source.engine, 0, _ALL)
                if got is not None:
                    await self._join(worker_id, endpoint, stream, got)
            while True:
                timeout = None if connected or not reach else reach * 1000
                ready = dict(await poller.poll(timeout))
                if not ready:
                    raise _Lost(f"not reached in kv.heartbeat_s = {reach:g} s")
                if monitor in ready:
                    connected = await self._connection(monitor, connected)
                    continue
                await self._read(worker_id, endpoint, source, stream, sub)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _join(
        self, worker_id: str, endpoint: str, stream: _Followed, got: tuple[int, list[Batch]]
    ) -> None:
        await self._apply(worker_id, got[1], endpoint)
        self.router.metrics.kv_batches.labels(worker_id).inc(len(got[1]))
        # From here on a batch the SUB missed while joining is a gap.
        stream.joined(got[0], got[1])
        self.router.kv_attach(worker_id)

    async def _move(
        self, worker_id: str, endpoint: str, source: _Source, stream: _Followed, engine: bool
    ) -> None:
        """Go on from ``stream.expected`` on ``source``, the relay moved to (see
        :meth:`_take`); ``engine``: the relay left had lost the engine."""
        assert stream.expected is not None
        moves = self.router.metrics.kv_relay_moves
        if source.replay is None:
            if engine:
                stream.clear(self.router, worker_id)
            moves.labels(worker_id, "cleared" if engine else "followed").inc()
            return
        got = await self._replay(source.replay, stream.expected, _ALL, source.topic)
        if got is not None and got[0] == stream.expected:
            await self._apply(worker_id, got[1], endpoint)
            self.router.metrics.kv_batches.labels(worker_id).inc(len(got[1]))
            stream.took_run(got[0], got[1])
            stream.heard += 1  # it answered
            moves.labels(worker_id, "replayed").inc()
            return
        moves.labels(worker_id, "cleared").inc()
        stream.clear(self.router, worker_id)
        if got is not None:  # what it has, from after a hole: as a first replay
            await self._join(worker_id, endpoint, stream, got)

    async def _connection(self, monitor: Any, connected: bool) -> bool:
        """Whether the subscription is connected, after the monitor's events."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = (await recv_monitor_message(monitor, zmq.NOBLOCK))["event"]
            if event == zmq.EVENT_DISCONNECTED:
                raise _Lost(
                    "the connection was dropped (the publisher went away, stopped "
                    "answering for kv.heartbeat_s, or sent a message over "
                    f"kv.max_message_bytes = {self.config.max_message_bytes})"
                )
            connected = connected or event == zmq.EVENT_CONNECTED
        return connected

    async def _read(
        self, worker_id: str, endpoint: str, source: _Source, stream: _Followed, sub: Any
    ) -> None:
        """What is queued on ``sub``, up to one read's worth, into the index."""
        import zmq

        metrics = self.router.metrics
        if self._left:
            self._left.discard(source.connect)  # back: its next loss is warned of again
        messages: list[list[bytes]] = []
        while len(messages) < self.config.apply_batch and (sub.getsockopt(zmq.EVENTS) & zmq.POLLIN):
            messages.append(await sub.recv_multipart(copy=True))
        batches: list[Batch] = []
        for frames in messages:
            try:
                frame = decode_frames(frames)
            except KvEventError:
                # Its events are lost: start the worker afresh from the next.
                metrics.kv_errors.labels(worker_id).inc()
                batches.clear()
                stream.clear(self.router, worker_id)
                continue
            if frame.seq == PUBLISHER_LOST:
                # What the monitor says of a direct connection: start again.
                await self._apply_read(worker_id, endpoint, stream, batches)
                raise _Lost("the relay lost the publisher's connection", engine=True)
            if frame.batch is None:
                continue
            seq = frame.seq
            expected = stream.expected
            if expected is not None and seq < expected:
                if stream.copy(seq, frame.batch.ts):
                    continue  # applied already (a replay's, or the relay before this one's)
                metrics.kv_gaps.labels(worker_id, "restart").inc()
                log.info("kv events: %s restarted its publisher", worker_id)
                batches.clear()
                stream.clear(self.router, worker_id)
            elif expected is not None and seq > expected:
                await self._gap(worker_id, source, stream, batches, expected, seq)
            batches.append(frame.batch)
            stream.took(seq, frame.batch.ts)
        await self._apply_read(worker_id, endpoint, stream, batches)

    async def _apply_read(
        self, worker_id: str, endpoint: str, stream: _Followed, batches: list[Batch]
    ) -> None:
        if not batches:
            return
        metrics = self.router.metrics
        stream.heard += 1
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
        source: _Source,
        stream: _Followed,
        batches: list[Batch],
        start: int,
        end: int,
    ) -> None:
        """Batches ``start`` to ``end - 1`` were missed: replay them (from the
        source's replay endpoint, else from the other relays'), or forget."""
        replays = () if source.replay is None else (source.replay, *source.others)
        for replay in replays:
            got = await self._replay(replay, start, end, source.topic)
            if got is not None and got[0] == start and got[0] + len(got[1]) == end:
                batches.extend(got[1])
                stream.took_run(start, got[1])
                self.router.metrics.kv_gaps.labels(worker_id, "replayed").inc()
                return
        self.router.metrics.kv_gaps.labels(worker_id, "cleared").inc()
        log.info(
            "kv events: %s missed batches %d-%d; its entries are rebuilt", worker_id, start, end - 1
        )
        batches.clear()
        stream.clear(self.router, worker_id)

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
