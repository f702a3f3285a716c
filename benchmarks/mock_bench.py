"""
Self-benchmark: CPU cost of the mock worker per request
=======================================================

``python benchmarks/mock_bench.py [--seconds 5] [--concurrency 16] [--body-bytes 1024]``

Starts ``python -m meshkit.mock`` in a child process (pinned with ``taskset -c 1``
when ``taskset`` exists), drives it from this process (pinned to core 0) with an
aiohttp closed loop of ``--concurrency`` keep-alive clients posting non-stream
``/v1/completions`` bodies of ``--body-bytes``, and reports the worker's
``utime + stime`` (from ``/proc/PID/stat``) per request. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time

from meshkit.mock.loop import new_event_loop

__all__ = ["main", "measure"]


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of ``pid`` in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def _body(size: int) -> bytes:
    import json

    words = " ".join(f"w{i % 97}" for i in range(size))
    base = {"model": "mock-model", "prompt": "", "max_tokens": 8}
    overhead = len(json.dumps(base))
    base["prompt"] = words[: max(size - overhead, 0)]
    return json.dumps(base).encode()


async def _drive(
    url: str, body: bytes, concurrency: int, seconds: float, pid: int
) -> tuple[int, float, float, float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"content-type": "application/json"}
    count = 0
    stop_at = 0.0
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")

        async def client() -> None:
            nonlocal count
            while time.monotonic() < stop_at:
                await one()
                count += 1

        # warm-up: connections, the worker's template memo
        stop_at = time.monotonic() + 0.5
        await asyncio.gather(*(client() for _ in range(concurrency)))
        count = 0
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        stop_at = t0 + seconds
        await asyncio.gather(*(client() for _ in range(concurrency)))
        cpu1, t1 = _cpu_seconds(pid), time.monotonic()
    return count, cpu1[0] - cpu0[0], cpu1[1] - cpu0[1], t1 - t0


def measure(
    seconds: float = 5.0, concurrency: int = 16, body_bytes: int = 1024
) -> dict[str, float]:
    """Run one measurement; returns requests, req/s and worker CPU µs per request."""
    cmd = [sys.executable, "-m", "meshkit.mock", "--port", "0", "--name", "bench"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "1", *cmd]
        os.sched_setaffinity(0, {0})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.rsplit(" ", 1)[-1].strip()
        if not url.startswith("http"):
            raise RuntimeError(f"mock worker did not start: {line!r}")
        loop = new_event_loop()
        try:
            n, user, system, wall = loop.run_until_complete(
                _drive(url, _body(body_bytes), concurrency, seconds, proc.pid)
            )
        finally:
            loop.close()
    finally:
        proc.terminate()
        proc.wait(10)
    cpu = user + system
    return {
        "requests": n,
        "worker_user_us_per_req": user / n * 1e6 if n else float("nan"),
        "worker_sys_us_per_req": system / n * 1e6 if n else float("nan"),
        "req_per_s": n / wall,
        "worker_cpu_us_per_req": cpu / n * 1e6 if n else float("nan"),
        "worker_cpu_util": cpu / wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/mock_bench.py")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--body-bytes", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args(argv)
    results = [measure(ns.seconds, ns.concurrency, ns.body_bytes) for _ in range(ns.rounds)]
    for r in results:
        print(
            f"{r['requests']:.0f} req, {r['req_per_s']:.0f} req/s, "
            f"worker {r['worker_cpu_us_per_req']:.1f} µs CPU/req "
            f"(user {r['worker_user_us_per_req']:.1f} + sys {r['worker_sys_us_per_req']:.1f}) "
            f"({r['worker_cpu_util'] * 100:.0f}% of a core)"
        )
    us = sorted(r["worker_cpu_us_per_req"] for r in results)
    print(f"median {us[len(us) // 2]:.1f} µs/req (min {us[0]:.1f}, max {us[-1]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
