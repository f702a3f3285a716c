"""
Routing quality: prefix-cache hit rate versus load balance
==========================================================

A simulated (no sockets, no clocks) multi-tenant chat workload replayed against a
fleet of workers that each keep a finite LRU prefix cache, once per placement
policy. The policies run through the real API: ``create_policy`` and a
``PlacementContext`` per request, with ``on_placed`` / ``on_complete`` hooks.

Workload
--------
- ``--tenants`` tenants (20), each with its own 2-4k-character system prompt;
  tenant popularity is Zipf-distributed (``--zipf`` 1.1: the hottest tenant gets
  about 30 % of conversations).
- ``--conversations`` multi-turn conversations arriving as a Poisson process;
  turn counts are geometric (mean ~4, at most ``--max-turns`` 12), each turn's
  prompt is the system prompt plus the whole history plus a new user message,
  and the next turn arrives after the previous answer and an exponential think
  time.
- A prompt's text is the routing text meshkit builds for that chat request
  (``role\ncontent`` per message, joined by newlines, as
  :func:`meshkit.core.requests.parse_request` does; checked on a sample of real
  request bodies at start-up), so policies see what they see in production.
- A request's service time depends only on its prompt and output sizes, so every
  policy sees exactly the same arrival/completion schedule and the comparison
  is fair (cache hits do not feed back into latency).

Cache model
-----------
Each worker caches blocks of 64 characters (~16 tokens at 4 characters per
token), keyed by a hash chain as in vLLM's automatic prefix caching, LRU
evicted at ``--cache-tokens`` per worker. A request hits its longest run of
leading blocks present on its worker; the prompt's blocks are cached on arrival
and the answer's blocks on completion.

Reference points
----------------
- **oracle**: every request goes to the worker whose *real* cache holds most of
  its prompt, ignoring load (ties: fewest in flight). This is the target the
  ratios refer to. It is not a strict upper bound: piling a hot tenant onto one
  worker thrashes that worker's cache, so a balanced policy can beat it.
- **oracle within the bound**: the same, among the workers that the
  ``load_factor`` 1.25 bound of ``prefix_hash`` admits. What a policy that knew
  every cache could reach while obeying that per-request bound.
- **bound**: the hit rate of one infinite cache shared by all workers, a true
  upper bound for any placement.

The ``select`` column is the mean wall time of one ``policy.select`` call in the
replay (noisy on a shared machine: compare policies within one run).

Usage::

    python benchmarks/routing_quality.py [--workers 6] [--png out.png]
    python benchmarks/routing_quality.py --micro 7   # time select alone (see micro)
    python benchmarks/routing_quality.py --routers 1,4 [multi_router.py options]

``--routers K`` (or a list) is the live benchmark of K independent router
processes over one fleet of mock workers (finite prefix caches in token blocks, KV
events, ``/metrics``): every other option is :mod:`multi_router`'s, and the
simulation here does not run.

Prints a Markdown table. ``--png`` writes a plot when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshkit.core.endpoints import resolve
from meshkit.core.policies import Completion, PlacementContext, Policy, create_policy
from meshkit.core.requests import RequestView, parse_request
from meshkit.core.workers import Candidate, Worker

BLOCK = 64  # characters per cache block (~16 tokens)
CHARS_PER_TOKEN = 4
CHAT = resolve("POST", "/v1/chat/completions")


# -- workload ------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    rid: int
    conv: int
    tenant: int
    turn: int
    prompt_len: int  # characters of the prompt (a prefix of the transcript)
    done_len: int  # characters of the transcript once the answer is written
    arrive: float
    finish: float


@dataclass(slots=True)
class Conversation:
    cid: int
    tenant: int
    transcript: str = ""
    keys: list[bytes] = field(default_factory=list)

    def block_keys(self, length: int) -> list[bytes]:
        """Hash-chain keys of the full blocks of ``transcript[:length]`` (memoised)."""
        n = length // BLOCK
        keys = self.keys
        prev = keys[-1] if keys else b""
        for i in range(len(keys), n):
            block = self.transcript[i * BLOCK : (i + 1) * BLOCK].encode()
            prev = hashlib.blake2b(prev + block, digest_size=12).digest()
            keys.append(prev)
        return keys[:n]


def _zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def build_workload(args: argparse.Namespace) -> tuple[list[Conversation], list[Request]]:
    rng = random.Random(args.seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     ,.\n"
    pool = "".join(rng.choice(alphabet) for _ in range(1 << 20))

    def text(n: int) -> str:
        at = rng.randrange(len(pool) - n)
        return pool[at : at + n]

    # Message contents; the transcript is the routing text of the chat request
    # (see check_routing_text): "role\ncontent" per message, joined by "\n".
    systems = [f"system[{t}]: " + text(rng.randrange(2000, 4000)) for t in range(args.tenants)]
    tenant_w = _zipf_weights(args.tenants, args.zipf)
    convs: list[Conversation] = []
    reqs: list[Request] = []
    start = 0.0
    for cid in range(args.conversations):
        start += rng.expovariate(args.rate)
        tenant = rng.choices(range(args.tenants), tenant_w)[0]
        conv = Conversation(cid, tenant)
        turns = min(args.max_turns, 1 + int(rng.expovariate(1 / 3.0)))
        parts = ["system\n" + systems[tenant]]
        t = start
        for k in range(turns):
            parts.append(f"\nuser\nuser[{cid}.{k}]: " + text(rng.randrange(100, 600)))
            prompt_len = sum(map(len, parts))
            out_chars = rng.randrange(200, 1200)
            parts.append("\nassistant\n" + text(out_chars))
            done_len = sum(map(len, parts))
            # Prefill ~10k tokens/s, decode ~60 tokens/s, plus a fixed overhead.
            service = (
                0.05 + prompt_len / CHARS_PER_TOKEN / 10_000 + out_chars / CHARS_PER_TOKEN / 60
            )
            reqs.append(Request(len(reqs), cid, tenant, k, prompt_len, done_len, t, t + service))
            t += service + rng.expovariate(1 / args.think)
        conv.transcript = "".join(parts)
        convs.append(conv)
    return convs, reqs


def check_routing_text(convs: Sequence[Conversation], reqs: Sequence[Request]) -> None:
    """Parse real chat bodies for a sample of requests: their routing text is the prompt."""
    assert CHAT is not None
    for r in reqs[:: max(1, len(reqs) // 200)]:
        prompt = convs[r.conv].transcript[: r.prompt_len]
        messages = []
        for i, part in enumerate(prompt.split("\nassistant\n")):
            if i:
                answer, _, part = part.partition("\nuser\n")
                messages.append({"role": "assistant", "content": answer})
                messages.append({"role": "user", "content": part})
            else:
                system, _, first = part.partition("\nuser\n")
                messages.append({"role": "system", "content": system.removeprefix("system\n")})
                messages.append({"role": "user", "content": first})
        body = json.dumps({"model": "bench-model", "messages": messages}).encode()
        view = parse_request(CHAT, body, want_text=True)
        if view.routing_text != prompt:
            raise SystemExit(f"request {r.rid}: the simulated prompt is not meshkit's routing text")


# -- cache model -----------------------------------------------------------------------


class BlockCache:
    """A worker's prefix cache: LRU over hash-chained blocks."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def hit(self, keys: Sequence[bytes]) -> int:
        """Leading blocks present (not touching anything)."""
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n

    def add(self, keys: Sequence[bytes]) -> None:
        blocks = self.blocks
        for k in keys:
            if k in blocks:
                blocks.move_to_end(k)
            else:
                blocks[k] = None
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)


