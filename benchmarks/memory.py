"""
Memory at the configured budgets, for 64 workers
================================================

Issue 21, item 4. Every bounded structure a router keeps is filled, in process,
well past its budget through meshkit's own entry points, and measured: its size in
its own unit (through its public ``len``/size API) must end within the budget
+-10 %, and the process's memory growth divided by that size is the cost of one unit
(what an operator multiplies a budget by).

The fleet: a ``Mesh`` of 64 worker URLs that never answer (``lifecycle.probe =
false``: no probe, nothing is sent; placement only). One scenario per child process
(``multiprocessing`` spawn), so each starts from a clean heap: the baseline is taken
after the Mesh is built and warmed up (``gc.collect()`` first), then the structure
is filled one item at a time, then ``gc.collect()`` again and the end point.

Scenarios (sizes are flags):

``tree``
    ``policy = "cache_aware"``, one model, ``max_tree_size`` = ``--tree-chars``
    (8,000,000, the default of the key). Realistic chat routing texts: 40 tenants
    with system prompts of 1.5-6k characters (Zipf popularity), 64 conversations
    running at once, each of 1-8 turns (user messages 0.1-1.5k characters, replies
    0.2-1.5k, carried in the history). Each turn is one chat body through
    ``Mesh.prepare`` (the routing text), ``Router.place`` (``select`` and
    ``on_placed``: the insert) and a lease released at once. Filled until the
    *new* characters offered (what an unbounded tree would have grown by: a new
    tenant's system prompt, a new user message and the previous reply) reach
    ``--fill`` (3) times the budget. Unit: characters (``RadixTree.size``).
``tree-models``
    the same traffic spread over ``max_models + 16`` model names with
    ``max_models`` = ``--max-models`` (32, the default) and a smaller
    ``max_tree_size`` (``--models-tree-chars``, 250,000), so the worst case
    ``max_models x max_tree_size`` is reached: first all the models in turn, then
    the last ``max_models`` of them, until each kept tree got ``--fill`` times its
    budget. Unit: characters summed over the kept trees; the number of trees is
    checked too.
``tree-short``
    the other end of the text shapes: single-turn chats of one short distinct user
    message (20-200 characters) after one of 40 short system prompts, at
    ``--short-tree-chars`` (1,000,000). Many small nodes per character.
``affinity``
    the Responses affinity map (``routing.responses_affinity_max``,
    ``--affinity-entries``, 100,000) through ``Router.remember_response`` with
    OpenAI-shaped ids (``resp_`` + 48 hex) spread over the 64 origins; and the map of
    ids no origin holds (``Router.remember_missing``), which has the same bound.
    Unit: entries (``len``).
``idempotency``
    finished ``Idempotency-Key`` leases (``lifecycle.idempotency_max``,
    ``--idempotency-keys``, 10,000): small chat requests with a UUID key, prepared,
    placed, leased and released. Unit: keys (``LeaseTable.finished_keys()``).
``kv``
    the KV-event index (``kv.max_blocks_per_model``, ``--kv-blocks``, 1,000,000)
    through ``Router.kv_apply``: each of the 64 workers stores requests of 16 blocks
    of 16 tokens behind one of 8 shared 16-block system prefixes (the whole chain
    sent again, as the engine's events would after its own eviction), until
    ``--kv-fill`` (2) times the budget new entries were offered. Unit: (worker,
    block) entries (``len(KvIndex)``).

Each scenario runs twice, in fresh processes: once without tracing (RSS growth,
from ``/proc/self/statm``: what the process really costs, allocator slack
included) and once under ``tracemalloc`` (live Python allocations; tracing itself
costs memory, so its RSS is not used). Bytes per unit = growth / units gained.

::

    python benchmarks/memory.py                         # -> benchmarks/MEMORY.md
    python benchmarks/memory.py --scenarios tree,kv --kv-blocks 200000 --out /tmp/m.md
    python benchmarks/memory.py --quick                 # budgets / 10, prints only

By default ``src/meshkit`` is copied at start and the children import the copy
(``--live-src``: src/ itself). A hand-written ``## Reading`` section already in
``--out`` is kept on rewrite.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import random
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from _common import cpu_model, source_state, write_report

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKERS = 64
SCENARIOS = ("tree", "tree-models", "tree-short", "affinity", "idempotency", "kv")
#: +- this fraction of the budget counts as "within budget"
TOLERANCE = 0.10
PAGE = os.sysconf("SC_PAGE_SIZE")
CHAT = "/v1/chat/completions"
_HEADERS = [(b"content-type", b"application/json")]

_VOCAB = (
    "the of and to in is for on that with as by at from this be are or an it not "
    "router worker cache prefix tenant request token model policy fleet engine block "
    "answer question system prompt latency queue balance event index memory replica "
    "account invoice order product customer support ticket refund shipping delivery "
    "weather travel booking flight hotel recipe garden music movie history science"
)
WORDS = _VOCAB.split()


# -- measuring ---------------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def traced() -> int:
    import tracemalloc

    return tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0


def settle() -> tuple[int, int]:
    gc.collect()
    return rss(), traced()


class Probe:
    """Checkpoints while a structure fills: (offered, size, RSS, traced) at every
    quarter of the budget offered."""

    def __init__(self, budget: int, size: Callable[[], int]) -> None:
        self.budget = budget
        self.size = size
        self.next_at = budget / 4
        self.points: list[tuple[int, int, int, int]] = []
        self.max_seen = 0

    def offered(self, n: int) -> None:
        s = self.size()
        if s > self.max_seen:
            self.max_seen = s
        if n >= self.next_at:
            self.points.append((n, s, rss(), traced()))
            self.next_at += self.budget / 4


# -- workloads ---------------------------------------------------------------------------


def corpus(rng: random.Random, chars: int) -> str:
    """Random words (references to the vocabulary's strings: building it leaves no
    small freed objects behind to flatter the RSS that follows)."""
    return " ".join(rng.choices(WORDS, k=chars // 6))


class Text:
    """Slices of a pre-generated random text (cheap distinct strings)."""

    def __init__(self, rng: random.Random, chars: int = 4_000_000) -> None:
        self.rng = rng
        self.text = corpus(rng, chars)

    def take(self, lo: int, hi: int) -> str:
        n = self.rng.randrange(lo, hi)
        at = self.rng.randrange(0, len(self.text) - n)
        return self.text[at : at + n]


def zipf(n: int, s: float = 1.1) -> list[float]:
    w = [1.0 / k**s for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def chats(
    rng: random.Random, text: Text, models: Callable[[], str], *, short: bool = False
) -> Generator[tuple[bytes, int], None, None]:
    """Chat bodies and the new characters each offers (see the module documentation).

    64 conversations run at once; each turn carries the history (system prompt, the
    earlier user messages and replies)."""
    tenants = 40
    if short:
        systems = [f"You are bot {t}. " + text.take(20, 120) for t in range(tenants)]
    else:
        systems = [
            f"You are the assistant of tenant {t}. " + text.take(1500, 6000) for t in range(tenants)
        ]
    weights = zipf(tenants)
    seen: set[tuple[str, int]] = set()
    slots: list[dict[str, Any] | None] = [None] * 64
    while True:
        i = rng.randrange(len(slots))
        conv = slots[i]
        if conv is None or conv["left"] == 0:
            t = rng.choices(range(tenants), weights)[0]
            conv = {
                "model": models(),
                "tenant": t,
                "messages": [{"role": "system", "content": systems[t]}],
                "left": 1 if short else rng.randrange(1, 9),
                "reply": 0,
            }
            slots[i] = conv
        new = conv["reply"]
        if (conv["model"], conv["tenant"]) not in seen:
            seen.add((conv["model"], conv["tenant"]))
            new += len(systems[conv["tenant"]])
        user = f"[{uuid.uuid4().hex[:8]}] " + (
            text.take(20, 200) if short else text.take(100, 1500)
        )
        conv["messages"].append({"role": "user", "content": user})
        new += len(user)
        body = json.dumps({"model": conv["model"], "messages": conv["messages"], "max_tokens": 64})
        yield body.encode(), new
        conv["left"] -= 1
        reply = text.take(200, 1500)
        conv["messages"].append({"role": "assistant", "content": reply})
        conv["reply"] = len(reply)


# -- the scenarios (each runs in a child process) --------------------------------------


def worker_urls() -> list[str]:
    return [f"http://10.20.{i // 200}.{i % 200 + 1}:8000" for i in range(WORKERS)]


def _place(mesh: Any, match: Any, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """One request through prepare, placement and a lease released at once."""
    view = mesh.prepare(match, body, headers)
    router = mesh.router
    cand = router.place(view, exclude=frozenset(), attempt=0)
    router.lease(cand, view).release(ok=True, status=200)


def scenario_tree(p: dict[str, Any]) -> dict[str, Any]:
    from meshkit import Mesh

    kind = p["name"]
    budget = p["tree_chars"]
    n_models = 1
    if kind == "tree-models":
        budget = p["models_tree_chars"]
        n_models = p["max_models"]
    elif kind == "tree-short":
        budget = p["short_tree_chars"]

    def build() -> Any:
        return Mesh(
            workers=worker_urls(),
            policy="cache_aware",
            lifecycle={"probe": False},
            policies={"cache_aware": {"max_tree_size": budget, "max_models": n_models}},
        )

    rng = random.Random(p["seed"])
    text = Text(rng)
    extra = 16 if kind == "tree-models" else 0
    names = [f"model-{i}" for i in range(n_models + extra)]
    phase = {"pool": names}
    short = kind == "tree-short"
    # warm-up on a mesh of its own (lazy imports, first-use caches), then a fresh one
    warm = build()
    match = warm.resolve("POST", CHAT)
    gen = chats(random.Random(0), text, lambda: "warm-up", short=short)
    for _ in range(50):
        _place(warm, match, next(gen)[0], _HEADERS)
    gen.close()
    warm.close()
    del warm, gen
    mesh = build()
    policy = mesh.policy
    gen = chats(rng, text, lambda: rng.choice(phase["pool"]), short=short)

    def size() -> int:
        return sum(t.size for t in (policy.tree(m) for m in names) if t is not None)

    def trees() -> int:
        return sum(1 for m in names if policy.tree(m) is not None)

    total_budget = budget * n_models
    size0 = size()
    rss0, tr0 = settle()
    probe = Probe(total_budget, size)
    offered = 0
    placements = 0
    t0 = time.perf_counter()
    target = p["fill"] * total_budget
    if kind == "tree-models":
        # first every model in turn (the cap drops trees), then the last n_models
        while offered < total_budget:
            body, new = next(gen)
            _place(mesh, match, body, _HEADERS)
            offered += new
            placements += 1
            probe.offered(offered)
        phase["pool"] = names[extra:]
    while offered < target:
        body, new = next(gen)
        _place(mesh, match, body, _HEADERS)
        offered += new
        placements += 1
        probe.offered(offered)
    seconds = time.perf_counter() - t0
    gen.close()
    del gen
    rss1, tr1 = settle()
    final = size()
    nodes = sum(len(t) for t in (policy.tree(m) for m in names) if t is not None)
    kept = [t.size for t in (policy.tree(m) for m in names) if t is not None]
    out = {
        "unit": "characters",
        "budget": total_budget,
        "final": final,
        "start": size0,
        "max_seen": probe.max_seen,
        "offered": offered,
        "placements": placements,
        "seconds": seconds,
        "rss": (rss0, rss1),
        "traced": (tr0, tr1),
        "points": probe.points,
        "extra": {
            "nodes": nodes,
            "chars_per_node": final / nodes if nodes else 0.0,
            "trees": trees(),
            "max_trees": n_models,
            "largest_tree": max(kept, default=0),
            "smallest_tree": min(kept, default=0),
            "tree_budget": budget,
        },
    }
    mesh.close()
    return out


def scenario_affinity(p: dict[str, Any]) -> dict[str, Any]:
    from meshkit import Mesh

    budget = p["affinity_entries"]
    mesh = Mesh(
        workers=worker_urls(),
        lifecycle={"probe": False},
        routing={"responses_affinity_max": budget},
    )
    router = mesh.router
    origins = [w.origin for w in mesh.workers]
    rng = random.Random(p["seed"])

    def ids() -> Iterator[str]:
        while True:
            yield "resp_" + rng.getrandbits(192).to_bytes(24, "big").hex()

    gen = ids()
    for _ in range(100):
        router.remember_response(next(gen), origins[0])
        router.remember_missing(next(gen))
    start = len(router.affinity), len(router.missing)
    rss0, tr0 = settle()
    probe = Probe(budget, lambda: len(router.affinity))
    target = int(p["fill"] * budget)
    t0 = time.perf_counter()
    for i in range(target):
        router.remember_response(next(gen), origins[i % len(origins)])
        probe.offered(i + 1)
    secs_a = time.perf_counter() - t0
    rss1, tr1 = settle()
    mid_points = probe.points
    max_a = probe.max_seen
    final_a = len(router.affinity)
    probe = Probe(budget, lambda: len(router.missing))
    t0 = time.perf_counter()
    for i in range(target):
        router.remember_missing(next(gen))
        probe.offered(i + 1)
    secs_m = time.perf_counter() - t0
    rss2, tr2 = settle()
    out = {
        "unit": "entries",
        "budget": budget,
        "final": final_a,
        "start": start[0],
        "max_seen": max_a,
        "offered": target,
        "seconds": secs_a,
        "rss": (rss0, rss1),
        "traced": (tr0, tr1),
        "points": mid_points,
        "extra": {
            "missing": {
                "final": len(router.missing),
                "start": start[1],
                "max_seen": probe.max_seen,
                "rss": (rss1, rss2),
                "traced": (tr1, tr2),
                "seconds": secs_m,
                "points": probe.points,
            }
        },
    }
    mesh.close()
    return out


def scenario_idempotency(p: dict[str, Any]) -> dict[str, Any]:
    from meshkit import Mesh

    budget = p["idempotency_keys"]
    mesh = Mesh(
        workers=worker_urls(),
        lifecycle={"probe": False, "idempotency_max": budget},
    )
    leases = mesh.router.states.leases
    match = mesh.resolve("POST", CHAT)
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 8}
    ).encode()

    def headers() -> list[tuple[bytes, bytes]]:
        return [*_HEADERS, (b"idempotency-key", str(uuid.uuid4()).encode())]

    for _ in range(100):
        _place(mesh, match, body, headers())
    start = leases.finished_keys()
    rss0, tr0 = settle()
    probe = Probe(budget, leases.finished_keys)
    target = int(p["fill"] * budget)
    t0 = time.perf_counter()
    for i in range(target):
        _place(mesh, match, body, headers())
        probe.offered(i + 1)
    seconds = time.perf_counter() - t0
    rss1, tr1 = settle()
    out = {
        "unit": "keys",
        "budget": budget,
        "final": leases.finished_keys(),
        "start": start,
        "max_seen": probe.max_seen,
        "offered": target,
        "seconds": seconds,
        "rss": (rss0, rss1),
        "traced": (tr0, tr1),
        "points": probe.points,
        "extra": {"replayed": leases.replayed_total, "running": mesh.total_load()},
    }
    mesh.close()
    return out


def scenario_kv(p: dict[str, Any]) -> dict[str, Any]:
    from meshkit import Mesh
    from meshkit.core.kv_events import Batch, BlockStored

    budget = p["kv_blocks"]
    bs, sys_blocks, req_blocks, tenants = 16, 16, 16, 8
    mesh = Mesh(
        workers=worker_urls(),
        lifecycle={"probe": False},
        kv={"max_blocks_per_model": budget},
    )
    router = mesh.router
    kv = router.fleet.kv
    ids = [w.id for w in mesh.workers]
    rng = random.Random(p["seed"])
    pool = tuple(rng.randrange(150_000) for _ in range(1 << 20))
    sys_tokens = [pool[t * 4096 : t * 4096 + sys_blocks * bs] for t in range(tenants)]
    seq = 0

    def request(w: int) -> Batch:
        nonlocal seq
        t = rng.randrange(tenants)
        at = rng.randrange(len(pool) - req_blocks * bs)
        tokens = sys_tokens[t] + pool[at : at + req_blocks * bs]
        # the engine's own hashes: per worker and block (vLLM seeds them per process)
        hashes = [((w + 1) << 48) | (t << 40) | j for j in range(sys_blocks)]
        hashes += [(1 << 62) | (seq + j) for j in range(req_blocks)]
        seq += req_blocks
        event = BlockStored(tuple(hashes), None, tokens, bs)
        return Batch(0.0, (event,))

    for i in range(64):
        router.kv_apply(ids[i % WORKERS], [request(i % WORKERS)])
    start = len(kv)
    rss0, tr0 = settle()
    probe = Probe(budget, lambda: len(kv))
    target = p["kv_fill"] * budget
    offered = 0
    requests = 0
    t0 = time.perf_counter()
    while offered < target:
        w = requests % WORKERS
        router.kv_apply(ids[w], [request(w)])
        offered += req_blocks
        requests += 1
        probe.offered(offered)
    seconds = time.perf_counter() - t0
    rss1, tr1 = settle()
    out = {
        "unit": "blocks",
        "budget": budget,
        "final": len(kv),
        "start": start,
        "max_seen": probe.max_seen,
        "offered": offered,
        "seconds": seconds,
        "rss": (rss0, rss1),
        "traced": (tr0, tr1),
        "points": probe.points,
        "extra": {
            "evicted": kv.evicted,
            "unchained": kv.unchained,
            "groups": kv.group_sizes(),
            "requests": requests,
        },
    }
    mesh.close()
    return out


def run_scenario(params: dict[str, Any], trace: bool) -> dict[str, Any]:
    """The child process's entry point: one scenario, traced or not."""
    import tracemalloc

    if params.get("snapshot"):
        sys.path.insert(0, params["snapshot"])
    if trace:
        tracemalloc.start(1)
    name = params["name"]
    if name.startswith("tree"):
        out = scenario_tree(params)
    elif name == "affinity":
        out = scenario_affinity(params)
    elif name == "idempotency":
        out = scenario_idempotency(params)
    else:
        out = scenario_kv(params)
    out["peak_rss"] = _status_kib("VmHWM") * 1024
    out["traced_peak"] = tracemalloc.get_traced_memory()[1] if trace else 0
    return out


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


