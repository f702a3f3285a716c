"""
The KV-event relay
==================

``meshkit kv-relay``: one ZeroMQ subscription per engine, for any number of routers.

Every router subscribes to the publisher of every worker it routes to
(:mod:`meshkit.lifecycle.kv`), so an engine sends each batch once per router
process. With hundreds of them (SDK clients on ``MeshTransport``, app replicas on
``MeshMiddleware``, gateway children) that is the engine host's egress and its
publisher's CPU (``benchmarks/kv_fanout.py``). The relay subscribes once to each
publisher and republishes on one PUB socket, each message under
:func:`~meshkit.core.kv_events.relay_topic` of the engine's endpoint in place of
the engine's own topic; a router with ``[kv] relay`` subscribes there to its own
workers' topics only (ZeroMQ filters on the relay's side). Sequence numbers and
payloads pass as they came (neither decoded nor copied), so a router handles gaps
and restarts as it does on a direct connection:

* a router that falls ``kv_relay.send_hwm`` messages behind has messages dropped by
  ZeroMQ (the relay never waits for it): it sees a gap, which it has replayed (by the
  relay, below, or the engine's ``kv_replay``) or forgets;
* an engine connection that drops (the engine went away, or sent a message over
  ``kv.max_message_bytes``, after which libzmq would never connect again) is opened
  afresh and announced as ``[topic, PUBLISHER_LOST, b""]``: each router drops that
  worker's entries and subscribes again, as after its own dropped connection;
* a message that is not ``[topic, seq, payload]`` is counted, not forwarded.

Replays: the relay keeps each engine's newest messages, up to
``kv_relay.replay_bytes``, and answers on ``kv_relay.replay_bind`` as an engine's
ROUTER does, a DEALER asking ``[b"", start_seq, topic]`` (the topic added, for
which engine): ``[b"", topic, seq, payload]`` per kept message from ``start_seq``,
then the end marker; with nothing kept for that engine and no word from its own
replay, ``[b"", topic, PUBLISHER_LOST, b""]`` first (it does not know, where an
empty answer would say nothing was published). A router with ``[kv] relay_replay``
asks there when it joins and on a gap, so hundreds of routers starting at once do
not each ask every engine. On connecting to an engine whose worker names ``kv_replay``, the relay
asks it once for what it still buffers (once its subscription holds, so that no
batch falls between the two) and holds the routers' requests for that engine until
the answer is in, at most ``kv.replay_timeout_s`` (up to ``kv_relay.send_hwm``
requests). What it keeps goes
when the engine restarts (its numbers go back) or its connection is lost.

Its own gaps: a batch the relay itself missed (its subscription more than
``kv.receive_hwm`` behind, or dropped on the way) would be missed by every router
behind it, and each would drop that worker's entries. So when an engine's numbers
jump, the relay asks that engine's replay (when its worker names ``kv_replay``) for
what came after the last one it took, holds the routers' requests for that engine
as on joining, and keeps what the answer fills in: the routers, which see the same
jump, get the missing batches from the relay's replay. A jump while such a request
is out is checked against the same answer. Counted as
``mesh_kv_relay_gaps_total{publisher,outcome}``: ``filled``, or ``unfilled`` (no
replay endpoint, the engine no longer had them, or no answer within
``kv.replay_timeout_s``): the routers then handle the gap as on a direct connection.

Bounded: ``kv.receive_hwm`` messages queued per engine, each at most
``kv.max_message_bytes``; ``kv_relay.send_hwm`` per router; ``kv_relay.replay_bytes``
kept per engine (replies share the kept frames, not copies). One thread, one poll
loop; nothing here is on a request's path.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from meshkit.config import (
    KvConfig,
    KvRelayConfig,
    MeshConfig,
    load_workers_file,
    publisher_endpoints,
)
from meshkit.core.discovery import FleetSources
from meshkit.core.kv_events import END_OF_REPLAY, PUBLISHER_LOST, relay_topic, replay_request
from meshkit.core.workers import zmq_endpoint
from meshkit.errors import ConfigError
from meshkit.lifecycle.discovery import look_up
from meshkit.lifecycle.kv import subscriber

__all__ = ["KvRelay", "RelayFleet", "follow_fleet", "relay_registry"]

log = logging.getLogger("meshkit.kv_relay")

_LOST = PUBLISHER_LOST.to_bytes(8, "big", signed=True)
_END = END_OF_REPLAY.to_bytes(8, "big", signed=True)
#: bytes a kept message is counted for besides its payload (frames, tuple)
_KEPT_OVERHEAD = 200
#: messages read from one engine before the loop turns to the others
_TURN = 256
_POLL_MS = 200
#: after connecting, how long an idle engine's subscription is given to hold before
#: its replay is asked (a live message asks at once)
_SETTLE_S = 0.2


class RelayFleet:
    """The publishers to relay, found as the routers find their workers: the
    config's workers, its ``dns://`` entries and its ``workers_file``
    (:class:`~meshkit.core.discovery.FleetSources`, looked up and read again by
    :meth:`refresh`), then ``kv_relay.publishers`` and ``extra``. A lookup or a
    read that fails keeps what it last found, as the routers' discovery does."""

    def __init__(self, config: MeshConfig, extra: Iterable[str] = ()) -> None:
        """:raises ConfigError: an ``extra`` entry is not ``EVENTS[,REPLAY]`` (named
        ``--publisher``, the flag it comes from)."""
        self.config = config
        self.extra = tuple(extra)
        #: kv_relay.publishers and extra: {events endpoint: replay endpoint}
        self.listed = publisher_endpoints(config.kv_relay.publishers, "kv_relay.publishers")
        for endpoint, replay in publisher_endpoints(self.extra, "--publisher").items():
            self.listed[endpoint] = self.listed.get(endpoint) or replay
        self.sources = FleetSources(config.discovery.max_addresses)
        self.sources.configure(config.workers, config.dns_workers)
        if config.workers_file:
            self.sources.set_file(
                *load_workers_file(config.workers_file, config.discovery.max_file_bytes)
            )

    @property
    def interval_s(self) -> float:
        """How often :meth:`refresh` is due (the routers' ``lifecycle.health_interval_s``)."""
        return max(0.05, self.config.lifecycle.health_interval_s)

    def publishers(self) -> dict[str, str | None]:
        """Each endpoint once, with its replay endpoint when a worker names one."""
        seen: dict[str, str | None] = {}
        for w in self.sources.desired():
            if w.kv_events:
                seen[w.kv_events] = seen.get(w.kv_events) or w.kv_replay
        for endpoint, replay in self.listed.items():
            seen[endpoint] = seen.get(endpoint) or replay
        return seen

    async def refresh(self) -> None:
        """Look the names up (at most ``discovery.resolve_timeout_s``) and read the
        workers file again."""
        cfg = self.config.discovery
        if self.config.workers_file:
            try:
                self.sources.set_file(
                    *load_workers_file(self.config.workers_file, cfg.max_file_bytes)
                )
            except ConfigError as exc:
                log.warning("kv relay: %s; keeping its last workers", exc)
        found = await look_up(self.sources.names(), cfg.resolve_timeout_s)
        for name, addresses in found.items():
            if isinstance(addresses, str):
                log.warning(
                    "kv relay: dns://%s: lookup failed (%s); keeping its last", name, addresses
                )
            else:
                self.sources.set_addresses(name, addresses)


