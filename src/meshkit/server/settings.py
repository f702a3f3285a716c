"""
Gateway settings: flags over file over environment
==================================================

``meshkit serve`` reads three layers; for each setting the first layer that sets
it wins:

1. command-line flags (``--worker``, ``--policy``, ``--host`` ...);
2. the TOML file named by ``--config``, else by ``MESHKIT_CONFIG``;
3. the environment: ``MESHKIT_WORKERS`` (comma list of ``URL#labels``) and
   ``MESHKIT_POLICY``.

Workers are replaced, not merged: ``--worker`` flags replace the file's
``[[workers]]``, which replace ``MESHKIT_WORKERS``. A gateway then runs exactly
the fleet its operator typed last. (``Mesh.from_env`` differs on purpose: it
appends ``MESHKIT_WORKERS`` to the file's workers.)

Every problem is a :class:`~meshkit.errors.ConfigError` naming the key and the
layer (the file path, ``--worker`` or the variable).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshkit.config import MeshConfig, parse_worker_arg
from meshkit.errors import ConfigError

__all__ = ["LOG_LEVELS", "SERVERS", "ServeSettings", "resolve_settings", "usable_cpus"]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SERVERS = ("builtin", "uvicorn", "granian")


@dataclass(frozen=True)
class ServeSettings:
    """What the server needs besides the mesh configuration."""

    host: str
    port: int
    grace_s: float
    log_level: str
    access_log: bool
    server: str = "builtin"
    keep_alive_s: float = 5.0
    max_connections: int = 4096
    max_pipelined: int = 16
    #: router processes on the one port (resolved: "auto" is the usable CPUs)
    processes: int = 1
    #: with processes > 1, the children's KV events through one relay process
    kv_relay: bool = True


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _processes(value: int | str, source: str | None) -> int:
    if value == "auto":
        return usable_cpus()
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            value = 0
    if isinstance(value, bool) or value < 1:
        raise ConfigError(
            "server.processes", f"must be an integer >= 1 or 'auto', got {value!r}", source=source
        )
    return value


def _file_keys(path: str) -> set[str]:
    # The file already parsed in MeshConfig.from_file; this second read only tells
    # which top-level keys it sets, so an explicit `policy` beats MESHKIT_POLICY.
    return set(tomllib.loads(Path(path).read_text(encoding="utf-8")))


def _flag_workers(args: Sequence[str]) -> MeshConfig:
    parsed = []
    for arg in args:
        try:
            parsed.append(parse_worker_arg(arg))
        except ConfigError as exc:
            raise ConfigError(exc.key, str(exc).split(": ", 1)[-1], source="--worker") from None
    return MeshConfig.build(source="--worker", workers=parsed)


def resolve_settings(
    *,
    config: str | None = None,
    workers: Sequence[str] = (),
    policy: str | None = None,
    host: str | None = None,
    port: int | None = None,
    grace_s: float | None = None,
    log_level: str | None = None,
    access_log: bool | None = None,
    server: str | None = None,
    processes: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[MeshConfig, ServeSettings]:
    """Merge flags (the arguments), the file and the environment.

    :raises ConfigError: for any invalid value, naming the key and its layer.
    """
    env = os.environ if environ is None else environ
    path = config or env.get("MESHKIT_CONFIG") or None
    if path:
        if not Path(path).is_file():
            # Name the layer the path came from, so the operator knows what to fix.
            raise ConfigError("--config" if config else "MESHKIT_CONFIG", f"no such file: {path}")
        base = MeshConfig.from_file(path)
        keys = _file_keys(path)
    else:
        base, keys = MeshConfig(), set()

    fleet: MeshConfig | None = None
    if workers:
        fleet = _flag_workers(workers)
    elif "workers" not in keys and env.get("MESHKIT_WORKERS"):
        fleet = MeshConfig.from_env({"MESHKIT_WORKERS": env["MESHKIT_WORKERS"]})
    if fleet is not None:
        base = dataclasses.replace(base, workers=fleet.workers, dns_workers=fleet.dns_workers)

    if policy:
        base = dataclasses.replace(base, policy=policy)
    elif "policy" not in keys and env.get("MESHKIT_POLICY"):
        base = dataclasses.replace(base, policy=env["MESHKIT_POLICY"])

    s = base.server
    source = path or None
    level = (log_level or s.log_level).lower()
    if level not in LOG_LEVELS:
        raise ConfigError(
            "server.log_level", f"must be one of {', '.join(LOG_LEVELS)}", source=source
        )
    settings = ServeSettings(
        host=host if host is not None else s.host,
        port=port if port is not None else s.port,
        grace_s=grace_s if grace_s is not None else s.grace_s,
        log_level=level,
        access_log=access_log if access_log is not None else s.access_log,
        server=server or s.http,
        keep_alive_s=s.keep_alive_s,
        max_connections=s.max_connections,
        max_pipelined=s.max_pipelined,
        processes=_processes(
            processes if processes is not None else s.processes,
            "--processes" if processes is not None else source,
        ),
        kv_relay=s.kv_relay,
    )
    if settings.server not in SERVERS:
        where = "--server" if server else source
        raise ConfigError("server.http", f"must be one of {', '.join(SERVERS)}", source=where)
    if settings.keep_alive_s <= 0:
        raise ConfigError("server.keep_alive_s", "must be > 0", source=source)
    if settings.max_connections < 1:
        raise ConfigError("server.max_connections", "must be >= 1", source=source)
    if settings.max_pipelined < 1:
        raise ConfigError("server.max_pipelined", "must be >= 1", source=source)
    if not 0 <= settings.port <= 65535:
        where = "--port" if port is not None else source
        raise ConfigError(
            "server.port", f"must be in [0, 65535], got {settings.port}", source=where
        )
    if settings.grace_s < 0:
        raise ConfigError("server.grace_s", "must be >= 0", source="--grace")
    if settings.processes > 1:
        where = "--processes" if processes is not None else source
        if settings.server == "granian":
            raise ConfigError(
                "server.processes", "granian binds its own socket: use processes = 1", source=where
            )
    return base, settings
