"""
Instructions per request, before and after a change
===================================================

``python benchmarks/instructions.py --base DIR [--requests 2000] [--size 1024]``

Wall-clock CPU figures on a shared machine move by tens of percent from one window
to the next; instruction counts do not. This counts, under ``valgrind
--tool=callgrind``, the instructions one request costs in this checkout and in the
checkout at ``DIR`` (each with its own ``.venv``), on three paths:

* ``core``: ``Mesh.prepare`` → the forward flow → accounting, in-process against a
  fake exchange (``core_bench.py``'s request); the difference of a run of ``2N`` and
  one of ``N`` requests, over ``N`` (start-up cancels out);
* ``transport``: one request through ``httpx2.Client(transport=MeshTransport(mesh))``
  to a mock worker in another process, counted the same way;
* ``gateway``: the built-in gateway (``benchmarks/frontends/meshkit_builtin.py``)
  under callgrind, driven by a closed loop of ``--clients`` connections in this
  process: a process that served ``2N`` requests less one that served ``N``, over
  ``N`` (each also served 300 warm-up requests; its periodic timers add a little).

Instruction counts say nothing of cache misses or wake-ups, and valgrind serialises
threads: use them for a before/after ratio of the same path, not as CPU time.
The mock workers run natively. Linux with valgrind only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CORE = """
import sys
sys.path.insert(0, {bench!r})
import core_bench
core_bench.run({size}, "round_robin", rounds=1, n={n})
"""

TRANSPORT = """
import httpx2
from meshkit import Mesh, MeshTransport
mesh = Mesh(workers=[{url!r}], lifecycle={{"probe": False}})
body = b'{{"model":"m","prompt":"' + b"x" * {size} + b'","max_tokens":2}}'
with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
    for _ in range(200 + {n}):
        r = client.post(
            "/v1/completions", content=body, headers={{"content-type": "application/json"}}
        )
        assert r.status_code == 200, r.status_code
mesh.close()
"""


def _ir(outfile: Path) -> int:
    """Total instructions in a callgrind output file (its ``summary:`` or ``totals:``)."""
    text = outfile.read_text()
    m = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    if m is None:
        raise RuntimeError(f"no instruction total in {outfile}")
    return int(m.group(1))


def _valgrind(python: str, code: str, env: dict[str, str], tmp: Path, tag: str) -> int:
    out = tmp / f"cg.{tag}"
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", python, "-c", code],
        check=True,
        env=env,
        capture_output=True,
    )
    return _ir(out)


def _per_request(python: str, template: str, n: int, tmp: Path, tag: str, **kw: object) -> float:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    small = _valgrind(python, template.format(n=n, **kw), env, tmp, f"{tag}.1")
    large = _valgrind(python, template.format(n=2 * n, **kw), env, tmp, f"{tag}.2")
    return (large - small) / n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(port: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                if s.recv(16).startswith(b"HTTP/1.1"):
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"nothing answers on port {port}")


def _closed_loop(port: int, body: bytes, clients: int, total: int) -> None:
    """``total`` requests over ``clients`` keep-alive connections, each in turn."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    left = [total]
    lock = threading.Lock()

    def one_client() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
            buf = b""
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                s.sendall(head + body)
                while b"\r\n\r\n" not in buf:
                    buf += s.recv(65536)
                h, _, buf = buf.partition(b"\r\n\r\n")
                n = int(re.search(rb"content-length: (\d+)", h, re.I).group(1))  # type: ignore[union-attr]
                while len(buf) < n:
                    buf += s.recv(65536)
                buf = buf[n:]

    threads = [threading.Thread(target=one_client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _gateway_run(repo: Path, workers: list[str], n: int, clients: int, size: int, out: Path) -> int:
    """Instructions of one gateway process: start-up, 300 warm-up requests, ``n``
    more, a graceful exit."""
    port = _free_port()
    env = {**os.environ, "MESHBENCH_WORKERS": ",".join(workers), "MESHBENCH_WORKLOAD": "proxy"}
    env["PYTHONHASHSEED"] = "0"
    proc = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            str(repo / ".venv" / "bin" / "python"),
            str(repo / "benchmarks" / "frontends" / "meshkit_builtin.py"),
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    body = b'{"model":"m","prompt":"' + b"x" * size + b'","max_tokens":2}'
    try:
        _wait_http(port)
        _closed_loop(port, body, clients, 300 + n)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)
    return _ir(out)


def _gateway(repo: Path, workers: list[str], n: int, clients: int, size: int, tmp: Path) -> float:
    tag = f"gw.{repo.name}.{clients}"
    small = _gateway_run(repo, workers, n, clients, size, tmp / f"cg.{tag}.1")
    large = _gateway_run(repo, workers, 2 * n, clients, size, tmp / f"cg.{tag}.2")
    return (large - small) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/instructions.py")
    ap.add_argument("--base", required=True, help="the other checkout (with its own .venv)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--clients", default="1,16", help="gateway client counts")
    ap.add_argument("--paths", default="core,transport,gateway")
    ns = ap.parse_args(argv)
    repos = {"this": REPO, "base": Path(ns.base).resolve()}
    paths = ns.paths.split(",")
    mocks = []
    urls = []
    for i in range(4):
        port = _free_port()
        mocks.append(
            subprocess.Popen(
                [sys.executable, "-m", "meshkit.mock", "--port", str(port), "--name", f"i{i}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    results: dict[str, dict[str, float]] = {}
    try:
        for u in urls:
            _wait_http(int(u.rsplit(":", 1)[1]), 30)
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            for name, repo in repos.items():
                python = str(repo / ".venv" / "bin" / "python")
                got = results[name] = {}
                if "core" in paths:
                    bench = str(repo / "benchmarks")
                    got["core"] = _per_request(
                        python, CORE, ns.requests, tmp, f"core.{name}", bench=bench, size=ns.size
                    )
                if "transport" in paths:
                    got["transport"] = _per_request(
                        python, TRANSPORT, ns.requests, tmp, f"tr.{name}", url=urls[0], size=ns.size
                    )
                if "gateway" in paths:
                    for c in (int(x) for x in ns.clients.split(",")):
                        got[f"gateway c={c}"] = _gateway(repo, urls, ns.requests, c, ns.size, tmp)
                print(json.dumps({name: got}), flush=True)
    finally:
        for m in mocks:
            m.terminate()
    print("\npath                 this (Ir/req)   base (Ir/req)   this/base")
    for key in results["this"]:
        a, b = results["this"][key], results["base"][key]
        print(f"{key:20} {a:15,.0f} {b:15,.0f} {a / b:11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