# -- replay --------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    name: str
    hit_tokens: int = 0
    prompt_tokens: int = 0
    per_worker: list[int] = field(default_factory=list)
    inflight_area: list[float] = field(default_factory=list)
    peak_inflight: list[int] = field(default_factory=list)
    seconds: float = 0.0
    select_s: float = 0.0  # time in policy.select, summed
    decisions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    @staticmethod
    def _imbalance(xs: Sequence[float]) -> float:
        mean = sum(xs) / len(xs)
        return max(xs) / mean if mean else 0.0

    @property
    def req_imbalance(self) -> float:
        return self._imbalance(self.per_worker)

    @property
    def inflight_imbalance(self) -> float:
        return self._imbalance(self.inflight_area)


#: (request, conversation, its prompt's block keys, in-flight load, the caches) -> worker
Chooser = Callable[
    [Request, Conversation, list[bytes], Mapping[str, int], Sequence[BlockCache]], int
]


def replay(
    name: str,
    convs: Sequence[Conversation],
    reqs: Sequence[Request],
    fleet: Sequence[Candidate],
    cache_blocks: int | None,
    choose: Chooser,
    on_placed: Callable[[int, Request, Conversation, float], None] | None = None,
    on_done: Callable[[int, Request, Conversation, float], None] | None = None,
) -> Result:
    t0 = time.perf_counter()
    n = len(fleet)
    caches = [BlockCache(cache_blocks) for _ in range(n)]
    load = {c.key: 0 for c in fleet}
    res = Result(name, per_worker=[0] * n, inflight_area=[0.0] * n, peak_inflight=[0] * n)
    events: list[tuple[float, int, int]] = []  # (time, 0 = finish first / 1 = arrive, rid)
    for r in reqs:
        events.append((r.arrive, 1, r.rid))
        events.append((r.finish, 0, r.rid))
    heapq.heapify(events)
    placed: dict[int, int] = {}
    last_t = 0.0
    while events:
        t, kind, rid = heapq.heappop(events)
        dt = t - last_t
        if dt > 0:
            for i, c in enumerate(fleet):
                res.inflight_area[i] += load[c.key] * dt
            last_t = t
        r = reqs[rid]
        conv = convs[r.conv]
        if kind == 1:
            keys = conv.block_keys(r.prompt_len)
            w = choose(r, conv, keys, load, caches)
            placed[rid] = w
            hit = caches[w].hit(keys)
            res.hit_tokens += hit * BLOCK // CHARS_PER_TOKEN
            res.prompt_tokens += r.prompt_len // CHARS_PER_TOKEN
            caches[w].add(keys)
            key = fleet[w].key
            load[key] += 1
            res.per_worker[w] += 1
            res.peak_inflight[w] = max(res.peak_inflight[w], load[key])
            if on_placed is not None:
                on_placed(w, r, conv, t)
        else:
            w = placed.pop(rid)
            load[fleet[w].key] -= 1
            caches[w].add(conv.block_keys(r.done_len))
            if on_done is not None:
                on_done(w, r, conv, t)
    res.seconds = time.perf_counter() - t0
    return res


