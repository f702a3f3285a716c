"""The ports a multi-router benchmark binds once per run of a repeat: outside the
kernel's ephemeral range, so no outgoing connection holds one between two runs."""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _common import ports_to_reuse  # noqa: E402


def test_ports_to_reuse_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = ports_to_reuse(8, random.Random(3))
    assert len(set(ports)) == 8
    assert all(10000 <= p < low for p in ports)
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_passed_over() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        taken = ports_to_reuse(1, random.Random(5))[0]
        held.bind(("127.0.0.1", taken))
        held.listen()
        # the same draws again: the taken port is skipped
        again = ports_to_reuse(3, random.Random(5))
    assert taken not in again
