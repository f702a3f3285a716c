# ruff: noqa: RUF001
"""
RESULTS.md and the plots, from ``results.json``
===============================================

``python benchmarks/run.py --report-only benchmarks/out/results.json --out DIR``
re-renders a report. Every figure is a median over rounds with its min-max; every
comparison is a ratio of two frontends measured in the same round (A/B, adjacent
in time), median over rounds with min-max.

Results are grouped by *series*: the workload, and for the tokenize workload its
prompt variant (:func:`series`): ``tokenize-repeated`` (8 prompts per size, cycled:
meshkit's prefix cache hits after the first 8 requests, like a shared system
prompt) and ``tokenize-distinct`` (a unique 256-token head per request: a fresh
tokenization every time). A results.json without the ``prompts`` field predates
the variants: its prompts were the repeated ones.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["aggregate", "parse_pyspy", "ratio", "series", "us_per_req", "write"]

KiB = 1024
MESHKIT = "meshkit"
BASELINE = "fastapi"
RUST_REF = "sglang-router"

#: the issue's targets
FLOOR_RPS, FLOOR_CPU = 2.0, 0.45
GOAL_RPS, GOAL_CPU = 1.0, 1.0
TOKENIZE_RPS = 10.0
CLIENT_CPU = 1.15
TARGET_SIZES = (1 * KiB, 16 * KiB, 64 * KiB)


def us_per_req(out: dict[str, Any]) -> float:
    ok = out.get("ok", 0)
    return out.get("frontend_cpu_s", 0.0) / ok * 1e6 if ok else float("nan")


def size_label(n: int) -> str:
    return f"{n // (KiB * KiB)} MiB" if n >= KiB * KiB else f"{n // KiB} KiB"


# -- aggregation -----------------------------------------------------------------

Key = tuple[str, int, int, str]  # series, size, clients, frontend

#: section titles and target labels per series
TITLES = {
    "proxy": "Parse + proxy (round robin, `POST /v1/completions`, non-streamed)",
    "chat": "Parse + proxy, chat (round robin, `POST /v1/chat/completions`, one user "
    "message, non-streamed)",
    "tokenize-repeated": "Parse + tokenize + proxy (prefix hash over 256 Qwen tokens), "
    "repeated prompts (8 per size, cycled: meshkit's prefix cache hits)",
    "tokenize-distinct": "Parse + tokenize + proxy (prefix hash over 256 Qwen tokens), "
    "distinct prompts (a unique 256-token head per request: no cache hit)",
}
_SERIES_ORDER = ["proxy", "chat", "tokenize-distinct", "tokenize-repeated"]


def series(r: dict[str, Any]) -> str:
    """``proxy``, ``chat``, ``tokenize-repeated`` or ``tokenize-distinct`` (see the
    module doc)."""
    workload: str = r["workload"]
    prompts = r.get("prompts", "repeated")
    if workload in ("proxy", "chat") and prompts == "repeated":
        return workload
    return f"{workload}-{prompts}"


def _skey(name: str) -> int:
    return _SERIES_ORDER.index(name) if name in _SERIES_ORDER else len(_SERIES_ORDER)


def _stats(xs: Iterable[float]) -> tuple[float, float, float]:
    vals = [x for x in xs if x == x]  # drop NaN
    if not vals:
        return (math.nan, math.nan, math.nan)
    return (statistics.median(vals), min(vals), max(vals))


def aggregate(results: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    groups: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        groups[(series(r), r["size"], r["clients"], r["frontend"])].append(r)
    out: dict[Key, dict[str, Any]] = {}
    for key, rs in groups.items():
        flags = []
        if any(r.get("errors", 0) for r in rs):
            flags.append("E")
        if key[3] != "direct" and any(
            r.get("load_side_util", 0) >= 0.9 and r.get("frontend_util", 1) < 0.85 for r in rs
        ):
            flags.append("†")
        if any(not r.get("drained", True) or r.get("ok", 0) < 20 for r in rs):
            flags.append("‡")
        if key[3] != "direct" and any(r.get("distinct_repeats", 0) for r in rs):
            flags.append("R")
        out[key] = {
            "rounds": len(rs),
            "ok": sum(r.get("ok", 0) for r in rs),
            "errors": sum(r.get("errors", 0) for r in rs),
            "first_error": next((r["first_error"] for r in rs if r.get("first_error")), ""),
            "rps": _stats(r.get("rps", 0.0) for r in rs),
            "cpu_us": _stats(us_per_req(r) for r in rs),
            "lat_mean": _stats(r.get("lat_mean_ms", math.nan) for r in rs),
            "lat_p99": _stats(r.get("lat_p99_ms", math.nan) for r in rs),
            "rss_mib": _stats(r.get("rss_bytes", 0) / 2**20 for r in rs),
            "loadgen_us": _stats(
                r.get("loadgen_cpu_s", 0) / r["ok"] * 1e6 if r.get("ok") else math.nan for r in rs
            ),
            "frontend_util": _stats(r.get("frontend_util", math.nan) for r in rs),
            "load_side_util": _stats(r.get("load_side_util", math.nan) for r in rs),
            "flags": "".join(flags),
        }
    return out


def ratio(
    results: list[dict[str, Any]], a: str, b: str, metric: str
) -> dict[tuple[str, int, int], tuple[float, ...]]:
    """Per point: ``a / b`` of ``metric`` ('rps' or 'cpu') within each round.

    Each value is (median, min, max, bound): ``bound`` is 1.0 when ``b`` completed
    no request in a window, so the ratio was taken as if it had completed one (a
    lower bound of the req/s ratio, an upper bound of the CPU ratio).
    """
    by: dict[tuple[str, int, int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in results:
        by[(series(r), r["size"], r["clients"], r["round"])][r["frontend"]] = r
    per: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    bound: set[tuple[str, int, int]] = set()
    for (w, s, c, _), fes in by.items():
        if a not in fes or b not in fes:
            continue
        ra, rb = fes[a], fes[b]
        if not ra.get("ok"):
            continue
        if metric == "rps":
            va, vb = ra.get("rps", 0.0), rb.get("rps", 0.0)
            if not rb.get("ok") and rb.get("wall_s"):
                vb = 1.0 / rb["wall_s"]
                bound.add((w, s, c))
        else:
            va, vb = us_per_req(ra), us_per_req(rb)
            if not rb.get("ok") and rb.get("frontend_cpu_s", 0) > 0:
                vb = rb["frontend_cpu_s"] * 1e6
                bound.add((w, s, c))
        if vb and vb == vb and va == va:
            per[(w, s, c)].append(va / vb)
    return {k: (*_stats(v), 1.0 if k in bound else 0.0) for k, v in per.items()}


# -- formatting --------------------------------------------------------------------


def _num(x: float) -> str:
    if x != x:
        return "–"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _rng(t: tuple[float, float, float]) -> str:
    med, lo, hi = t
    if med != med:
        return "–"
    if lo == hi:
        return _num(med)
    return f"{_num(med)} ({_num(lo)}–{_num(hi)})"


def _x(t: tuple[float, ...] | None, cpu: bool = False) -> str:
    if t is None or t[0] != t[0]:
        return "–"
    med, lo, hi = t[:3]
    mark = ("≤ " if cpu else "≥ ") if len(t) > 3 and t[3] else ""

    def r(v: float) -> str:
        return f"{v:.2f}" if v >= 0.1 else f"{v:.2g}"

    if lo == hi:
        return f"{mark}{r(med)}×"
    return f"{mark}{r(med)}× ({r(lo)}–{r(hi)})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


# -- targets -----------------------------------------------------------------------


def _median_of(points: dict[Any, tuple[float, ...]], keep: Any) -> tuple[float, ...]:
    """(median, min, max, n) over the points' median ratios."""
    vals = [v[0] for k, v in points.items() if keep(k) and v[0] == v[0]]
    if not vals:
        return ()
    return (statistics.median(vals), min(vals), max(vals), float(len(vals)))


