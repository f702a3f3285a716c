"""
req/s from 1 to N gateway processes, with a load side that costs next to nothing
================================================================================

``python benchmarks/scaling.py [--processes 1,2] [--clients 64] [--api chat]
[--size 1024] [--rounds 3] [--duration 5]``

Issue 21 asks how ``meshkit serve --processes N`` scales. On a small machine the
answer hides behind the load side: the Python load generator and mock workers of
``run.py`` spend more CPU per request than the gateway does, so they, not the
gateway, set the pace. Here the load generator and the workers are two small C
programs (``benchmarks/native/``, built with the system's ``cc`` on every run): a
closed loop of ``--clients`` keep-alive connections, and workers answering a fixed
body in the OpenAI shape (usage included, so the gateway's accounting runs as
usual).

Nothing is pinned: the gateway's processes, the load generator and the workers
share the machine's cores as a deployment's would. Each round measures every N in
turn (the order alternates), after ``--warmup`` seconds of load. Reported per N:
req/s, and the CPU per request of the gateway (all its processes), the workers
and the load generator (``/proc`` and ``getrusage``: user + system).

**Expected scaling.** With per-request CPU ``g`` (the gateway) and ``l`` (the load
side), measured with one process, and ``C`` usable cores, N processes serve at
most ``min(N / g, C / (g + l))`` requests per second: N cores for the gateway, and
not more than the machine. The report gives that bound's ratio to one process's
beside the measured ratio; their quotient is how much of the possible gain the
processes deliver.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import API_PATHS, bodies, cpu_seconds, free_port  # noqa: E402
from accept_bench import Gateway  # noqa: E402

NATIVE = HERE / "native"


def build(out: Path) -> tuple[Path, Path]:
    """The load generator and the worker, compiled into ``out``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("scaling.py needs a C compiler (cc) for benchmarks/native/")
    made = []
    for name in ("loadgen", "backend"):
        exe = out / name
        subprocess.run([cc, "-O2", "-o", str(exe), str(NATIVE / f"{name}.c")], check=True)
        made.append(exe)
    return made[0], made[1]


@dataclass
class Point:
    processes: int
    round: int
    rps: float
    gateway_us: float  # CPU per request, all the gateway's processes
    workers_us: float
    loadgen_us: float
    errors: int


def pinned(cpus: str | None) -> list[str]:
    """The ``taskset`` prefix that runs a command on ``cpus`` (none: unpinned)."""
    return ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []


def _load(
    loadgen: Path,
    port: int,
    clients: int,
    seconds: float,
    path: str,
    body: Path,
    cpus: str | None = None,
) -> dict[str, Any]:
    out = subprocess.run(
        [*pinned(cpus), str(loadgen), str(port), str(clients), str(seconds), path, str(body)],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def failed(got: dict[str, Any]) -> int:
    """The load generator's failed requests, of every kind."""
    return sum(int(got[k]) for k in ("client_errors", "server_errors", "broken", "unanswered"))


def _cpu(workers: dict[int, int]) -> float:
    return sum(map(cpu_seconds, workers.values()))


def measure(
    ns: argparse.Namespace,
    n: int,
    rnd: int,
    loadgen: Path,
    workers: dict[int, int],
    body: Path,
) -> Point:
    """One point: N processes in front of ``workers`` (port: pid) under load, each
    component's CPU over the window."""
    path = API_PATHS[ns.api]
    urls = [f"http://127.0.0.1:{port}" for port in workers]
    gw = Gateway(n, urls, policy="round_robin")
    try:
        _load(loadgen, gw.port, ns.clients, ns.warmup, path, body)
        cpu_gw, cpu_workers = gw.cpu(), _cpu(workers)
        got = _load(loadgen, gw.port, ns.clients, ns.duration, path, body)
        cpu_gw, cpu_workers = gw.cpu() - cpu_gw, _cpu(workers) - cpu_workers
    finally:
        gw.close()
    done = max(1, int(got["ok"]))
    errors = failed(got)
    return Point(
        processes=n,
        round=rnd,
        rps=got["ok_in_window"] / got["window_s"],
        gateway_us=1e6 * cpu_gw / done,
        workers_us=1e6 * cpu_workers / done,
        loadgen_us=1e6 * got["cpu_in_window_s"] / max(1, int(got["ok_in_window"])),
        errors=errors,
    )


def bound(n: int, g: float, load: float, cores: int) -> float:
    """The most req/s N processes can serve (see the module docstring)."""
    return min(n / g, cores / (g + load))


def report(points: list[Point], ns: argparse.Namespace, cores: int) -> str:
    procs = sorted({p.processes for p in points})
    base = procs[0]
    lines = [
        f"{ns.api} {ns.size} B, {ns.clients} clients, {ns.workers} C workers, "
        f"{cores} usable cores, nothing pinned; {ns.rounds} rounds of {ns.duration} s "
        f"after {ns.warmup} s (median, range over rounds)",
        "",
        "| processes | req/s | vs 1 process | expected | gateway µs/req | workers µs/req "
        "| load generator µs/req | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    one = [p for p in points if p.processes == base]
    g = statistics.median(p.gateway_us for p in one) / 1e6
    load = statistics.median(p.workers_us + p.loadgen_us for p in one) / 1e6
    for n in procs:
        mine = [p for p in points if p.processes == n]
        ratios = [p.rps / q.rps for p in mine for q in one if q.round == p.round]
        expected = bound(n, g, load, cores) / bound(base, g, load, cores)

        def cell(values: list[float], fmt: str) -> str:
            low, high = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
            return f"{statistics.median(values):{fmt}} ({low}\N{EN DASH}{high})"

        lines.append(
            f"| {n} | {cell([p.rps for p in mine], '.0f')} | {cell(ratios, '.2f')} "
            f"| {expected:.2f} | {cell([p.gateway_us for p in mine], '.0f')} "
            f"| {cell([p.workers_us for p in mine], '.0f')} "
            f"| {cell([p.loadgen_us for p in mine], '.0f')} | {sum(p.errors for p in mine)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", default="1,2", help="gateway processes, comma-separated")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--api", choices=sorted(API_PATHS), default="chat")
    ap.add_argument("--size", type=int, default=1024, help="request body bytes")
    ap.add_argument("--workers", type=int, default=2, help="C worker processes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds measured per point")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each")
    ap.add_argument("--json", help="also write the points here")
    ns = ap.parse_args(argv)
    counts = [int(x) for x in ns.processes.split(",")]
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="meshkit-scaling-") as tmp:
        tools = build(Path(tmp))
        body = Path(tmp) / "body.json"
        body.write_bytes(bodies(ns.size, 1, ns.api)[0])
        ports = [free_port() for _ in range(ns.workers)]
        procs = {port: subprocess.Popen([str(tools[1]), str(port)]) for port in ports}
        workers = {port: p.pid for port, p in procs.items()}
        try:
            time.sleep(0.3)
            points: list[Point] = []
            for rnd in range(ns.rounds):
                order = counts if rnd % 2 == 0 else counts[::-1]
                for n in order:
                    point = measure(ns, n, rnd, tools[0], workers, body)
                    print(
                        f"round {rnd + 1}, {n} process(es): {point.rps:.0f} req/s, gateway "
                        f"{point.gateway_us:.0f} µs/req, errors {point.errors}",
                        flush=True,
                    )
                    points.append(point)
        finally:
            for p in procs.values():
                p.kill()
                p.wait()
    print()
    print(report(points, ns, cores))
    if ns.json:
        Path(ns.json).write_text(json.dumps([p.__dict__ for p in points], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
