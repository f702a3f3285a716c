"""
meshkit's own commands in processes of their own
=================================================

For tests and benchmarks that run what an operator runs: :func:`start_kv_relay`
(``meshkit kv-relay``, between routers and engines: :mod:`meshkit.lifecycle.kv_relay`)
and :func:`start_gateway` (``meshkit serve``, one router per process) return once
the command prints that it listens, with the addresses read off that line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["GatewayStarted", "RelayStarted", "start_gateway", "start_kv_relay"]

#: what each command prints once it can be used (``server/cli.py``)
_RELAY = re.compile(r"meshkit kv-relay listening on (\S+)(?: \(replays on (\S+)\))?")
_GATEWAY = re.compile(r"meshkit gateway listening on (\S+)")


@dataclass
class RelayStarted:
    """A running relay: its process, where routers subscribe, and where they ask
    for replays (``""`` when it answers none)."""

    proc: subprocess.Popen[str]
    endpoint: str
    replay_endpoint: str


@dataclass
class GatewayStarted:
    """A running gateway: its process and its base URL."""

    proc: subprocess.Popen[str]
    url: str


def start_kv_relay(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stderr: int | None = subprocess.PIPE,
) -> RelayStarted:
    """``python -m meshkit kv-relay ARGS`` (``MESHKIT_CONFIG`` unset unless ``env``
    sets it), once it listens.

    :raises RuntimeError: it exited or printed something else first (its stderr
        in the message when it was piped).
    """
    proc, found = _start("kv-relay", args, _RELAY, env, stderr)
    return RelayStarted(proc, found.group(1), found.group(2) or "")


def start_gateway(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stderr: int | None = subprocess.DEVNULL,
) -> GatewayStarted:
    """``python -m meshkit serve ARGS``, as :func:`start_kv_relay`. Its log goes to
    ``stderr`` (not read by default: a pipe nobody reads stops a gateway that logs
    once it is full)."""
    proc, found = _start("serve", args, _GATEWAY, env, stderr)
    return GatewayStarted(proc, found.group(1))


def _start(
    command: str,
    args: Sequence[str],
    listening: re.Pattern[str],
    env: Mapping[str, str] | None,
    stderr: int | None,
) -> tuple[subprocess.Popen[str], re.Match[str]]:
    proc = subprocess.Popen(  # noqa: S603 - this interpreter, meshkit's own command
        [sys.executable, "-m", "meshkit", command, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "MESHKIT_CONFIG": "", **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = listening.match(line)
    if found is None:
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"meshkit {command} did not start: {line!r} {err or ''}".strip())
    return proc, found
