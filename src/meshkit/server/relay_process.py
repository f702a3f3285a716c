"""
A KV-event relay as a process
=============================

:class:`~meshkit.lifecycle.kv_relay.KvRelay` run until told to stop, two ways:

* ``meshkit kv-relay``, the standalone command (:func:`run_relay`);
* ``meshkit serve --processes N``'s relay child (:func:`serve_relay_child`): the
  supervisor (:mod:`meshkit.server.supervisor`) starts it before the routers and
  points their ``[kv] relay`` at it, so each engine is subscribed to once per
  gateway. It binds the ``ipc://`` endpoints the supervisor gives, in the 0700 run
  directory; follows what the routers subscribe to (a worker an admin added); stops
  when the parent goes, even killed; and answers ``GET /metrics`` on a Unix socket
  there (:class:`MetricsSocket`), where the scraped router merges its counts into
  the gateway's one ``/metrics`` (:mod:`meshkit.server.merged_metrics`).

SIGTERM / SIGINT stop it; SIGHUP loads the workers again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socketserver
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from meshkit.config import KvRelayConfig, MeshConfig
from meshkit.errors import ConfigError

if TYPE_CHECKING:
    from meshkit.lifecycle.kv_relay import KvRelay
    from meshkit.server.supervisor import ChildPlace

__all__ = ["MetricsSocket", "run_relay", "serve_relay_child"]

log = logging.getLogger("meshkit.server")


def run_relay(
    config: MeshConfig,
    relay_config: KvRelayConfig,
    publishers: Sequence[str],
    load: Callable[[], MeshConfig],
    announce: Callable[[KvRelay], None],
    fail: Callable[[str], int],
    lifeline_fd: int | None = None,
) -> int:
    """Relay until SIGTERM / SIGINT (or, with ``lifeline_fd``, the parent's exit).

    :param publishers: ``--publisher`` entries, besides the config's.
    :param load: the config again, on SIGHUP.
    :param announce: called once routers can subscribe.
    :param fail: reports a usage or configuration error, returns the exit code.
    :returns: the exit code.
    """
    import signal

    try:
        import zmq
    except ImportError:
        return fail("meshkit kv-relay needs pyzmq: pip install 'meshkit[kv]'")
    import asyncio

    from meshkit.lifecycle.kv_relay import KvRelay, RelayFleet, follow_fleet, relay_registry

    try:
        fleet = RelayFleet(config, publishers)  # --publisher entries checked here
        asyncio.run(fleet.refresh())  # dns:// names looked up before the first subscription
        relay = KvRelay(fleet.publishers(), relay_config, config.kv)
    except ConfigError as exc:
        return fail(str(exc))
    except zmq.ZMQError as exc:
        print(f"meshkit: error: cannot bind {relay_config.bind}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    hup = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
    if lifeline_fd is not None:
        threading.Thread(
            target=_until_eof, args=(lifeline_fd, stop), name="kv-relay-lifeline", daemon=True
        ).start()
    threading.Thread(
        target=follow_fleet,
        args=(relay, fleet, stop, hup, load),
        name="kv-relay-fleet",
        daemon=True,
    ).start()
    try:
        if relay_config.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(
                relay_config.metrics_port,
                relay_config.metrics_host,
                registry=relay_registry(relay),
            )
        announce(relay)
        relay.serve(stop)
    except OSError as exc:
        print(f"meshkit: error: cannot listen: {exc}", file=sys.stderr)
        return 1
    finally:
        relay.close()
    return 0


def serve_relay_child(
    config: MeshConfig,
    place: ChildPlace,
    load: Callable[[], MeshConfig],
    fail: Callable[[str], int],
) -> int:
    """Run as ``serve --processes N``'s relay child: the engines ``config`` names, on
    the endpoints ``place`` gives. Returns the exit code."""
    from meshkit.lifecycle.kv_relay import relay_registry
    from meshkit.server.supervisor import RELAY_METRICS_SOCKET, leave_run_dir

    assert place.kv_relay is not None
    pub, replay = place.kv_relay
    try:
        # [kv_relay]'s bounds, on the supervisor's endpoints; its own /metrics port
        # is the gateway's /metrics here.
        relay_config = dataclasses.replace(
            config.kv_relay, bind=pub, replay_bind=replay, metrics_port=0, follow_routers=True
        )
    except ConfigError as exc:
        return fail(str(exc))
    metrics: list[MetricsSocket] = []

    def announce(relay: KvRelay) -> None:
        where = os.path.join(place.run_dir, RELAY_METRICS_SOCKET)
        metrics.append(MetricsSocket(where, relay_registry(relay)))
        log.info("KV-event relay for the processes: %d publishers", len(relay.sources))
        os.write(place.ready_fd, b"1")
        os.close(place.ready_fd)

    parent = os.getppid()
    try:
        return run_relay(config, relay_config, (), load, announce, fail, place.lifeline_fd)
    finally:
        for socket in metrics:
            socket.close()
        for endpoint in place.kv_relay:  # ZeroMQ unlinks them too; a kill does not
            with contextlib.suppress(OSError):
                os.unlink(endpoint.removeprefix("ipc://"))
        if os.getppid() != parent:  # killed: no parent to clean up after us
            leave_run_dir(place.run_dir)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class MetricsSocket:
    """``GET /metrics`` of ``registry`` on the Unix socket ``path``, served by a
    daemon thread until :meth:`close` (prometheus-client's own handler, which logs
    nothing)."""

    def __init__(self, path: str, registry: Any) -> None:
        from prometheus_client.exposition import MetricsHandler

        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a killed predecessor's
        self.path = path
        self._server = _Server(path, MetricsHandler.factory(registry))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kv-relay-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _until_eof(fd: int, stop: threading.Event) -> None:
    # The parent holds the other end: EOF is its exit, whatever killed it.
    with contextlib.suppress(OSError):
        while os.read(fd, 64):
            pass
    stop.set()