def run_policy(
    label: str,
    spec: str,
    options: Mapping[str, Any],
    convs: Sequence[Conversation],
    reqs: Sequence[Request],
    fleet: Sequence[Candidate],
    cache_blocks: int,
    record: list[PlacementContext] | None = None,
    processes: int = 1,
    spread: str = "request",
) -> Result:
    """Replay through the policy; ``record`` collects every context (loads copied).

    ``processes`` > 1 is ``meshkit serve --processes N``: N independent routers,
    each with its own policy state and its own in-flight counts (this simulation has
    no engine ``/metrics`` to share), over the one fleet of caches. ``spread`` is how
    the kernel deals the work: ``request`` (each request to any process, as when
    clients open a connection per request) or ``conversation`` (a conversation's
    turns on one process, as over one keep-alive connection).
    """
    policies: list[Policy] = [create_policy(spec, options) for _ in range(processes)]
    rngs = [random.Random(7 + p) for p in range(processes)]
    deal = random.Random(11)
    own: list[dict[str, int]] = [{c.key: 0 for c in fleet} for _ in range(processes)]
    proc_of: dict[int, int] = {}  # request -> the process that placed it
    index = {c.key: i for c, i in zip(fleet, range(len(fleet)), strict=True)}
    views: dict[int, RequestView] = {}
    timing = [0.0, 0]
    clock = time.perf_counter

    def process_of(r: Request) -> int:
        if processes == 1:
            return 0
        if spread == "conversation":
            return r.conv % processes
        return deal.randrange(processes)

    def view_of(r: Request, conv: Conversation) -> RequestView:
        assert CHAT is not None
        v = RequestView(
            match=CHAT,
            model="bench-model",
            routing_text=conv.transcript[: r.prompt_len],
            routing_key=f"conv-{r.conv}",  # the session header a chat frontend would send
            prompt_weight=r.prompt_len,
        )
        views[r.rid] = v
        return v

    def choose(
        r: Request,
        conv: Conversation,
        keys: list[bytes],
        load: Mapping[str, int],
        caches: Sequence[BlockCache],
    ) -> int:
        # A policy sees only the request and the load, never the simulated caches.
        p = proc_of[r.rid] = process_of(r)
        ctx = PlacementContext(
            candidates=fleet,
            view=view_of(r, conv),
            load=load if processes == 1 else own[p],
            weight={},
            rng=rngs[p],
            fleet=fleet,
            fleet_version=1,
            now=r.arrive,
        )
        if record is not None:
            record.append(
                PlacementContext(
                    ctx.candidates,
                    ctx.view,
                    dict(load),
                    ctx.weight,
                    ctx.rng,
                    ctx.fleet,
                    ctx.fleet_version,
                    ctx.now,
                )
            )
        t0 = clock()
        cand = policies[p].select(ctx)
        timing[0] += clock() - t0
        timing[1] += 1
        return index[cand.key]

    def placed(w: int, r: Request, conv: Conversation, now: float) -> None:
        p = proc_of[r.rid]
        own[p][fleet[w].key] += 1
        policies[p].on_placed(fleet[w], views[r.rid], now)

    def done(w: int, r: Request, conv: Conversation, now: float) -> None:
        v = views.pop(r.rid)
        p = proc_of.pop(r.rid)
        own[p][fleet[w].key] -= 1
        ok = Completion(status=200, ok=True, ttft=0.1, duration=r.finish - r.arrive)
        policies[p].on_complete(fleet[w], v, ok, now)

    res = replay(label, convs, reqs, fleet, cache_blocks, choose, placed, done)
    res.select_s, res.decisions = timing[0], int(timing[1])
    return res