# -- the report --------------------------------------------------------------------------


def machine() -> str:
    model = cpu_model()
    mem = _meminfo_kib("MemTotal") / 1024 / 1024
    return (
        f"{os.cpu_count()} cores ({model or platform.processor() or 'unknown CPU'}), "
        f"{mem:.0f} GiB RAM, {platform.system()} {platform.release()}, Python "
        f"{platform.python_version()}; shared with other work (it does not change memory "
        "figures, only the fill times)"
    )


def _meminfo_kib(key: str) -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


MiB = 1024 * 1024


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def _verdict(final: int, budget: int) -> str:
    lo, hi = budget * (1 - TOLERANCE), budget * (1 + TOLERANCE)
    return "met" if lo <= final <= hi else "NOT met"


LABELS = {
    "tree": "cache_aware tree, 1 model (`max_tree_size`)",
    "tree-models": "cache_aware trees, `max_models` models (`max_models x max_tree_size`)",
    "tree-short": "cache_aware tree, 1 model, short single-turn chats",
    "affinity": "Responses affinity map (`routing.responses_affinity_max`)",
    "affinity-missing": "ids no origin holds (same bound, `Router.missing`)",
    "idempotency": "finished Idempotency-Keys (`lifecycle.idempotency_max`)",
    "kv": "KV-event index (`kv.max_blocks_per_model`)",
}


def rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per structure: sizes from the RSS pass, traced bytes from the traced one."""
    out = []
    for name, r in results.items():
        plain, tr = r["plain"], r["traced"]
        items = [(name, plain, tr)]
        if name == "affinity":
            items.append(("affinity-missing", plain["extra"]["missing"], tr["extra"]["missing"]))
        for key, a, b in items:
            units = a["final"] - a["start"]
            d_rss = a["rss"][1] - a["rss"][0]
            d_tr = b["traced"][1] - b["traced"][0]
            units_tr = b["final"] - b["start"]
            out.append(
                {
                    "key": key,
                    "unit": plain["unit"],
                    "budget": plain["budget"],
                    "final": a["final"],
                    "max_seen": a["max_seen"],
                    "offered": plain["offered"],
                    "verdict": _verdict(a["final"], plain["budget"]),
                    "rss": d_rss,
                    "traced": d_tr,
                    "rss_per_unit": d_rss / units if units else float("nan"),
                    "traced_per_unit": d_tr / units_tr if units_tr else float("nan"),
                    "seconds": a["seconds"],
                    "seconds_traced": b["seconds"],
                }
            )
    return out


def render(
    args: argparse.Namespace,
    argv: list[str],
    results: dict[str, dict[str, Any]],
    wall_s: float,
    started: str,
) -> str:
    cmd = shlex.join(["python", "benchmarks/memory.py", *argv])
    lines = [
        "# Memory at the configured budgets, 64 workers (benchmarks/memory.py)",
        "",
        f"Command ({started}; {wall_s:.0f} s wall):",
        "",
        f"    {cmd}",
        "",
        f"Machine: {machine()}.",
        "",
        f"meshkit measured: {args.source}.",
        "",
        f"A `Mesh` of {WORKERS} worker URLs, `lifecycle.probe = false` (nothing is sent). "
        "Each structure filled in a fresh process, one item at a time, through meshkit's "
        f"entry points, to {args.fill:g}x its budget (KV index: {args.kv_fill:g}x); growth is "
        "from after the Mesh is built and warmed up to the end, both after `gc.collect()`. "
        "RSS from `/proc/self/statm` in a run without tracing; traced = live Python "
        "allocations (`tracemalloc`) in a second run. Bytes per unit = growth / units "
        "gained. Within budget: the final size is within +-10 % of the budget.",
        "",
        "## Headline",
        "",
        "| structure | unit | budget | offered | final size | max seen | within budget | "
        "RSS growth MiB | traced MiB | RSS B/unit | traced B/unit | fill s (traced s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    table = rows(results)
    for r in table:
        lines.append(
            f"| {LABELS[r['key']]} | {r['unit']} | {r['budget']:,} | {r['offered']:,} | "
            f"{r['final']:,} | {r['max_seen']:,} | **{r['verdict']}** | {_mib(r['rss'])} | "
            f"{_mib(r['traced'])} | {r['rss_per_unit']:.1f} | {r['traced_per_unit']:.1f} | "
            f"{r['seconds']:.1f} ({r['seconds_traced']:.1f}) |"
        )
    lines += ["", "## Details", ""]
    for name, r in results.items():
        plain = r["plain"]
        ex = plain["extra"]
        lines.append(f"### {LABELS[name]}")
        lines.append("")
        if name.startswith("tree"):
            lines.append(
                f"{plain['placements']:,} placements; at the end {ex['trees']} tree(s) "
                f"(cap {ex['max_trees']}), largest {ex['largest_tree']:,} and smallest "
                f"{ex['smallest_tree']:,} characters (budget "
                f"{ex['tree_budget']:,} each), {ex['nodes']:,} nodes, "
                f"{ex['chars_per_node']:.0f} characters per node; peak RSS of the process "
                f"{_mib(plain['peak_rss'])} MiB."
            )
        elif name == "affinity":
            m = ex["missing"]
            lines.append(
                f"Ids no origin holds (`Router.missing`, bounded by the same key): final "
                f"{m['final']:,}, max seen {m['max_seen']:,}; RSS growth "
                f"{_mib(m['rss'][1] - m['rss'][0])} MiB. Both maps full: "
                f"{_mib(plain['rss'][1] - plain['rss'][0] + m['rss'][1] - m['rss'][0])} MiB."
            )
        elif name == "idempotency":
            lines.append(
                f"{ex['replayed']} replays (keys are UUIDs, none should repeat), "
                f"{ex['running']} leases still running at the end."
            )
        elif name == "kv":
            lines.append(
                f"{ex['requests']:,} stored requests; {ex['evicted']:,} entries evicted by the "
                f"bound, {ex['unchained']:,} blocks skipped as unchained; entries per model "
                f"group {ex['groups']}; peak RSS {_mib(plain['peak_rss'])} MiB. The "
                f"tracemalloc run used a budget of {r['traced']['budget']:,} blocks (its "
                "traced MiB are for that budget; bytes per block are per block)."
            )
        lines += [
            "",
            f"| offered {plain['unit']} | size | RSS MiB (growth) |",
            "|---|---|---|",
        ]
        rss0 = plain["rss"][0]
        for offered, size, rss_now, _ in plain["points"]:
            lines.append(f"| {offered:,} | {size:,} | {_mib(rss_now - rss0)} |")
        lines.append("")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    import multiprocessing as mp

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--fill", type=float, default=3.0, help="offered / budget")
    ap.add_argument("--kv-fill", type=float, default=2.0, help="offered / budget, KV index")
    ap.add_argument("--tree-chars", type=int, default=8_000_000)
    ap.add_argument("--max-models", type=int, default=32)
    ap.add_argument("--models-tree-chars", type=int, default=250_000)
    ap.add_argument("--short-tree-chars", type=int, default=1_000_000)
    ap.add_argument("--affinity-entries", type=int, default=100_000)
    ap.add_argument("--idempotency-keys", type=int, default=10_000)
    ap.add_argument("--kv-blocks", type=int, default=1_000_000)
    ap.add_argument(
        "--kv-traced-blocks",
        type=int,
        help="budget of the KV index's tracemalloc run (default: --kv-blocks / 4; tracing "
        "millions of small objects is slow, and bytes per block do not depend on it)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-trace", action="store_true", help="skip the tracemalloc runs")
    ap.add_argument("--quick", action="store_true", help="budgets / 10; prints only")
    ap.add_argument("--out", help="Markdown report (default: benchmarks/MEMORY.md; '' none)")
    ap.add_argument("--live-src", action="store_true", help="import src/ itself, not a copy")
    args = ap.parse_args(argv)
    if args.quick:
        for key in (
            "tree_chars",
            "models_tree_chars",
            "short_tree_chars",
            "affinity_entries",
            "idempotency_keys",
            "kv_blocks",
        ):
            setattr(args, key, max(1000, getattr(args, key) // 10))
        # a tree much smaller than one conversation's text cannot stay full (the
        # insert of a text longer than the budget evicts all of it): keep 100k
        args.models_tree_chars = max(args.models_tree_chars, 100_000)
    if args.kv_traced_blocks is None:
        args.kv_traced_blocks = max(1000, args.kv_blocks // 4)
    if args.out is None:
        args.out = "" if args.quick else str(HERE / "MEMORY.md")
    names = [s for s in args.scenarios.split(",") if s]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    args.source = source_state(REPO)
    snapshot = None
    if not args.live_src:
        snapshot = tempfile.mkdtemp(prefix="meshkit-src-")
        shutil.copytree(
            REPO / "src" / "meshkit",
            Path(snapshot) / "meshkit",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        args.source += " (a copy taken at start)"
    started = dt.datetime.now(dt.UTC).strftime("%d %b %Y, %H:%M UTC")
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            params: dict[str, int | float | str | None] = {
                k: v for k, v in vars(args).items() if isinstance(v, int | float | str)
            }
            params.update(name=name, snapshot=snapshot)
            r: dict[str, Any] = {}
            for trace in (False,) if args.no_trace else (False, True):
                run_params = dict(params)
                if trace and name == "kv":
                    run_params["kv_blocks"] = args.kv_traced_blocks
                with ctx.Pool(1, maxtasksperchild=1) as pool:
                    r["traced" if trace else "plain"] = pool.apply(
                        run_scenario, (run_params, trace)
                    )
                got = r["traced" if trace else "plain"]
                print(
                    f"[{time.strftime('%H:%M:%S')}] {name} {'traced' if trace else 'plain'}: "
                    f"{got['final']:,} {got['unit']} (budget {got['budget']:,}), RSS +"
                    f"{_mib(got['rss'][1] - got['rss'][0])} MiB, traced +"
                    f"{_mib(got['traced'][1] - got['traced'][0])} MiB, {got['seconds']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            if args.no_trace:
                r["traced"] = r["plain"]
            results[name] = r
    finally:
        if snapshot:
            shutil.rmtree(snapshot, ignore_errors=True)
    text = render(args, argv, results, time.monotonic() - t0, started)
    print(text)
    if args.out:
        write_report(Path(args.out), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
