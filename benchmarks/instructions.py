"""
Instructions per request, before and after a change
===================================================

``python benchmarks/instructions.py --base DIR [--requests 2000] [--size 1024]``
``python benchmarks/instructions.py --rust vllm-router --paths gateway --api chat --clients 1``

Wall-clock CPU figures on a shared machine move by tens of percent from one window
to the next; instruction counts do not. This counts, under ``valgrind
--tool=callgrind``, the instructions one request costs in this checkout and in the
checkout at ``DIR`` (each with its own ``.venv``), on three paths:

* ``core``: ``Mesh.prepare`` → the forward flow → accounting, in-process against a
  fake exchange (``core_bench.py``'s request, placed by ``--policy``, round robin
  unless named); the difference of a run of ``2N`` and
  one of ``N`` requests, over ``N`` (start-up cancels out);
* ``transport``: one request through ``httpx2.Client(transport=MeshTransport(mesh))``
  to a mock worker in another process, counted the same way;
* ``gateway``: the built-in gateway (``benchmarks/frontends/meshkit_builtin.py``)
  under callgrind, driven by a closed loop of ``--clients`` connections in this
  process: a process that served ``2N`` requests less one that served ``N``, over
  ``N`` (each also served 300 warm-up requests; its periodic timers add a little).
  ``--api chat`` sends chat bodies (``_common.bodies``) instead of completions.

``--rust NAME`` counts a Rust router from ``benchmarks/.venvs/NAME`` (installed there
on first use, as ``run.py`` does) on the gateway path too, same loop, same workers,
round robin: what it executes per request beside meshkit's. ``--base`` is optional. ``--this DIR``
counts another checkout (say, one whose ``.venv`` runs another interpreter) as this
one. ``--simulate`` runs the gateways under cachegrind instead, with its simulated
caches and branch predictor: misses and mispredictions per request, beside ``Ir``.
``--processes N`` runs meshkit's gateways as ``meshkit serve --processes N`` and
counts every process (the supervisor and its children); ``--no-probes`` turns the
health and engine-load probes off, whose share of a run grows with valgrind's slowed
wall-clock time rather than with its requests (and with N: each child probes).

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
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from _common import API_PATHS, bodies, free_port
from frontends.launch import FRONTENDS, command, ensure_router

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CORE = """
import sys
sys.path.insert(0, {bench!r})
import core_bench
core_bench.run({size}, {policy!r}, rounds=1, n={n})
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


def _events(outfile: Path) -> dict[str, int]:
    """The totals of a callgrind or cachegrind output file, by event (``Ir``, and with
    cachegrind's simulation ``I1mr``, ``D1mr``, ``Bcm``, ``Bim``...)."""
    text = outfile.read_text()
    names = re.search(r"^events:\s+(.+)$", text, re.M)
    m = re.search(r"^(?:summary|totals):\s+([\d ]+)$", text, re.M)
    if names is None or m is None:
        raise RuntimeError(f"no totals in {outfile}")
    return dict(zip(names.group(1).split(), (int(x) for x in m.group(1).split()), strict=False))


def _ir(outfile: Path) -> int:
    """Total instructions in a callgrind output file (its ``summary:`` or ``totals:``)."""
    return _events(outfile)["Ir"]


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