def _count(points: dict[Any, tuple[float, ...]], keep: Any, target: float, higher: bool) -> str:
    vals = [v[0] for k, v in points.items() if keep(k) and v[0] == v[0]]
    ok = sum(1 for v in vals if (v >= target if higher else v <= target))
    return f"{ok} of {len(vals)} points meet it"


def _verdict(value: float, target: float, higher: bool) -> str:
    ok = value >= target if higher else value <= target
    if ok:
        return f"**met** ({value:.2f}× vs {'≥' if higher else '≤'} {target:.2f}×)"
    if higher:
        gap = (target / value - 1) * 100 if value > 0 else math.inf
        return f"**not met**: {value:.2f}× vs ≥ {target:.2f}× (needs {gap:.0f}% more)"
    gap = (1 - target / value) * 100
    return f"**not met**: {value:.2f}× vs ≤ {target:.2f}× (needs {gap:.0f}% less)"


def targets(data: dict[str, Any]) -> list[str]:
    res = data["results"]
    lines: list[str] = []
    in_range = lambda k: k[0] == "proxy" and k[1] in TARGET_SIZES  # noqa: E731
    rows = []
    rps_pts = ratio(res, MESHKIT, BASELINE, "rps")
    cpu_pts = ratio(res, MESHKIT, BASELINE, "cpu")
    rr = _median_of(rps_pts, in_range)
    cr = _median_of(cpu_pts, in_range)
    if rr and cr:
        rows.append(
            [
                "floor: ≥ 2.0× FastAPI req/s at ≤ 0.45× its CPU/req (proxy, 1–64 KiB)",
                f"req/s {rr[0]:.2f}× (points {rr[1]:.2f}–{rr[2]:.2f}, n={rr[3]:.0f}); "
                f"CPU/req {cr[0]:.2f}× ({cr[1]:.2f}–{cr[2]:.2f})",
                _verdict(rr[0], FLOOR_RPS, True)
                + f" ({_count(rps_pts, in_range, FLOOR_RPS, True)}); "
                + _verdict(cr[0], FLOOR_CPU, False)
                + f" ({_count(cpu_pts, in_range, FLOOR_CPU, False)})",
            ]
        )
    else:
        rows.append(["floor (vs FastAPI, proxy 1–64 KiB)", "not measured", "–"])
    rps_pts = ratio(res, MESHKIT, RUST_REF, "rps")
    cpu_pts = ratio(res, MESHKIT, RUST_REF, "cpu")
    rr = _median_of(rps_pts, in_range)
    cr = _median_of(cpu_pts, in_range)
    if rr and cr:
        rows.append(
            [
                "goal: ≥ 1.0× sglang-router 0.3.2 req/s and ≤ 1.0× its CPU/req (proxy, 1–64 KiB)",
                f"req/s {rr[0]:.2f}× ({rr[1]:.2f}–{rr[2]:.2f}, n={rr[3]:.0f}); "
                f"CPU/req {cr[0]:.2f}× ({cr[1]:.2f}–{cr[2]:.2f})",
                _verdict(rr[0], GOAL_RPS, True)
                + f" ({_count(rps_pts, in_range, GOAL_RPS, True)}); "
                + _verdict(cr[0], GOAL_CPU, False)
                + f" ({_count(cpu_pts, in_range, GOAL_CPU, False)})",
            ]
        )
    else:
        why = data.get("unavailable", {}).get(RUST_REF, "not part of this run")
        rows.append(["goal (vs sglang-router 0.3.2)", f"not measured: {why}", "–"])
    tok_pts = ratio(res, MESHKIT, BASELINE, "rps")
    variants = sorted({k[0] for k in tok_pts if k[0].startswith("tokenize")}, key=_skey)
    for name in variants or ["tokenize"]:

        def tok(k: tuple[str, int, int], name: str = name) -> bool:
            return k[0] == name and k[1] >= 16 * KiB

        prompts = name.partition("-")[2] or "any"
        label = f"tokenize workload, {prompts} prompts: ≥ 10× FastAPI req/s at ≥ 16 KiB"
        rr = _median_of(tok_pts, tok)
        if not rr:
            rows.append([label, "not measured", "–"])
            continue
        low = [
            f"{size_label(k[1])}/{k[2]}c {v[0]:.1f}×"
            for k, v in sorted(tok_pts.items())
            if tok(k) and v[0] < TOKENIZE_RPS
        ]
        rows.append(
            [
                label,
                f"req/s {rr[0]:.2f}× (points {rr[1]:.2f}–{rr[2]:.2f}, n={rr[3]:.0f})",
                _verdict(rr[0], TOKENIZE_RPS, True)
                + f" ({_count(tok_pts, tok, TOKENIZE_RPS, True)}"
                + (f"; below: {', '.join(low)}" if low else "")
                + "); ratios where the baseline completed nothing in a window count as "
                "lower bounds",
            ]
        )
    client = data.get("client") or {}
    if "ratio" in client:
        r = client["ratio"]
        rows.append(
            [
                "client side: MeshTransport ≤ 1.15× the CPU/req of a plain httpx2.Client",
                f"{r['median']:.2f}× ({r['min']:.2f}–{r['max']:.2f}); "
                f"{client['mesh_us']['median']:.0f} vs {client['plain_us']['median']:.0f} µs/req",
                _verdict(r["median"], CLIENT_CPU, False),
            ]
        )
    else:
        rows.append(["MeshTransport ≤ 1.15×", f"not measured: {client.get('error', '')}", "–"])
    lines += _table(["target", "measured (median over points; range)", "verdict"], rows)
    return lines


