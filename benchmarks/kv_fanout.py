"""
What K subscribers cost an engine's KV-event publisher, and what the relay takes off it
======================================================================================

``python benchmarks/kv_fanout.py [--subscribers 1,16,64,256] [--rate 200] [--size 4096]``

Every router subscribes to every engine it routes to, so an engine's publisher
sends each batch once per router process. This runs a publisher the way vLLM's
``ZmqEventPublisher`` is built (a ZeroMQ PUB socket in the engine's process, one
``[topic, seq, payload]`` per batch) sending ``--rate`` batches a second of
``--size`` bytes for ``--seconds``, to N subscribers (SUB sockets in one other
process), two ways:

* **direct**: the N subscribers connect to the publisher;
* **relay**: they subscribe through ``meshkit kv-relay`` (its own process), which
  alone connects to the publisher.

Reported per N and way: the publisher process's CPU (user + system, its libzmq I/O
thread included) as a share of one core, the relay process's, the bytes the
publisher's host sends per second (N or 1 copies of each batch), and the delivery
delay (publisher's clock at send to the subscriber's at receipt, same host) p50 /
p99 over every message every subscriber got, with how many arrived.

Writes a Markdown table to ``--out`` (default: stdout only).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import struct
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import zmq

from meshkit.core.kv_events import relay_topic
from meshkit.testing.commands import start_kv_relay

_WARM_S = 1.5


def publish(endpoint: str, rate: float, seconds: float, size: int) -> None:
    """The engine's side: prints its CPU seconds and batches sent."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(endpoint)
    print(pub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    sys.stdin.readline()  # the subscribers (or the relay) have joined
    filler = os.urandom(max(0, size - 8))
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.time()
    n = 0
    while (now := time.time()) - start < seconds:
        pub.send_multipart([b"kv", n.to_bytes(8, "big"), struct.pack("!d", now) + filler])
        n += 1
        pause = start + n / rate - time.time()
        if pause > 0:
            time.sleep(pause)
    after = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)  # the I/O thread flushes what is queued
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"done {n} {cpu:.4f} {time.time() - start:.3f}", flush=True)
    pub.close(linger=0)
    ctx.term()


def subscribe(endpoint: str, topic: bytes, count: int, seconds: float) -> None:
    """N subscribers in one process: prints every delivery delay (ms)."""
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for _ in range(count):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.setsockopt(zmq.SUBSCRIBE, topic)
        s.connect(endpoint)
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    print("joined", flush=True)
    delays: list[float] = []
    end = time.time() + _WARM_S + seconds + 3
    while time.time() < end:
        for sock, _ in poller.poll(100):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames[2]) < 8:
                    continue  # the relay's word that the publisher went away
                sent = struct.unpack("!d", frames[2][:8])[0]
                delays.append((time.time() - sent) * 1000)
    print(" ".join(f"{d:.3f}" for d in delays), flush=True)
    for s in socks:
        s.close(linger=0)
    ctx.term()


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_point(n: int, via_relay: bool, ns: argparse.Namespace) -> dict[str, float]:
    me = [sys.executable, __file__]
    pub = subprocess.Popen(
        [*me, "--publisher", "tcp://127.0.0.1:*", str(ns.rate), str(ns.seconds), str(ns.size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert pub.stdout is not None
    assert pub.stdin is not None
    endpoint = pub.stdout.readline().strip()
    relay = None
    target, topic = endpoint, b""
    if via_relay:
        relay = start_kv_relay(
            [
                "--publisher",
                endpoint,
                "--bind",
                "tcp://127.0.0.1:*",
                "--replay-bind",
                "",
                "--log-level",
                "warning",
            ],
            stderr=None,
        )
        target, topic = relay.endpoint, relay_topic(endpoint)
    sub = subprocess.Popen(
        [*me, "--subscriber", target, topic.hex(), str(n), str(ns.seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sub.stdout is not None
    sub.stdout.readline()
    time.sleep(_WARM_S)  # ZeroMQ's slow joiner: subscriptions reach the publisher
    relay_cpu0 = _cpu_of(relay.proc.pid) if relay else 0.0
    pub.stdin.write("go\n")
    pub.stdin.flush()
    _, sent, cpu, wall = pub.stdout.readline().split()
    relay_cpu = (_cpu_of(relay.proc.pid) - relay_cpu0) if relay else 0.0
    delays = [float(x) for x in sub.stdout.readline().split()]
    pub.wait()
    sub.wait()
    if relay:
        relay.proc.terminate()
        relay.proc.wait()
    delays.sort()
    copies = 1 if via_relay else n
    return {
        "sent": int(sent),
        "pub_cpu": float(cpu) / float(wall),
        "relay_cpu": relay_cpu / float(wall),
        "egress": copies * int(sent) * (ns.size + 16) / float(wall),
        "got": len(delays),
        "p50": statistics.median(delays) if delays else float("nan"),
        "p99": delays[int(0.99 * (len(delays) - 1))] if delays else float("nan"),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--publisher":
        publish(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--subscriber":
        subscribe(sys.argv[2], bytes.fromhex(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subscribers", default="1,16,64,256")
    ap.add_argument("--rate", type=float, default=200.0, help="batches per second")
    ap.add_argument("--size", type=int, default=4096, help="bytes per batch")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", help="write the Markdown report here")
    ns = ap.parse_args()
    rows = []
    for n in (int(x) for x in ns.subscribers.split(",")):
        for via in (False, True):
            r = run_point(n, via, ns)
            way = "relay" if via else "direct"
            print(
                f"N={n:4d} {way:6s} publisher {100 * r['pub_cpu']:5.1f}% relay "
                f"{100 * r['relay_cpu']:5.1f}% egress {r['egress'] / 1e6:8.3f} MB/s "
                f"delay p50 {r['p50']:.2f} p99 {r['p99']:.2f} ms got {r['got']}/{n * r['sent']}",
                flush=True,
            )
            rows.append((n, way, r))
    if ns.out:
        lines = [
            "# KV-event fan-out: direct against `meshkit kv-relay` (benchmarks/kv_fanout.py)",
            "",
            f"Command ({datetime.now(UTC):%d %b %Y, %H:%M} UTC):",
            "",
            f"    python benchmarks/kv_fanout.py --subscribers {ns.subscribers} "
            f"--rate {ns.rate:g} --size {ns.size} --seconds {ns.seconds:g}",
            "",
            f"Machine: {os.cpu_count()} cores, {platform.platform()}, Python "
            f"{platform.python_version()}, pyzmq {zmq.__version__}, libzmq "
            f"{zmq.zmq_version()}. Publisher, relay and subscribers share it.",
            "",
            "| subscribers | way | publisher CPU (% of a core) | relay CPU | publisher "
            "egress (MB/s) | delay p50 / p99 (ms) | delivered |",
            "|---:|---|---:|---:|---:|---|---:|",
        ]
        for n, way, r in rows:
            lines.append(
                f"| {n} | {way} | {100 * r['pub_cpu']:.1f} | "
                f"{100 * r['relay_cpu']:.1f} | {r['egress'] / 1e6:.1f} | "
                f"{r['p50']:.2f} / {r['p99']:.2f} | {r['got']:,} of {n * int(r['sent']):,} |"
            )
        Path(ns.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