def run_oracle(
    convs: Sequence[Conversation],
    reqs: Sequence[Request],
    fleet: Sequence[Candidate],
    cache_blocks: int | None,
    name: str,
    load_factor: float | None = None,
) -> Result:
    """Longest real cached prefix, fewest in flight on ties.

    With ``load_factor``, only among the workers whose load after this request
    stays within ``ceil(load_factor * (total + 1) / n)`` (``prefix_hash``'s bound).
    """
    n = len(fleet)

    def choose(
        r: Request,
        conv: Conversation,
        keys: list[bytes],
        load: Mapping[str, int],
        caches: Sequence[BlockCache],
    ) -> int:
        allowed: Sequence[int] = range(n)
        if load_factor is not None:
            bound = math.ceil(load_factor * (sum(load.values()) + 1) / n)
            allowed = [i for i in range(n) if load[fleet[i].key] + 1 <= bound]
        return max(allowed, key=lambda i: (caches[i].hit(keys), -load[fleet[i].key], -i))

    return replay(name, convs, reqs, fleet, cache_blocks, choose)


# -- report ------------------------------------------------------------------------------


POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("round_robin", "round_robin", {}),
    ("power_of_two", "power_of_two", {}),
    ("least_load", "least_load", {}),
    ("prefix_hash", "prefix_hash", {}),
    ("cache_aware", "cache_aware", {}),
    ("session", "session", {}),
    # Variants that show the trade-offs behind the defaults (see the report).
    ("prefix_hash (load_factor=1.5)", "prefix_hash", {"load_factor": 1.5}),
    # prefix_hash without each part of its conversation handling:
    ("prefix_hash (spill_memory=0)", "prefix_hash", {"spill_memory": 0}),
    # Without the traffic-share plan: the ring and the in-flight bound (before 2 Dec).
    ("prefix_hash (share plan off)", "prefix_hash", {"owner_share": 0}),
    # The spill gate sized for SGLang's defaults never trips at these loads:
    (
        "cache_aware (abs=32, rel=1.5)",
        "cache_aware",
        {"balance_abs_threshold": 32, "balance_rel_threshold": 1.5},
    ),
    ("cache_aware (max_tree_size=2M)", "cache_aware", {"max_tree_size": 2_000_000}),
    # Without the recent-work bound: in-flight gates only (the 0.1 behaviour).
    ("cache_aware (load_factor off)", "cache_aware", {"load_factor": None}),
]


#: policies timed by ``--micro``
MICRO: list[tuple[str, str, dict[str, Any]]] = [
    ("round_robin", "round_robin", {}),
    ("session", "session", {}),
    ("prefix_hash", "prefix_hash", {}),
    ("prefix_hash (load_factor=1.5)", "prefix_hash", {"load_factor": 1.5}),
]


