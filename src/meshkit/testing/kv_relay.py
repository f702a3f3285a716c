"""
``meshkit kv-relay`` in a process of its own
============================================

For tests and benchmarks that put a relay between routers and engines
(:mod:`meshkit.lifecycle.kv_relay`): :func:`start_kv_relay` returns once the
relay prints that it listens, with the endpoints read off that line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["RelayStarted", "start_kv_relay"]

#: what ``meshkit kv-relay`` prints once routers can subscribe (``server/cli.py``)
_LISTENING = re.compile(r"meshkit kv-relay listening on (\S+)(?: \(replays on (\S+)\))?")


@dataclass
class RelayStarted:
    """A running relay: its process, where routers subscribe, and where they ask
    for replays (``""`` when it answers none)."""

    proc: subprocess.Popen[str]
    endpoint: str
    replay_endpoint: str


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
    proc = subprocess.Popen(  # noqa: S603 - this interpreter, meshkit's own command
        [sys.executable, "-m", "meshkit", "kv-relay", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "MESHKIT_CONFIG": "", **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = _LISTENING.match(line)
    if found is None:
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"meshkit kv-relay did not start: {line!r} {err or ''}".strip())
    return RelayStarted(proc, found.group(1), found.group(2) or "")
