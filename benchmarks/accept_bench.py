"""
How ``meshkit serve --processes N`` shares its connections
==========================================================

``python benchmarks/accept_bench.py [--processes 2] [--bursts 32,64] [--base DIR]``

Two measurements against a real ``meshkit serve --processes N`` on one mock worker:

* **split**: bursts of keep-alive connections opened at once (a client pool, a load
  balancer's upstream connections), each asking ``/health`` which child answers it;
  the connections per child, three bursts per size;
* **churn**: clients that open a new connection for every request
  (``connection: close``, 8 at a time for ``--seconds``): connections per second,
  and the children's CPU per connection (``/proc``, user + system).

``--base DIR`` measures the tree at ``DIR`` (its ``src/`` first on ``PYTHONPATH``,
this interpreter) the same way, after this one, for a before/after. CPU figures
on a shared machine move by several percent from run to run: compare the two
sides of one run, and run it more than once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import free_port, tree_cpu_seconds  # noqa: E402

_CHURN_CLIENTS = 8


class Gateway:
    """``meshkit serve --processes n`` in front of ``workers`` (``src``: a tree's
    sources to run instead of the installed meshkit). benchmarks/scaling.py uses it
    too."""

    def __init__(
        self, n: int, workers: list[str], src: str | None = None, policy: str | None = None
    ) -> None:
        self.port = free_port()
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = src
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "meshkit", "serve", "--port", str(self.port),
             "--processes", str(n), "--log-level", "warning",
             *(arg for url in workers for arg in ("--worker", url)),
             *(("--policy", policy) if policy else ())],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
        assert self.popen.stdout is not None
        self.popen.stdout.readline()  # "listening on": every child accepts

    def children_cpu(self) -> float:
        out = subprocess.run(
            ["pgrep", "-P", str(self.popen.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        total = 0
        for pid in out:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def cpu(self) -> float:
        """CPU seconds of the whole gateway: the supervisor (when there is one) and
        its children."""
        return tree_cpu_seconds([self.popen.pid])

    def close(self) -> None:
        self.popen.send_signal(signal.SIGTERM)
        self.popen.wait(60)


async def _ask(port: int, close: bool) -> tuple[int, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    extra = b"connection: close\r\n" if close else b""
    writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return json.loads(await reader.readexactly(length))["process"], writer


async def burst(port: int, n: int, processes: int) -> tuple[list[int], list[asyncio.StreamWriter]]:
    """``n`` keep-alive connections opened at once: how many each child holds, and
    the connections (still open)."""
    got = await asyncio.gather(*(_ask(port, False) for _ in range(n)))
    per = Counter(process for process, _ in got)
    return [per[i] for i in range(processes)], [writer for _, writer in got]


async def split(port: int, n: int, processes: int) -> list[int]:
    per, writers = await burst(port, n, processes)
    for writer in writers:
        writer.close()
    await asyncio.sleep(0.3)  # the children see the connections close
    return per


async def churn(gw: Gateway, seconds: float) -> tuple[float, float]:
    """(connections per second, the children's CPU µs per connection)."""

    async def client(until: float, done: list[int]) -> None:
        while time.monotonic() < until:
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(b"GET /liveness HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await reader.read()
            writer.close()
            done[0] += 1

    await asyncio.gather(*(client(time.monotonic() + 0.5, [0]) for _ in range(_CHURN_CLIENTS)))
    done = [0]
    cpu0, t0 = gw.children_cpu(), time.monotonic()
    await asyncio.gather(*(client(t0 + seconds, done) for _ in range(_CHURN_CLIENTS)))
    wall, cpu = time.monotonic() - t0, gw.children_cpu() - cpu0
    return done[0] / wall, 1e6 * cpu / done[0]


def measure(ns: argparse.Namespace, worker: str, src: str | None, label: str) -> None:
    gw = Gateway(ns.processes, [worker], src)
    try:
        for n in ns.bursts:
            for burst in range(3):
                per = asyncio.run(split(gw.port, n, ns.processes))
                print(f"{label}: burst of {n}, #{burst + 1}: connections per child {per}")
        rate, cpu = asyncio.run(churn(gw, ns.seconds))
        print(f"{label}: a new connection per request: {rate:.0f}/s, {cpu:.0f} µs CPU each")
    finally:
        gw.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--bursts", default="16,64", help="burst sizes, comma-separated")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of the churn window")
    ap.add_argument("--base", help="another checkout, measured from its src/ after this one")
    ns = ap.parse_args()
    ns.bursts = [int(x) for x in ns.bursts.split(",")]
    port = free_port()
    mock = subprocess.Popen(
        [sys.executable, "-m", "meshkit.mock", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.0)
        worker = f"http://127.0.0.1:{port}"
        measure(ns, worker, None, "this")
        if ns.base:
            measure(ns, worker, str(Path(ns.base) / "src"), "base")
    finally:
        mock.kill()
        mock.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