def micro(
    convs: Sequence[Conversation],
    reqs: Sequence[Request],
    fleet: Sequence[Candidate],
    cache_blocks: int,
    repeat: int,
) -> None:
    """Time ``select`` alone, on the contexts (request, loads) of a prefix_hash replay.

    Each policy is fresh and sees the contexts in order; the best of ``repeat``
    passes is printed. Run it against two versions of meshkit (``PYTHONPATH``) to
    compare them: only ratios within one machine state mean anything.
    """
    ctxs: list[PlacementContext] = []
    run_policy("record", "prefix_hash", {}, convs, reqs, fleet, cache_blocks, ctxs)
    print(f"{len(ctxs)} placement contexts from a prefix_hash replay\n")
    print(f"| policy | select (µs), best of {repeat} | spread (µs) |")
    print("|---|---:|---:|")
    clock = time.perf_counter
    for label, spec, opts in MICRO:
        try:
            create_policy(spec, opts)
        except Exception as exc:  # an older meshkit without this option
            print(f"| {label} | — ({type(exc).__name__}) | |")
            continue
        times = []
        for _ in range(repeat):
            policy = create_policy(spec, opts)
            select = policy.select
            t0 = clock()
            for ctx in ctxs:
                select(ctx)
            times.append((clock() - t0) / len(ctxs) * 1e6)
        print(f"| {label} | {min(times):.2f} | {min(times):.2f}-{max(times):.2f} |")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--routers" or a.startswith("--routers=") for a in argv):
        # Routers are processes with their own state: the simulation cannot stand in.
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import multi_router

        return multi_router.main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--conversations", type=int, default=6000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--rate", type=float, default=6.0, help="new conversations per second")
    ap.add_argument("--think", type=float, default=20.0, help="mean think time (s)")
    ap.add_argument("--cache-tokens", type=int, default=128_000, help="per worker")
    ap.add_argument("--max-turns", type=int, default=12, help="turns per conversation, at most")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--png", help="write a plot here (needs matplotlib)")
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="routers of one `meshkit serve --processes N`, each with its own state",
    )
    ap.add_argument(
        "--spread",
        choices=("request", "conversation"),
        default="request",
        help="how requests reach the processes (with --processes)",
    )
    ap.add_argument(
        "--micro", type=int, metavar="N", help="only time select, best of N passes (see micro)"
    )
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    convs, reqs = build_workload(args)
    check_routing_text(convs, reqs)
    fleet = [Candidate(Worker(f"http://10.0.0.{i + 1}:8000")) for i in range(args.workers)]
    cache_blocks = args.cache_tokens * CHARS_PER_TOKEN // BLOCK
    if args.micro:
        micro(convs, reqs, fleet, cache_blocks, args.micro)
        return 0

    oracle = run_oracle(convs, reqs, fleet, cache_blocks, "oracle (longest real prefix)")
    bounded = run_oracle(
        convs, reqs, fleet, cache_blocks, "oracle within the bound (load_factor 1.25)", 1.25
    )
    bound = run_oracle(convs, reqs, fleet[:1], None, "bound (one infinite cache)")
    results = [
        run_policy(
            label, spec, opts, convs, reqs, fleet, cache_blocks, None, args.processes, args.spread
        )
        for label, spec, opts in POLICIES
    ]

    mean_inflight = sum(oracle.inflight_area) / max(r.finish for r in reqs) / args.workers
    print(
        f"{args.workers} workers x {args.cache_tokens} cached tokens, {args.tenants} tenants "
        f"(Zipf {args.zipf}), {len(convs)} conversations, {len(reqs)} requests, "
        f"mean in flight per worker {mean_inflight:.1f}"
        + (
            f", {args.processes} router processes (spread by {args.spread})"
            if args.processes > 1
            else ""
        )
        + "\n"
    )
    print(
        "| policy | hit rate (tokens) | vs oracle | requests max/mean "
        "| in-flight max/mean | peak in flight | select (µs) | time (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for res in [*results, oracle, bounded, bound]:
        ratio = res.hit_rate / oracle.hit_rate if oracle.hit_rate else math.nan
        balance = (
            ("—", "—", "—")
            if res is bound
            else (
                f"{res.req_imbalance:.2f}",
                f"{res.inflight_imbalance:.2f}",
                str(max(res.peak_inflight)),
            )
        )
        select = f"{res.select_s / res.decisions * 1e6:.1f}" if res.decisions else "—"
        print(
            f"| {res.name} | {res.hit_rate:.1%} | {ratio:.1%} | {balance[0]} | {balance[1]} "
            f"| {balance[2]} | {select} | {res.seconds:.1f} |"
        )
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    for target in ("prefix_hash", "cache_aware"):
        res = next(r for r in results if r.name == target)
        ok = res.hit_rate >= 0.95 * oracle.hit_rate and res.req_imbalance <= 1.25
        print(
            f"target {target}: >= 95% of oracle at max/mean <= 1.25: {'met' if ok else 'NOT met'}"
        )
    if args.png:
        plot(args.png, [*results, oracle, bounded], bound)
    return 0


def plot(path: str, results: Sequence[Result], bound: Result) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(11, 5.5))
    ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
    markers = "osD^v<>ph*XP8d"
    for i, res in enumerate(results):
        # A legend rather than annotations: several policies land on the same spot.
        ax.scatter(
            res.req_imbalance, res.hit_rate * 100, marker=markers[i % len(markers)], label=res.name
        )
    ax.axhline(bound.hit_rate * 100, linestyle=":", color="grey", label="infinite-cache bound")
    ax.axvline(1.25, linestyle="--", color="grey", label="max/mean 1.25")
    ax.set_xlabel("requests per worker, max / mean")
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    raise SystemExit(main())