def follow_fleet(
    relay: KvRelay,
    fleet: RelayFleet,
    stop: threading.Event,
    reload: threading.Event,
    load: Callable[[], MeshConfig],
) -> None:
    """Keep ``relay``'s publishers those of ``fleet`` until ``stop`` (run it on a
    thread of its own: lookups and reads block). Every ``fleet.interval_s`` the
    names are looked up and the workers file read again; when ``reload`` is set,
    the config is loaded anew (``load``: a :class:`ConfigError` keeps the fleet).
    One event loop for the thread's life: a lookup that outlives its timeout keeps
    a resolver thread, not the next refresh, waiting."""
    with asyncio.Runner() as runner:
        while not stop.is_set():
            reload.wait(fleet.interval_s)
            if stop.is_set():
                return
            before = fleet.publishers()
            if reload.is_set():
                reload.clear()
                try:
                    fleet = RelayFleet(load(), fleet.extra)
                except ConfigError as exc:
                    log.error("reload refused, the publishers stay: %s", exc)
                    continue
                log.info("reload: the workers read again")
            runner.run(fleet.refresh())
            after = fleet.publishers()
            if after != before:
                relay.request(after)


class _Kept:
    """Messages ``(seq, seq frame, payload frame)``, newest last, within ``limit``
    bytes (the oldest go first)."""

    __slots__ = ("items", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.items: deque[tuple[int, Any, Any]] = deque()
        self.limit = limit
        self.size = 0

    def add(self, seq: int, seq_frame: Any, payload: Any) -> None:
        self.items.append((seq, seq_frame, payload))
        self.size += len(payload) + _KEPT_OVERHEAD
        while self.size > self.limit:
            _, _, old = self.items.popleft()
            self.size -= len(old) + _KEPT_OVERHEAD

    def clear(self) -> None:
        self.items.clear()
        self.size = 0


class _Source:
    """One engine's subscription: its socket, its monitor, what it has done."""

    __slots__ = (
        "ask_at",
        "asked_from",
        "connected",
        "deadline",
        "dealer",
        "endpoint",
        "filled",
        "forwarded",
        "holes",
        "joining",
        "kept",
        "known",
        "last_seq",
        "lost",
        "malformed",
        "monitor",
        "replay",
        "sock",
        "topic",
        "unfilled",
        "waiting",
    )

    def __init__(self, endpoint: str, replay: str | None, limit: int) -> None:
        self.endpoint = endpoint
        self.replay = replay
        self.topic = relay_topic(endpoint)
        self.sock: Any = None
        self.monitor: Any = None
        #: the engine's own replay, asked on connecting or on a gap: the socket,
        #: what it sent so far, until when it may take, from which number, and the
        #: routers' requests held meanwhile
        self.dealer: Any = None
        self.joining: _Kept | None = None
        self.ask_at: float | None = None
        self.asked_from = 0
        self.deadline = 0.0
        self.waiting: list[tuple[bytes, int]] = []
        self.connected = False
        self.forwarded = 0
        self.lost = 0
        self.malformed = 0
        #: the newest messages, for replays
        self.kept = _Kept(limit)
        self.last_seq = -1
        #: the engine's replay answered since the relay connected: what is kept is
        #: its whole buffer and what came since, even when that is nothing
        self.known = False
        #: the numbers the relay missed since the engine's replay was asked (first,
        #: end, how many jumps), and the jumps filled in or not so far
        self.holes: tuple[int, int, int] | None = None
        self.filled = 0
        self.unfilled = 0

    def keep(self, seq: int, seq_frame: Any, payload: Any) -> int | None:
        """Keep a live message; the first number missed before it, on a jump."""
        missed = None
        if seq <= self.last_seq:
            self.forget()  # the numbers went back: a restarted engine's history
        elif self.last_seq >= 0 and seq > self.last_seq + 1:
            missed = self.last_seq + 1
            if self.holes is None:
                self.holes = (missed, seq, 1)
            else:
                self.holes = (min(self.holes[0], missed), seq, self.holes[2] + 1)
        self.last_seq = seq
        self.kept.add(seq, seq_frame, payload)
        return missed

    def settle_holes(self) -> None:
        """Count the jumps as filled if every number they missed is now kept."""
        if self.holes is None:
            return
        first, end, jumps = self.holes
        have = {item[0] for item in self.kept.items}
        if all(seq in have for seq in range(first, end)):
            self.filled += jumps
        else:
            self.unfilled += jumps
        self.holes = None

    def merge(self) -> None:
        """The engine's replay in front of what came live since (live wins a tie)."""
        joined = self.joining.items if self.joining is not None else ()
        combined = {item[0]: item for item in joined}
        combined.update((item[0], item) for item in self.kept.items)
        self.kept.clear()
        for item in sorted(combined.values(), key=lambda item: item[0]):
            self.kept.add(*item)
        if self.kept.items:
            self.last_seq = max(self.last_seq, self.kept.items[-1][0])

    def forget(self) -> None:
        self.kept.clear()
        self.last_seq = -1
        self.known = False
        if self.holes is not None:
            self.unfilled += self.holes[2]
            self.holes = None


def followable(endpoint: str) -> bool:
    """Whether a router's subscription names an engine the relay may connect to: a
    ZeroMQ endpoint as a worker's ``kv_events`` is checked, and tcp only (a router
    does not get to open the relay host's ipc paths)."""
    try:
        checked = zmq_endpoint("kv_relay", endpoint)
    except ConfigError:
        return False
    return checked == endpoint and endpoint.startswith("tcp://")


class KvRelay:
    """The relay (module docstring). ``serve`` runs it until ``stop`` is set;
    ``endpoint`` is where routers subscribe (the port picked, for ``:*``)."""

    def __init__(
        self,
        publishers: Mapping[str, str | None],
        relay: KvRelayConfig,
        kv: KvConfig,
    ) -> None:
        if not publishers and not relay.follow_routers:
            raise ConfigError(
                "kv_relay.publishers",
                "no publisher to relay: name workers with kv_events, or publishers "
                "(or let the relay follow what routers ask: kv_relay.follow_routers)",
            )
        import zmq

        self._zmq = zmq
        self.kv = kv
        self._ctx = zmq.Context()
        # XPUB: a PUB that also reads the routers' subscriptions, the first to each
        # topic and the last one's end (ZeroMQ folds the rest).
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, relay.send_hwm)
        #: the publishers listed (config, discovery, flags), and those only routers name
        self._listed: dict[str, str | None] = dict(publishers)
        self._asked: dict[str, None] = {}
        self._follow = relay.follow_routers
        self._max_followed = relay.max_followed
        #: routers' subscriptions refused (not a tcp endpoint, or past max_followed)
        self.refused = 0
        try:
            self._pub.bind(relay.bind)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._replays: Any = None
        self.replay_endpoint: str | None = None
        #: replay requests answered
        self.replays = 0
        self._limit = relay.replay_bytes
        if relay.replay_bind:
            self._replays = self._ctx.socket(zmq.ROUTER)
            self._replays.setsockopt(zmq.LINGER, 0)
            # Replies share the kept frames: no limit of their own, and never a
            # reply silently cut short (a hole the router would take as a failure).
            self._replays.setsockopt(zmq.SNDHWM, 0)
            self._replays.setsockopt(zmq.MAXMSGSIZE, 1024)
            try:
                self._replays.bind(relay.replay_bind)
            except zmq.ZMQError:
                self._ctx.destroy(linger=0)
                raise
            self.replay_endpoint = self._replays.getsockopt_string(zmq.LAST_ENDPOINT)
            self._poller.register(self._replays, zmq.POLLIN)
        self._poller.register(self._pub, zmq.POLLIN)
        self._by_socket: dict[Any, _Source] = {}
        #: publishers for :meth:`serve` to switch to (:meth:`request`)
        self._pending: queue.SimpleQueue[Mapping[str, str | None]] = queue.SimpleQueue()
        self.sources = [
            _Source(endpoint, replay, self._limit) for endpoint, replay in publishers.items()
        ]
        self._hold = relay.send_hwm
        self._by_topic = {source.topic: source for source in self.sources}
        for source in self.sources:
            self._open(source)

    def _open(self, source: _Source) -> None:
        zmq = self._zmq
        sock = subscriber(self._ctx, self.kv, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(source.endpoint)
        source.sock, source.monitor = sock, monitor
        for s in (sock, monitor):
            self._poller.register(s, zmq.POLLIN)
            self._by_socket[s] = source

    def _join(self, source: _Source) -> None:
        """Connected: hold the routers' replays for this engine until its own
        replay is in. It is asked once the subscription surely holds (a first live
        message, or a short settle on an idle engine), so that no batch falls
        between what the engine replays and what comes live."""
        if source.replay is None or self._replays is None or source.joining is not None:
            return
        self._expect(source, 0, time.monotonic() + _SETTLE_S)

    def _expect(self, source: _Source, start: int, ask_at: float) -> None:
        """The engine's replay from ``start`` is to be asked at ``ask_at`` (and in
        within ``kv.replay_timeout_s`` of it); the routers' requests wait for it."""
        source.joining = _Kept(self._limit)
        source.asked_from = start
        source.ask_at = ask_at
        source.deadline = ask_at + self.kv.replay_timeout_s

    def _fill(self, source: _Source, missed: int) -> None:
        """The engine's numbers jumped past ``missed``: ask its replay from there
        (routers that ask meanwhile wait, as on joining), unless a request is out."""
        if source.joining is not None:
            return  # the answer to that one is checked against this jump too
        if source.replay is None:
            source.settle_holes()  # nothing to ask: unfilled
            return
        log.warning(
            "kv relay: missed batches of %s from %d; asking its replay", source.endpoint, missed
        )
        self._expect(source, missed, time.monotonic())
        self._ask(source)

    def _ask(self, source: _Source) -> None:
        zmq = self._zmq
        assert source.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.kv.max_message_bytes)
        dealer.connect(source.replay)
        dealer.send_multipart([b"", replay_request(source.asked_from)])
        source.dealer, source.ask_at = dealer, None
        self._poller.register(dealer, zmq.POLLIN)
        self._by_socket[dealer] = source

    def _joined(self, source: _Source, complete: bool) -> None:
        """The engine's replay ended (``complete``) or failed: keep it or not, and
        answer the routers that asked meanwhile."""
        if source.dealer is not None:
            self._poller.unregister(source.dealer)
            self._by_socket.pop(source.dealer, None)
            source.dealer.close(linger=0)
        if complete:
            source.merge()
            # Only an answer from 0 is the engine's whole buffer.
            source.known = source.known or source.asked_from == 0
        source.settle_holes()
        source.dealer, source.joining, source.ask_at = None, None, None
        waiting, source.waiting = source.waiting, []
        for ident, start in waiting:
            self._reply(ident, source.topic, source, start)

    def _on_engine_replay(self, source: _Source) -> None:
        zmq = self._zmq
        for _ in range(_TURN):
            if source.joining is None:
                return
            try:
                frames = source.dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            # [b"", topic, seq, payload] (vLLM 0.32) or [b"", seq, payload]
            body = frames[1:] if frames and not len(frames[0]) else frames
            if len(body) not in (2, 3) or len(body[-2]) != 8:
                self._joined(source, False)  # not a replay: keep nothing of it
                return
            seq = int.from_bytes(body[-2].bytes, "big", signed=True)
            if seq == END_OF_REPLAY:
                self._joined(source, True)
                return
            source.joining.add(seq, body[-2], body[-1])  # the newest, as kept

    def _close(self, source: _Source) -> None:
        if source.joining is not None:
            self._joined(source, False)
        for s in (source.monitor, source.sock):
            if s is not None:
                self._poller.unregister(s)
                self._by_socket.pop(s, None)
        if source.sock is not None:
            source.sock.disable_monitor()
            source.monitor.close(linger=0)
            source.sock.close(linger=0)
        source.sock = source.monitor = None

    def request(self, publishers: Mapping[str, str | None]) -> None:
        """(any thread) :meth:`serve` switches to these publishers at its next turn
        (and those routers ask for, :meth:`_on_subscriptions`)."""
        self._pending.put(dict(publishers))

    def _wanted(self) -> dict[str, str | None]:
        return {**self._asked, **self._listed}

    def _on_subscriptions(self) -> None:
        """Routers' subscriptions: an engine no one listed that a router subscribes
        to is followed (tcp endpoints, up to ``kv_relay.max_followed``) until the
        last router to it unsubscribes."""
        zmq = self._zmq
        changed = False
        for _ in range(_TURN):
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not self._follow or len(msg) < 3 or msg[-1:] != b"\0":
                continue  # a router's whole-socket subscription, or not a relay topic
            try:
                endpoint = msg[1:-1].decode("utf-8")
            except UnicodeDecodeError:
                self.refused += 1
                continue
            if msg[0] == 0:
                if endpoint in self._asked:
                    del self._asked[endpoint]
                    changed = True
            elif endpoint not in self._listed and endpoint not in self._asked:
                if not followable(endpoint):
                    self.refused += 1
                elif len(self._asked) >= self._max_followed:
                    self.refused += 1
                    log.warning(
                        "kv relay: a router asked for %s past kv_relay.max_followed = %d; "
                        "not relayed",
                        endpoint,
                        self._max_followed,
                    )
                else:
                    self._asked[endpoint] = None
                    changed = True
        if changed:
            self.update(self._wanted())

    def update(self, publishers: Mapping[str, str | None]) -> None:
        """Relay these publishers from now on (on :meth:`serve`'s thread; from others,
        :meth:`request`): new ones are subscribed to, gone ones closed and announced
        lost (a router still routing to one starts again)."""
        want = dict(publishers)
        for source in list(self.sources):
            if source.endpoint not in want:
                self._pub.send_multipart([source.topic, _LOST, b""])
                self._close(source)
                self.sources.remove(source)
                del self._by_topic[source.topic]
                log.info("kv relay: no longer relaying %s", source.endpoint)
            else:
                source.replay = want[source.endpoint]
        known = {source.endpoint for source in self.sources}
        for endpoint, replay in want.items():
            if endpoint not in known:
                source = _Source(endpoint, replay, self._limit)
                self.sources.append(source)
                self._by_topic[source.topic] = source
                self._open(source)
                log.info("kv relay: relaying %s", endpoint)

    def serve(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set (checked every 0.2 s), switching publishers
        when :meth:`request` asks."""
        while not stop.is_set():
            pending = None
            while not self._pending.empty():
                pending = self._pending.get_nowait()  # the newest request wins
            if pending is not None:
                self._listed = dict(pending)
                self.update(self._wanted())
            for sock, _ in self._poller.poll(_POLL_MS):
                if sock is self._replays:
                    self._answer()
                    continue
                if sock is self._pub:
                    self._on_subscriptions()
                    continue
                source = self._by_socket.get(sock)
                if source is None:
                    continue  # closed earlier in this turn
                if sock is source.monitor:
                    self._on_monitor(source)
                elif sock is source.dealer:
                    self._on_engine_replay(source)
                else:
                    self._forward(source)
            now = time.monotonic()
            for source in self.sources:
                if source.joining is None:
                    continue
                if source.ask_at is not None and now >= source.ask_at:
                    self._ask(source)
                elif now > source.deadline:
                    log.warning("kv relay: %s's replay timed out", source.replay)
                    self._joined(source, False)

    def _forward(self, source: _Source) -> None:
        zmq = self._zmq
        for _ in range(_TURN):
            try:
                frames = source.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                source.malformed += 1
                continue
            # PUB never blocks: a router past send_hwm has this one dropped (a gap).
            self._pub.send_multipart([source.topic, frames[1], frames[2]], copy=False)
            source.forwarded += 1
            if source.ask_at is not None:
                self._ask(source)  # subscribed for sure: the replay ends where this began
            if self._replays is not None:
                seq = int.from_bytes(frames[1].bytes, "big", signed=True)
                missed = source.keep(seq, frames[1], frames[2])
                if missed is not None:
                    self._fill(source, missed)

    def _answer(self) -> None:
        """Replay requests: ``[identity, b"", start_seq, topic]`` each."""
        zmq = self._zmq
        for _ in range(_TURN):
            try:
                frames = self._replays.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 4 or frames[1] or len(frames[2]) != 8:
                continue  # not a relay replay request: no answer
            ident, _, start_frame, topic = frames
            start = int.from_bytes(start_frame, "big")
            source = self._by_topic.get(topic)
            if (
                source is not None
                and source.joining is not None
                and len(source.waiting) < self._hold
            ):
                source.waiting.append((ident, start))
                continue  # answered after the engine's replay
            self._reply(ident, topic, source, start)

    def _reply(self, ident: bytes, topic: bytes, source: _Source | None, start: int) -> None:
        if source is None or not (source.kept.items or source.known):
            # Nothing kept is not "nothing published" unless the engine said so:
            # else the router would take the engine's next number for a gap from 0.
            self._replays.send_multipart([ident, b"", topic, _LOST, b""])
        else:
            for seq, seq_frame, payload in list(source.kept.items):
                if seq >= start:
                    self._replays.send_multipart(
                        [ident, b"", topic, seq_frame, payload], copy=False
                    )
        self._replays.send_multipart([ident, b"", b"", _END, b""])
        self.replays += 1

    def _on_monitor(self, source: _Source) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        lost = False
        while True:
            try:
                event = recv_monitor_message(source.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_CONNECTED:
                source.connected = True
                log.info("kv relay: connected to %s", source.endpoint)
                self._join(source)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                lost = True
        if not lost:
            return
        source.connected = False
        source.lost += 1
        source.forget()
        log.warning("kv relay: lost %s; its routers start again", source.endpoint)
        self._pub.send_multipart([source.topic, _LOST, b""])
        # A fresh socket: after a message over MAXMSGSIZE libzmq never reconnects.
        self._close(source)
        self._open(source)

    def close(self) -> None:
        for source in self.sources:
            self._close(source)
        if self._replays is not None:
            self._replays.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.destroy(linger=0)


def relay_registry(relay: KvRelay) -> Any:
    """A Prometheus registry of the relay's counts, read when scraped (the loop
    only adds to plain ints): ``mesh_kv_relay_messages_total{publisher,outcome}``
    (``forwarded``, ``malformed``), ``mesh_kv_relay_lost_total{publisher}``,
    ``mesh_kv_relay_replays_total``, ``mesh_kv_relay_gaps_total{publisher,outcome}``
    (``filled``, ``unfilled``), ``mesh_kv_relay_refused_total`` and
    ``mesh_kv_relay_connected{publisher}``."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Counts:
        def collect(self) -> Iterable[Any]:
            messages = CounterMetricFamily(
                "mesh_kv_relay_messages",
                "Engine messages the relay took: forwarded, or malformed (not "
                "[topic, seq, payload]) and dropped",
                labels=["publisher", "outcome"],
            )
            lost = CounterMetricFamily(
                "mesh_kv_relay_lost",
                "Engine connections the relay lost (each announced to the routers)",
                labels=["publisher"],
            )
            replays = CounterMetricFamily(
                "mesh_kv_relay_replays",
                "Replay requests the relay answered (routers joining, or filling a gap)",
            )
            replays.add_metric([], relay.replays)
            refused = CounterMetricFamily(
                "mesh_kv_relay_refused",
                "Routers' subscriptions to an engine the relay does not list that it "
                "did not follow (not a tcp endpoint, or past kv_relay.max_followed)",
            )
            refused.add_metric([], relay.refused)
            gaps = CounterMetricFamily(
                "mesh_kv_relay_gaps",
                "Jumps in an engine's sequence numbers the relay saw: filled from the "
                "engine's replay, or unfilled (its routers each handle the gap)",
                labels=["publisher", "outcome"],
            )
            connected = GaugeMetricFamily(
                "mesh_kv_relay_connected",
                "1 while the relay is connected to the engine's publisher",
                labels=["publisher"],
            )
            for source in list(relay.sources):
                messages.add_metric([source.endpoint, "forwarded"], source.forwarded)
                messages.add_metric([source.endpoint, "malformed"], source.malformed)
                lost.add_metric([source.endpoint], source.lost)
                gaps.add_metric([source.endpoint, "filled"], source.filled)
                gaps.add_metric([source.endpoint, "unfilled"], source.unfilled)
                connected.add_metric([source.endpoint], int(source.connected))
            yield messages
            yield lost
            yield replays
            yield refused
            yield gaps
            yield connected

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Counts())
    return registry
