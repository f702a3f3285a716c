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
  ZeroMQ (the relay never waits for it): it sees a gap, which it has replayed by the
  worker's ``kv_replay`` endpoint (the engine) or forgets;
* an engine connection that drops (the engine went away, or sent a message over
  ``kv.max_message_bytes``, after which libzmq would never connect again) is opened
  afresh and announced as ``[topic, PUBLISHER_LOST, b""]``: each router drops that
  worker's entries and subscribes again, as after its own dropped connection;
* a message that is not ``[topic, seq, payload]`` is counted, not forwarded.

Bounded: ``kv.receive_hwm`` messages queued per engine, each at most
``kv.max_message_bytes``, and ``kv_relay.send_hwm`` per router. One thread, one
poll loop; nothing here is on a request's path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from meshkit.config import KvConfig, KvRelayConfig, MeshConfig
from meshkit.core.kv_events import PUBLISHER_LOST, relay_topic
from meshkit.errors import ConfigError

__all__ = ["KvRelay", "publishers_of", "relay_registry"]

log = logging.getLogger("meshkit.kv_relay")

_LOST = PUBLISHER_LOST.to_bytes(8, "big", signed=True)
#: messages read from one engine before the loop turns to the others
_TURN = 256
_POLL_MS = 200


def publishers_of(config: MeshConfig, extra: Iterable[str] = ()) -> list[str]:
    """The endpoints to relay: the workers' ``kv_events``, ``kv_relay.publishers``
    and ``extra``, each once, in that order."""
    seen: dict[str, None] = {}
    for w in config.workers:
        if w.kv_events:
            seen.setdefault(w.kv_events)
    for endpoint in (*config.kv_relay.publishers, *extra):
        seen.setdefault(endpoint)
    if any(d.kv_events for d in config.dns_workers):
        log.warning(
            "kv relay: dns:// workers' publishers are not relayed; "
            "list their endpoints in kv_relay.publishers"
        )
    return list(seen)


class _Source:
    """One engine's subscription: its socket, its monitor, what it has done."""

    __slots__ = (
        "connected",
        "endpoint",
        "forwarded",
        "lost",
        "malformed",
        "monitor",
        "sock",
        "topic",
    )

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.topic = relay_topic(endpoint)
        self.sock: Any = None
        self.monitor: Any = None
        self.connected = False
        self.forwarded = 0
        self.lost = 0
        self.malformed = 0


class KvRelay:
    """The relay (module docstring). ``serve`` runs it until ``stop`` is set;
    ``endpoint`` is where routers subscribe (the port picked, for ``:*``)."""

    def __init__(
        self,
        publishers: Sequence[str],
        relay: KvRelayConfig,
        kv: KvConfig,
    ) -> None:
        if not publishers:
            raise ConfigError(
                "kv_relay.publishers",
                "no publisher to relay: name workers with kv_events, or publishers",
            )
        import zmq

        self._zmq = zmq
        self.kv = kv
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, relay.send_hwm)
        try:
            self._pub.bind(relay.bind)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._by_socket: dict[Any, _Source] = {}
        self.sources = [_Source(endpoint) for endpoint in publishers]
        for source in self.sources:
            self._open(source)

    def _open(self, source: _Source) -> None:
        zmq = self._zmq
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.kv.receive_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.kv.max_message_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(source.endpoint)
        source.sock, source.monitor = sock, monitor
        for s in (sock, monitor):
            self._poller.register(s, zmq.POLLIN)
            self._by_socket[s] = source

    def _close(self, source: _Source) -> None:
        for s in (source.monitor, source.sock):
            if s is not None:
                self._poller.unregister(s)
                self._by_socket.pop(s, None)
        if source.sock is not None:
            source.sock.disable_monitor()
            source.monitor.close(linger=0)
            source.sock.close(linger=0)
        source.sock = source.monitor = None

    def serve(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set (checked every 0.2 s)."""
        while not stop.is_set():
            for sock, _ in self._poller.poll(_POLL_MS):
                source = self._by_socket.get(sock)
                if source is None:
                    continue  # closed earlier in this turn
                if sock is source.monitor:
                    self._on_monitor(source)
                else:
                    self._forward(source)

    def _forward(self, source: _Source) -> None:
        zmq = self._zmq
        for _ in range(_TURN):
            try:
                frames = source.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3:
                source.malformed += 1
                continue
            # PUB never blocks: a router past send_hwm has this one dropped (a gap).
            self._pub.send_multipart([source.topic, frames[1], frames[2]], copy=False)
            source.forwarded += 1

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
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                lost = True
        if not lost:
            return
        source.connected = False
        source.lost += 1
        log.warning("kv relay: lost %s; its routers start again", source.endpoint)
        self._pub.send_multipart([source.topic, _LOST, b""])
        # A fresh socket: after a message over MAXMSGSIZE libzmq never reconnects.
        self._close(source)
        self._open(source)

    def close(self) -> None:
        for source in self.sources:
            self._close(source)
        self._pub.close(linger=0)
        self._ctx.destroy(linger=0)


def relay_registry(relay: KvRelay) -> Any:
    """A Prometheus registry of the relay's counts, read when scraped (the loop
    only adds to plain ints): ``mesh_kv_relay_messages_total{publisher,outcome}``
    (``forwarded``, ``malformed``), ``mesh_kv_relay_lost_total{publisher}`` and
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
            connected = GaugeMetricFamily(
                "mesh_kv_relay_connected",
                "1 while the relay is connected to the engine's publisher",
                labels=["publisher"],
            )
            for source in list(relay.sources):
                messages.add_metric([source.endpoint, "forwarded"], source.forwarded)
                messages.add_metric([source.endpoint, "malformed"], source.malformed)
                lost.add_metric([source.endpoint], source.lost)
                connected.add_metric([source.endpoint], int(source.connected))
            yield messages
            yield lost
            yield connected

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Counts())
    return registry