# -- profile -----------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _short(path: str) -> str:
    for marker in ("site-packages/", "/src/", "/lib/python3.11/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _layer(path: str) -> str:
    p = path
    for name in (
        "meshkit",
        "aiohttp",
        "uvicorn",
        "httptools",
        "starlette",
        "prometheus_client",
        "msgspec",
        "multidict",
        "yarl",
        "asyncio",
        "logging",
    ):
        if p.startswith(name + "/") or f"/{name}/" in p:
            return name
    if "uvloop" in p:
        return "uvloop"
    return "other"


def parse_pyspy(text: str) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's raw output."""
    total = 0
    self_c: dict[str, int] = defaultdict(int)
    incl_c: dict[str, int] = defaultdict(int)
    layers: dict[str, int] = defaultdict(int)
    for line in text.splitlines():
        line = line.rstrip()
        if not line or " " not in line:
            continue
        stack, _, count_s = line.rpartition(" ")
        try:
            count = int(count_s)
        except ValueError:
            continue
        frames = []
        for raw in stack.split(";"):
            m = _FRAME.match(raw.strip())
            if m is None:
                continue
            path = _short(m.group("file"))
            frames.append((f"{m.group('fn')} ({path})", path))
        if not frames:
            continue
        total += count
        self_c[frames[-1][0]] += count
        layers[_layer(frames[-1][1])] += count
        for name in {f for f, _ in frames}:
            incl_c[name] += count

    def top(d: dict[str, int], n: int) -> list[tuple[str, float]]:
        return [(k, v / total * 100) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]

    return {
        "samples": total,
        "self": top(self_c, 25) if total else [],
        "inclusive": top(incl_c, 40) if total else [],
        "layers": top(layers, 20) if total else [],
    }


# -- plots ---------------------------------------------------------------------------


def plots(data: dict[str, Any], agg: dict[Key, dict[str, Any]], out_dir: Path) -> list[str]:
    """PNG files written (relative names); [] with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError:
        return []
    res = data["results"]
    files: list[str] = []
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    workloads = sorted({series(r) for r in res}, key=_skey)
    rps = ratio(res, MESHKIT, BASELINE, "rps")
    cpu = ratio(res, MESHKIT, BASELINE, "cpu")
    if rps:
        fig, axes = plt.subplots(
            2, len(workloads), figsize=(5.2 * len(workloads), 8), squeeze=False
        )
        for col, w in enumerate(workloads):
            sizes = sorted({k[1] for k in rps if k[0] == w})
            clients = sorted({k[2] for k in rps if k[0] == w})
            for row, (src, title, cmap) in enumerate(
                (
                    (rps, "req/s, meshkit / FastAPI (higher is better)", "RdBu"),
                    (cpu, "CPU per request, meshkit / FastAPI (lower is better)", "RdBu_r"),
                )
            ):
                ax = axes[row][col]
                grid = [[src.get((w, s, c), (math.nan,))[0] for c in clients] for s in sizes]
                vals = [v for r in grid for v in r if v == v]
                if not vals:
                    ax.set_axis_off()
                    continue
                span = max(max(vals), 1 / min(vals), 1.5)
                im = ax.imshow(grid, cmap=cmap, norm=LogNorm(1 / span, span), aspect="auto")
                for i, r in enumerate(grid):
                    for j, v in enumerate(r):
                        if v == v:
                            t = f"{v:.2f}×" if v >= 0.1 else f"{v:.2g}×"
                            ax.text(j, i, t, ha="center", va="center", fontsize=9)
                ax.set_xticks(range(len(clients)), [str(c) for c in clients])
                ax.set_yticks(range(len(sizes)), [size_label(s) for s in sizes])
                ax.set_xlabel("concurrent clients")
                ax.set_title(f"{w}: {title}", fontsize=9)
                fig.colorbar(im, ax=ax, shrink=0.8)
        fig.tight_layout()
        fig.savefig(out_dir / "plots" / "ratio_heatmap.png", dpi=110)
        plt.close(fig)
        files.append("plots/ratio_heatmap.png")
    for w in workloads:
        sizes = sorted({k[1] for k in agg if k[0] == w})
        fes = [f for f in data["frontends"] if any(k[0] == w and k[3] == f for k in agg)]
        if not sizes or not fes:
            continue
        ncol = min(3, len(sizes))
        nrow = math.ceil(len(sizes) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 4 * nrow), squeeze=False)
        for i, s in enumerate(sizes):
            ax = axes[i // ncol][i % ncol]
            for f in fes:
                pts = sorted(
                    (k[2], v["rps"][0], v["lat_p99"][0])
                    for k, v in agg.items()
                    if k[0] == w and k[1] == s and k[3] == f and v["rps"][0] > 0
                )
                if pts:
                    ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=f)
                    ax.annotate(str(pts[-1][0]), (pts[-1][1], pts[-1][2]), fontsize=7)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("req/s")
            ax.set_ylabel("p99 latency (ms)")
            ax.set_title(f"{w}, {size_label(s)} (points: 1→64 clients)", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        for j in range(len(sizes), nrow * ncol):
            axes[j // ncol][j % ncol].set_axis_off()
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        name = f"plots/latency_vs_throughput_{w}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


# -- the report ------------------------------------------------------------------------


def write(data: dict[str, Any], out_dir: Path, notes: str = "") -> Path:
    res = data["results"]
    agg = aggregate(res)
    files = plots(data, agg, out_dir)
    L: list[str] = []
    L.append("# meshkit benchmark: vs the FastAPI baseline and the Rust routers")
    L.append("")
    L.append(
        f"Run of **{data['date']}**, mode **{data['mode']}**, "
        f"{data['elapsed_s'] / 60:.1f} min of machine time. Command:"
    )
    L.append("")
    L.append(f"    {data['command']}")
    L.append("")
    pin = data["pinning"]
    m = data["machine"]
    cfg = data["config"]
    L.append(
        f"Machine: {m['cpu']} ({m['cpus']} CPUs), Linux {m['kernel']}. Pinning (`taskset`): "
        f"frontend on CPU {pin['frontend_cpus']}, the {pin['backends']} mock workers "
        f"(`python -m meshkit.mock`), the load generator and the harness on CPU "
        f"{pin['load_cpus']}. {pin['note']}"
    )
    L.append(
        f"Each point: {cfg['warmup']} s warm-up then a {cfg['duration']} s window, "
        f"{cfg['rounds']} round(s), frontends alternating order every round (A/B); each "
        f"frontend got a {cfg['frontend_warmup']} s warm-up after start. Figures are "
        "medians over rounds with (min–max); ratios are taken within a round, then the "
        "median over rounds. Other load on the machine moves absolute figures between "
        "runs (the `CPU util` column shows it): trust ratios, not absolutes."
    )
    L.append("")
    L.append("Versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()) + ".")
    L.append("")
    if data.get("unavailable"):
        L.append("Not available in this run:")
        L.append("")
        for k, v in data["unavailable"].items():
            L.append(f"* {k}: {v}")
        L.append("")

    if notes.strip():
        L.append(notes.strip())
        L.append("")
    L.append("## Targets (issue 8)")
    L.append("")
    L += targets(data)
    L.append("")
    L.append(
        "Ratios are meshkit standalone / the other frontend. CPU = utime + stime of the "
        "frontend's process tree (`/proc`) over the window / successful requests."
    )
    L.append("")

    L.append("## Headline ratios (meshkit standalone vs the others)")
    L.append("")
    vs = ["meshkit-base", BASELINE, RUST_REF, "smg", "vllm-router"]
    present = {r["frontend"] for r in res}
    vs = [v for v in vs if v in present]
    pts = sorted({(series(r), r["size"], r["clients"]) for r in res}, key=_pkey)
    header = ["workload", "size", "clients"]
    cols: list[dict[tuple[str, int, int], tuple[float, ...]]] = []
    for v in vs:
        header += [f"req/s vs {v}", f"CPU/req vs {v}"]
        cols += [ratio(res, MESHKIT, v, "rps"), ratio(res, MESHKIT, v, "cpu")]
    if "meshkit-fastapi" in present and BASELINE in present:
        header += ["MeshMiddleware-in-FastAPI vs baseline: req/s", "CPU/req"]
        cols += [
            ratio(res, "meshkit-fastapi", BASELINE, "rps"),
            ratio(res, "meshkit-fastapi", BASELINE, "cpu"),
        ]
    rows = []
    for p in pts:
        if MESHKIT not in {r["frontend"] for r in res if (series(r), r["size"], r["clients"]) == p}:
            continue
        rows.append(
            [p[0], size_label(p[1]), str(p[2])]
            + [_x(c.get(p), cpu=i % 2 == 1) for i, c in enumerate(cols)]
        )
    L += _table(header, rows)
    L.append("")

    for w in sorted({series(r) for r in res}, key=_skey):
        title = TITLES.get(w, w)
        L.append(f"## {title}")
        L.append("")
        rows = []
        for k in sorted((k for k in agg if k[0] == w), key=lambda k: (k[1], k[2], _fkey(k[3]))):
            a = agg[k]
            rows.append(
                [
                    size_label(k[1]),
                    str(k[2]),
                    k[3],
                    _rng(a["rps"]),
                    _num(a["lat_mean"][0]),
                    _num(a["lat_p99"][0]),
                    _rng(a["cpu_us"]) if k[3] != "direct" else "–",
                    _num(a["rss_mib"][0]) if k[3] != "direct" else "–",
                    _num(a["loadgen_us"][0]),
                    f"{a['frontend_util'][0]:.2f} / {a['load_side_util'][0]:.2f}",
                    a["flags"]
                    + (f" {a['errors']} errors: {a['first_error']}" if a["errors"] else ""),
                ]
            )
        L += _table(
            [
                "size",
                "clients",
                "frontend",
                "req/s",
                "mean ms",
                "p99 ms",
                "CPU µs/req",
                "peak RSS MiB",
                "loadgen µs/req",
                "CPU util frontend / load side",
                "flags",
            ],
            rows,
        )
        L.append("")
    L.append(
        "Flags: E = failed requests in a round; † = the load side (CPU of the mock workers "
        "+ load generator) was ≥ 90 % busy while the frontend was < 85 % busy, so req/s is a "
        "lower bound for that frontend (CPU/req stays comparable); ‡ = fewer than 20 "
        "requests in a window or in-flight requests not drained in time; R = distinct "
        "prompts ran past the pool of unique heads (some prompts repeated). The load generator "
        "is a raw uvloop + httptools closed loop: its CPU per request is the `loadgen` "
        "column (compare with the frontends' CPU column to see it is not the bottleneck)."
    )
    L.append("")

    client = data.get("client") or {}
    L.append("## Client side: `MeshTransport` vs a plain `httpx2.Client`")
    L.append("")
    if "ratio" in client:
        L.append(
            f"Same process, sequential `POST /v1/completions` of {client['size']} B to one mock "
            f"worker in another process; `time.process_time()` over "
            f"{client['requests_per_round']} requests per client per round, the clients "
            f"taking turns in blocks of {client.get('block', client['requests_per_round'])} "
            f"(A/B, the order swapping every block), {client['rounds']} rounds "
            f"(httpx2 {client.get('httpx2', '?')})."
        )
        L.append("")
        L += _table(
            ["client", "CPU µs/req", "ratio"],
            [
                ["httpx2.Client (plain)", _rng(tuple(client["plain_us"].values())), "1×"],
                [
                    "httpx2.Client(transport=MeshTransport(mesh))",
                    _rng(tuple(client["mesh_us"].values())),
                    _x(tuple(client["ratio"].values())),
                ],
            ],
        )
    else:
        L.append(f"Not measured: {client.get('error', 'not part of this run')}")
    L.append("")

    prof = data.get("profile") or {}
    L.append("## Profile of the hot path (meshkit standalone, 1 KiB proxy, 16 clients)")
    L.append("")
    if prof.get("samples"):
        load = prof.get("load", {})
        L.append(
            f"py-spy ({prof['samples']} samples at 250 Hz, `--nonblocking`) while the load "
            f"generator ran {_num(load.get('rps', math.nan))} req/s at "
            f"{_num(us_per_req(load))} µs CPU/req (profiling overhead included). "
            "Shares are of all samples of the frontend process."
        )
        L.append("")
        L.append("Where the samples land (leaf frame's package):")
        L.append("")
        L += _table(["layer", "% of samples"], [[k, f"{v:.1f}"] for k, v in prof["layers"]])
        L.append("")
        L.append("Top functions by self time:")
        L.append("")
        L += _table(["function (file)", "self %"], [[k, f"{v:.1f}"] for k, v in prof["self"]])
        L.append("")
        L.append("Top functions by inclusive time:")
        L.append("")
        L += _table(
            ["function (file)", "inclusive %"], [[k, f"{v:.1f}"] for k, v in prof["inclusive"]]
        )
        L.append("")
    else:
        L.append(f"Not profiled: {prof.get('error', 'not part of this run (full mode only)')}")
        L.append("")

    L.append("## Plots")
    L.append("")
    if files:
        for f in files:
            L.append(f"![{f}]({f})")
            L.append("")
    else:
        L.append("No plots: matplotlib is not importable (`pip install matplotlib`).")
        L.append("")

    L.append("## Exact commands")
    L.append("")
    for k, v in data.get("commands", {}).items():
        L.append(f"* {k}: `{v}`")
    L.append("")
    text = "\n".join(L)
    path = out_dir / "RESULTS.md"
    path.write_text(text)
    return path


_FE_ORDER = [
    "meshkit",
    "meshkit-base",
    "meshkit-fastapi",
    "fastapi",
    "sglang-router",
    "smg",
    "vllm-router",
    "direct",
]


def _fkey(f: str) -> int:
    return _FE_ORDER.index(f) if f in _FE_ORDER else len(_FE_ORDER)


def _pkey(p: tuple[str, int, int]) -> tuple[int, int, int]:
    return (_skey(p[0]), p[1], p[2])