def _closed_loop(port: int, body: bytes, clients: int, total: int, path: str) -> None:
    """``total`` requests over ``clients`` keep-alive connections, each in turn."""
    head = (
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (path.encode(), len(body))
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
                if not h.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"the gateway answered {h[:40]!r}")
                length = re.search(rb"content-length: (\d+)", h, re.I)
                if length is None:  # chunked: the mock's answers are small, read to the end
                    while b"\r\n0\r\n\r\n" not in buf:
                        buf += s.recv(65536)
                    buf = buf.partition(b"\r\n0\r\n\r\n")[2]
                    continue
                n = int(length.group(1))
                while len(buf) < n:
                    buf += s.recv(65536)
                buf = buf[n:]

    threads = [threading.Thread(target=one_client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _body(api: str, size: int) -> tuple[bytes, str]:
    if api == "chat":
        return bodies(size, 1, api="chat")[0], API_PATHS["chat"]
    # The completions body every recorded figure was counted with.
    return b'{"model":"m","prompt":"' + b"x" * size + b'","max_tokens":2}', API_PATHS["completions"]


def _meshkit_argv(repo: Path, port: int, processes: int) -> list[str]:
    script = repo / "benchmarks" / "frontends" / "meshkit_builtin.py"
    argv = [str(repo / ".venv" / "bin" / "python"), str(script), "--port", str(port)]
    return [*argv, "--processes", str(processes)] if processes > 1 else argv


def _rust_argv(name: str, workers: list[str], port: int) -> list[str]:
    """The Rust router's command line, as ``run.py`` starts it (``frontends/launch.py``)."""
    fe = FRONTENDS.get(name)
    if fe is None or fe.kind != "rust":
        raise SystemExit(f"{name} is not one of run.py's Rust routers")
    venvs = HERE / ".venvs"
    version, why = ensure_router(fe, venvs, HERE / "install.log")  # as run.py does
    if version is None:
        raise SystemExit(f"{name}: {why}")
    launch = command(
        fe,
        port=port,
        workers=workers,
        workload="proxy",
        cpus=None,
        processes=1,
        tokenizer=None,
        venvs=venvs,
        prometheus_port=free_port(),
    )
    return launch.argv


@dataclass(frozen=True)
class Setup:
    """How the gateways are driven and counted (the command line's options)."""

    api: str = "completions"
    size: int = 1024
    simulate: bool = False
    processes: int = 1
    probes: bool = True


def _gateway_run(
    gateway: Path | str, workers: list[str], setup: Setup, clients: int, n: int, out: Path
) -> dict[str, int]:
    """Instructions of one gateway process: start-up, 300 warm-up requests, ``n``
    more, a graceful exit. ``gateway``: a checkout (meshkit), or a Rust router's name.
    With ``processes`` > 1 every process of the gateway is counted (``meshkit serve
    --processes N``: the supervisor and its children), summed."""
    port = free_port()
    env = {**os.environ, "MESHBENCH_WORKERS": ",".join(workers), "MESHBENCH_WORKLOAD": "proxy"}
    env["PYTHONHASHSEED"] = "0"
    if not setup.probes:
        env["MESHBENCH_PROBES"] = "0"
    rust = isinstance(gateway, str)
    if isinstance(gateway, str):
        argv = _rust_argv(gateway, workers, port)
    else:
        argv = _meshkit_argv(gateway, port, setup.processes)
    many = setup.processes > 1 and not rust
    name = f"{out}.%p" if many else str(out)  # valgrind puts each process's pid in
    tool = ["--tool=callgrind", f"--callgrind-out-file={name}"]
    if setup.simulate:
        tool = ["--tool=cachegrind", "--cache-sim=yes", "--branch-sim=yes"]
        tool.append(f"--cachegrind-out-file={name}")
    if many:
        tool.append("--trace-children=yes")
    proc = subprocess.Popen(
        ["valgrind", *tool, *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    body, path = _body(setup.api, setup.size)
    try:
        _wait_http(port)
        _closed_loop(port, body, clients, 300 + n, path)
    finally:
        # SIGINT: the Rust routers' graceful stop (callgrind writes its file on exit)
        proc.send_signal(signal.SIGINT if rust else signal.SIGTERM)
        proc.wait(300)
    if not many:
        return _events(out)
    total: dict[str, int] = {}
    files = sorted(out.parent.glob(f"{out.name}.*"))
    if len(files) < setup.processes + 1:
        raise RuntimeError(f"{len(files)} output files for {setup.processes} children, a parent")
    for f in files:
        for k, v in _events(f).items():
            total[k] = total.get(k, 0) + v
    return total


def _gateway(
    gateway: Path | str, workers: list[str], setup: Setup, clients: int, n: int, tmp: Path
) -> dict[str, float]:
    """Events per request (``Ir`` alone unless ``setup.simulate``)."""
    tag = f"gw.{Path(gateway).name}.{clients}"
    small = _gateway_run(gateway, workers, setup, clients, n, tmp / f"cg.{tag}.1")
    large = _gateway_run(gateway, workers, setup, clients, 2 * n, tmp / f"cg.{tag}.2")
    return {k: (large[k] - small[k]) / n for k in large}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/instructions.py")
    ap.add_argument("--base", help="another checkout to count (with its own .venv)")
    ap.add_argument(
        "--this", default=str(REPO), help="the checkout counted as this one (default: here)"
    )
    ap.add_argument("--rust", help="also count this Rust router (benchmarks/.venvs/NAME)")
    ap.add_argument("--api", choices=sorted(API_PATHS), default="completions")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--policy", default="round_robin", help="the core path's policy")
    ap.add_argument("--clients", default="1,16", help="gateway client counts")
    ap.add_argument("--paths", default="core,transport,gateway")
    ap.add_argument(
        "--simulate",
        action="store_true",
        help="gateway runs under cachegrind: simulated cache misses and branch mispredictions",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="meshkit gateways as `meshkit serve --processes N` (all processes counted)",
    )
    ap.add_argument(
        "--keep",
        help="write the callgrind/cachegrind files here and keep them (for "
        "callgrind_annotate / cg_annotate; the .1 run is N requests, .2 is 2N)",
    )
    ap.add_argument(
        "--no-probes",
        action="store_true",
        help="meshkit gateways without health/engine-load probes (their share grows "
        "with valgrind's slowed wall-clock time, not with requests)",
    )
    ns = ap.parse_args(argv)
    repos = {"this": Path(ns.this).resolve()}
    if ns.base is not None:
        repos["base"] = Path(ns.base).resolve()
    paths = ns.paths.split(",")
    clients = [int(x) for x in ns.clients.split(",")]
    setup = Setup(ns.api, ns.size, ns.simulate, ns.processes, not ns.no_probes)
    mocks = []
    urls = []
    for i in range(4):
        port = free_port()
        mocks.append(
            subprocess.Popen(
                [sys.executable, "-m", "meshkit.mock", "--port", str(port), "--name", f"i{i}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    results: dict[str, dict[str, float]] = {}
    simulated: dict[str, dict[str, dict[str, float]]] = {}

    def gateway(name: str, where: Path | str) -> None:
        for c in clients:
            per = _gateway(where, urls, setup, c, ns.requests, tmp)
            results.setdefault(name, {})[f"gateway c={c}"] = per["Ir"]
            simulated.setdefault(name, {})[f"gateway c={c}"] = per

    try:
        for u in urls:
            _wait_http(int(u.rsplit(":", 1)[1]), 30)
        scratch = tempfile.TemporaryDirectory() if ns.keep is None else nullcontext(ns.keep)
        with scratch as d:
            tmp = Path(d)
            tmp.mkdir(parents=True, exist_ok=True)
            for name, repo in repos.items():
                python = str(repo / ".venv" / "bin" / "python")
                got = results[name] = {}
                if "core" in paths:
                    bench = str(repo / "benchmarks")
                    got["core"] = _per_request(
                        python,
                        CORE,
                        ns.requests,
                        tmp,
                        f"core.{name}",
                        bench=bench,
                        size=ns.size,
                        policy=ns.policy,
                    )
                if "transport" in paths:
                    got["transport"] = _per_request(
                        python, TRANSPORT, ns.requests, tmp, f"tr.{name}", url=urls[0], size=ns.size
                    )
                if "gateway" in paths:
                    gateway(name, repo)
                print(json.dumps({name: got}), flush=True)
            if ns.rust is not None:
                gateway(ns.rust, ns.rust)
                print(json.dumps({ns.rust: results[ns.rust]}), flush=True)
    finally:
        for m in mocks:
            m.terminate()
    others = [name for name in results if name != "this"]
    print(
        f"\n{'path':20} {'this (Ir/req)':>15}"
        + "".join(f" {o + ' (Ir/req)':>22} {'this/' + o:>18}" for o in others)
    )
    for key, a in results["this"].items():
        row = f"{key:20} {a:15,.0f}"
        for o in others:
            b = results[o].get(key)
            row += f" {b:22,.0f} {a / b:18.3f}" if b else f" {'-':>22} {'-':>18}"
        print(row)
    if ns.simulate:
        events = ("Ir", "I1mr", "D1mr", "D1mw", "Bc", "Bcm", "Bi", "Bim")
        print(
            f"\nper request, simulated (cachegrind)\n{'':12} {'path':14}"
            + "".join(f" {e:>9}" for e in events)
        )
        for name, table in simulated.items():
            for key, per in table.items():
                print(f"{name:12} {key:14}" + "".join(f" {per.get(e, 0):9,.0f}" for e in events))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
