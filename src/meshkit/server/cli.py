"""
The ``meshkit`` command
=======================

::

    meshkit serve --worker http://10.0.0.5:8000 --worker 'http://10.0.0.6:8000#mesh.apis=chat'
    meshkit serve --config meshkit.toml --port 9000
    meshkit mock-worker --port 9001 --name w1
    meshkit kv-relay --config meshkit.toml --bind 'tcp://*:5600'
    meshkit demo

``serve`` prints ``meshkit gateway listening on <url>`` on stdout once it accepts
requests (``--port 0`` picks a free port). Exit codes: 0 after a graceful
shutdown, 1 when the address cannot be bound, 2 for a usage or configuration
error, reported as one line on stderr::

    meshkit: error: config key 'workers.url' (--worker): not an http(s) URL: 'ftp://x'

Settings come from flags, then the file, then the environment
(:mod:`meshkit.server.settings`). SIGHUP reads them again and applies the workers
and the policy (:mod:`meshkit.server.hangup`).

Security: no body, prompt or credential is logged; the access log is off
unless ``--access-log`` (or ``[server] access_log = true``) turns it on.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshkit import __version__, build
from meshkit.config import ExtProcConfig, MeshConfig
from meshkit.errors import ConfigError
from meshkit.mesh import Mesh
from meshkit.server.settings import LOG_LEVELS, SERVERS, ServeSettings, resolve_settings

if TYPE_CHECKING:
    from meshkit.lifecycle.kv_relay import KvRelay
    from meshkit.server.supervisor import ChildPlace

__all__ = ["build_parser", "main"]

log = logging.getLogger("meshkit.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshkit", description="Place LLM inference requests on a fleet of workers."
    )
    p.add_argument("--version", action="version", version=f"meshkit {__version__} ({build()})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the gateway", description="Run the gateway.")
    # Defaults are None so that a flag left out lets the file or the environment decide.
    s.add_argument("--config", metavar="PATH", help="TOML file (default: $MESHKIT_CONFIG)")
    s.add_argument(
        "--worker",
        metavar="URL",
        action="append",
        default=[],
        help="a worker, URL#label=value;label=value (repeatable; replaces the file's workers)",
    )
    s.add_argument("--policy", help="placement policy (default: file, $MESHKIT_POLICY)")
    s.add_argument("--host", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port, 0 = any free port (default 8080)")
    s.add_argument(
        "--grace",
        type=float,
        metavar="SECONDS",
        help="how long in-flight streams may finish after SIGTERM (default 30)",
    )
    s.add_argument("--log-level", choices=LOG_LEVELS, help="(default info)")
    s.add_argument(
        "--access-log", action="store_true", default=None, help="log one line per request"
    )
    s.add_argument(
        "--server",
        choices=SERVERS,
        default=None,
        help="HTTP server (default: [server] http, else builtin; granian needs meshkit[granian])",
    )
    s.add_argument(
        "--processes",
        metavar="N",
        help="router processes on the one port, or 'auto' (the usable CPUs; default 1)",
    )

    x = sub.add_parser(
        "extproc",
        help="run the Envoy ext-proc endpoint picker (meshkit[extproc])",
        description="Serve Envoy's ExternalProcessor: pick a worker per request "
        "(Gateway API Inference Extension endpoint picker). See docs/extproc.md.",
    )
    x.add_argument("--config", metavar="PATH", help="TOML file (default: $MESHKIT_CONFIG)")
    x.add_argument("--worker", metavar="URL", action="append", default=[], help="as for serve")
    x.add_argument("--policy", help="placement policy")
    x.add_argument("--host", help="gRPC listen address (default: [extproc] host, 127.0.0.1)")
    x.add_argument("--port", type=int, help="gRPC port, 0 = any free port (default 9002)")
    x.add_argument(
        "--metrics-port", type=int, help="/metrics, /health, /workers (default 9090; 0 = none)"
    )
    x.add_argument("--grace", type=float, metavar="SECONDS", help="(default 30)")
    x.add_argument("--log-level", choices=LOG_LEVELS, help="(default info)")

    r = sub.add_parser(
        "kv-relay",
        help="relay the engines' KV events to many routers (meshkit[kv])",
        description="Subscribe once to each engine's KV-event publisher and republish "
        "for routers with [kv] relay. See docs/many-routers.md.",
    )
    r.add_argument("--config", metavar="PATH", help="TOML file (default: $MESHKIT_CONFIG)")
    r.add_argument(
        "--bind", metavar="ENDPOINT", help="where routers subscribe (default tcp://127.0.0.1:5600)"
    )
    r.add_argument(
        "--replay-bind",
        metavar="ENDPOINT",
        help="where routers ask for replays (default tcp://127.0.0.1:5601; '' for none)",
    )
    r.add_argument(
        "--publisher",
        metavar="ENDPOINT",
        action="append",
        default=[],
        help="an engine's publisher besides the workers' kv_events, EVENTS or "
        "EVENTS,REPLAY with its replay endpoint (repeatable)",
    )
    r.add_argument("--metrics-port", type=int, help="/metrics over HTTP (default 0: none)")
    r.add_argument("--log-level", choices=LOG_LEVELS, help="(default info)")

    sub.add_parser(
        "mock-worker",
        help="run a mock inference worker (see: meshkit mock-worker --help)",
        add_help=False,
    )
    d = sub.add_parser("demo", help="route real SDK traffic over mock workers, print a report")
    d.add_argument(
        "--real",
        action="store_true",
        help="run on real llama.cpp engines (the engine extra; see docs/real-engines.md)",
    )
    return p


def _fail(message: str) -> int:
    # One line, whatever the message holds: operators grep for it.
    print(f"meshkit: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return 2


def _setup_logging(level: str) -> None:
    numeric = logging.DEBUG if level == "trace" else getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format="%(levelname)s:     %(name)s: %(message)s")


def _settings(ns: argparse.Namespace) -> tuple[MeshConfig, ServeSettings]:
    from meshkit.server.supervisor import child_place

    config, settings = resolve_settings(
        config=ns.config,
        workers=ns.worker,
        policy=ns.policy,
        host=ns.host,
        port=ns.port,
        grace_s=ns.grace,
        log_level=ns.log_level,
        access_log=ns.access_log,
        server=ns.server,
        processes=getattr(ns, "processes", None),
    )
    place = child_place()
    relay = place.kv_relay if place is not None and place.role == "router" else None
    if relay is not None and config.kv.relay is None:
        # A supervised router: its engines' events come through the gateway's relay.
        kv = dataclasses.replace(config.kv, relay=relay[0], relay_replay=relay[1])
        config = dataclasses.replace(config, kv=kv)
    return config, settings


def _serve(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from meshkit.server.supervisor import child_place

    place = child_place()
    if place is not None and place.role == "kv-relay":
        return _gateway_relay(ns, place)
    try:
        config, settings = _settings(ns)
        mesh = Mesh(config=config)  # the policy (a plugin, maybe) is checked here
    except ConfigError as exc:
        return _fail(str(exc))
    try:
        from meshkit.server import runner
    except ImportError as exc:  # uvicorn is the [server] extra
        mesh.close()
        return _fail(f"meshkit serve needs uvicorn: pip install 'meshkit[server]' ({exc})")
    if settings.server == "granian" and not runner.granian_available():
        mesh.close()
        return _fail("--server granian: granian is not installed (pip install 'meshkit[granian]')")
    _setup_logging(settings.log_level)
    child = place
    if child is None and settings.processes > 1:
        mesh.close()  # the children build their own; this one only checked the config
        return _supervise(config, settings, argv)
    if child is None and not (mesh.workers or config.dns_workers or config.workers_file):
        log.warning("no worker is configured: /health answers 503 and every request 501")

    def announce(url: str) -> None:
        if child is not None:
            # The parent says where the gateway listens, once every child is up.
            os.write(child.ready_fd, b"1")
            os.close(child.ready_fd)
            return
        print(f"meshkit gateway listening on {url}", flush=True)
        names = ", ".join(w.url for w in mesh.workers) or "none"
        log.info("workers: %s; policy: %s; server: %s", names, mesh.policy.name, settings.server)

    try:
        # SIGHUP: the same flags, file and environment, read again.
        runner.serve(
            mesh, settings, on_ready=announce, reload=lambda: _settings(ns)[0], child=child
        )
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        print(f"meshkit: error: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    return 0


def _supervise(config: MeshConfig, settings: ServeSettings, argv: Sequence[str]) -> int:
    """``serve --processes N``: bind the port, run N children on it (and their
    KV-event relay, :func:`_wants_relay`)."""
    from meshkit.server.runner import listen, url_of
    from meshkit.server.supervisor import Supervisor

    try:
        sock = listen(settings.host, settings.port)
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        print(f"meshkit: error: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1

    def announce(url: str) -> None:
        print(f"meshkit gateway listening on {url}", flush=True)
        log.info("%d processes; server: %s", settings.processes, settings.server)

    try:
        sup = Supervisor(
            list(argv),
            sock,
            url_of(sock),
            settings.processes,
            settings.grace_s,
            on_ready=announce,
            kv_relay=_wants_relay(config, settings),
        )
    except ValueError as exc:
        sock.close()
        return _fail(str(exc))
    try:
        return sup.run()
    finally:
        sock.close()


def _wants_relay(config: MeshConfig, settings: ServeSettings) -> bool:
    """Whether ``serve --processes N`` runs one relay for its children's KV events:
    ``[server] kv_relay`` on, no relay of the operator's own, pyzmq installed, and
    a source of engines that may publish (a worker naming ``kv_events``, a
    ``kv_relay.publishers`` entry, or discovery). An admin may still add a worker
    with ``kv_events`` to a gateway that started without one: its children then
    subscribe to it each."""
    import importlib.util

    if not settings.kv_relay or config.kv.relay is not None:
        return False
    if importlib.util.find_spec("zmq") is None:
        return False
    publishes = any(w.kv_events for w in config.workers) or bool(config.kv_relay.publishers)
    return publishes or bool(config.dns_workers or config.workers_file)


def _extproc_settings(ns: argparse.Namespace) -> tuple[MeshConfig, ExtProcConfig, str]:
    config, settings = resolve_settings(
        config=ns.config, workers=ns.worker, policy=ns.policy, log_level=ns.log_level
    )
    x = config.extproc
    values = {
        "host": ns.host,
        "port": ns.port,
        "metrics_port": ns.metrics_port,
        "grace_s": ns.grace,
    }
    x = dataclasses.replace(x, **{k: v for k, v in values.items() if v is not None})
    return config, x, settings.log_level


def _extproc(ns: argparse.Namespace) -> int:
    try:
        config, x, level = _extproc_settings(ns)
        mesh = Mesh(config=config)
    except ConfigError as exc:
        return _fail(str(exc))
    try:
        from meshkit.frontends.extproc.run import run_extproc
    except ImportError as exc:
        mesh.close()
        return _fail(f"meshkit extproc needs grpcio: pip install 'meshkit[extproc]' ({exc})")
    _setup_logging(level)

    def announce(where: str) -> None:
        print(f"meshkit extproc listening on {where}", flush=True)

    try:
        run_extproc(mesh, x, on_ready=announce, reload=lambda: _extproc_settings(ns)[0])
    except OSError as exc:
        print(f"meshkit: error: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def _kv_relay(ns: argparse.Namespace) -> int:
    try:
        config, settings = resolve_settings(
            config=ns.config, workers=[], policy=None, log_level=ns.log_level
        )
        values = {"bind": ns.bind, "replay_bind": ns.replay_bind, "metrics_port": ns.metrics_port}
        relay_config = dataclasses.replace(
            config.kv_relay, **{k: v for k, v in values.items() if v is not None}
        )
    except ConfigError as exc:
        return _fail(str(exc))
    _setup_logging(settings.log_level)

    def announce(relay: KvRelay) -> None:
        replays = f" (replays on {relay.replay_endpoint})" if relay.replay_endpoint else ""
        print(f"meshkit kv-relay listening on {relay.endpoint}{replays}", flush=True)
        log.info("relaying %d publishers", len(relay.sources))

    def load() -> MeshConfig:
        # SIGHUP: the workers and kv_relay.publishers; the other keys need a restart
        return resolve_settings(config=ns.config, workers=[], policy=None)[0]

    from meshkit.server.relay_process import run_relay

    return run_relay(config, relay_config, ns.publisher, load, announce, _fail)


def _gateway_relay(ns: argparse.Namespace, place: ChildPlace) -> int:
    """``serve --processes N``'s relay child, on the gateway's own flags, file and
    environment (:mod:`meshkit.server.relay_process`)."""
    try:
        config, settings = _settings(ns)
    except ConfigError as exc:
        return _fail(str(exc))
    _setup_logging(settings.log_level)
    from meshkit.server.relay_process import serve_relay_child

    return serve_relay_child(config, place, lambda: _settings(ns)[0], _fail)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``meshkit`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "mock-worker":
        # Its own parser owns every flag after the subcommand (and its --help).
        from meshkit.mock import run_mock_worker

        return run_mock_worker(args[1:])
    ns = build_parser().parse_args(args)
    if ns.command == "serve":
        return _serve(ns, args)
    if ns.command == "extproc":
        return _extproc(ns)
    if ns.command == "kv-relay":
        return _kv_relay(ns)
    from meshkit.demo.run import run_demo

    return run_demo(real=ns.real)
