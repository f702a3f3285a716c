"""
The demo's report
=================

ASCII, aligned, short: one row per request (where it went, status, TTFT,
cached tokens), the conversation's cache-hit rate, what each router matched on
(the engines' KV events, or its own tree) with its request count, then per-worker
load from two sources that must agree: the workers' own counters and the routers'
in-flight load (zero once every lease is released).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from meshkit.mesh import Mesh
from meshkit.mock import MockWorkerThread

if TYPE_CHECKING:
    from meshkit.demo.run import Row

__all__ = ["report"]

_ROW = "{:>2}  {:<9}  {:<9}  {:<6}  {:<6}  {:>6}  {:>7}  {:>13}"


def _fmt(n: int, row: Row) -> str:
    r = row.result
    ttft = "-" if r.ttft_ms is None else f"{r.ttft_ms:.1f}"
    cached = "-" if r.cached_tokens is None else str(r.cached_tokens)
    stream = "yes" if row.stream else "no"
    return _ROW.format(n, row.via, row.api, stream, r.worker, r.status, ttft, cached)


def _requests(mesh: Mesh) -> int:
    """The router's ``mesh_router_requests_total``, as its ``/metrics`` says it."""
    return sum(
        int(s.value)
        for family in mesh.metrics.registry.collect()
        for s in family.samples
        if s.name == "mesh_router_requests_total"
    )


def _router_lines(routers: Mapping[str, Mesh]) -> list[str]:
    lines = ["router     matched_on   kv_blocks  requests"]
    for via, mesh in routers.items():
        rows = mesh.router.describe()
        on_events = sum(1 for r in rows if r.get("prefix_match") == "events")
        kind = f"events {on_events}/{len(rows)}" if on_events else "own tree"
        blocks = sum(int(r.get("kv_blocks") or 0) for r in rows)
        lines.append(f"{via:<9}  {kind:<11}  {blocks:>9}  {_requests(mesh):>8}")
    return lines


def _conversation_summary(talk: Sequence[Row]) -> list[str]:
    if not talk:
        return []
    workers = sorted({r.result.worker for r in talk})
    later = talk[1:]
    hits = sum(1 for r in later if (r.result.cached_tokens or 0) > 0)
    cached = sum(r.result.cached_tokens or 0 for r in talk)
    prompt = sum(r.result.prompt_tokens or 0 for r in talk)
    rate = 100.0 * cached / prompt if prompt else 0.0
    lines = [
        f"conversation: {len(talk)} turns on {', '.join(workers)}; cache hits on {hits} of "
        f"{len(later)} later turns; {cached} of {prompt} prompt tokens cached ({rate:.0f}%)"
    ]
    first = talk[0].result.ttft_ms
    warm = [r.result.ttft_ms for r in later if r.result.ttft_ms is not None]
    if first is not None and warm:
        lines.append(
            f"ttft: first turn {first:.0f} ms (cold prefix), later turns "
            f"{sum(warm) / len(warm):.0f} ms on average (cached prefix)"
        )
    return lines


def report(
    out: TextIO,
    tour: Sequence[Row],
    talk: Sequence[Row],
    follow: Sequence[Row],
    routers: Mapping[str, Mesh],
    mocks: Sequence[MockWorkerThread],
) -> bool:
    """Print the report; True when every request answered 200."""
    lines = [
        "  gateway   = SDK -> meshkit gateway (MeshMiddleware + uvicorn) -> worker",
        "  transport = SDK(http_client=httpx2.Client(transport=MeshTransport(mesh))) -> worker",
    ]
    if "envoy" in routers:
        lines.append("  envoy     = SDK -> Envoy -> worker; Envoy asks meshkit extproc where")
    lines += [
        "  each way in is a router of its own (its own Mesh, nothing shared)",
        "",
        _ROW.format("#", "via", "api", "stream", "worker", "status", "ttft_ms", "cached_tokens"),
    ]
    lines += [_fmt(n, row) for n, row in enumerate(tour, 1)]
    lines.append("-- one conversation: shared system prompt, growing history, routers by turns --")
    lines += [_fmt(n, row) for n, row in enumerate(talk, len(tour) + 1)]
    lines.append("-- Responses by turns: previous_response_id made by another router --")
    lines += [_fmt(n, row) for n, row in enumerate(follow, len(tour) + len(talk) + 1)]
    lines.append("")
    lines += _conversation_summary(talk)
    if follow:
        where = sorted({r.result.worker for r in follow})
        lines.append(f"responses: {len(follow)} turns on {', '.join(where)}")
    lines += ["", *_router_lines(routers)]
    lines += ["", "worker  url                      requests  prompt_tok  cached_tok  in_flight"]
    for mock in mocks:
        s = mock.worker.stats
        api_calls = sum(n for path, n in s.requests_total.items() if path.startswith("/v1/"))
        url = mock.url
        in_flight = sum(m.load_of(w) for m in routers.values() for w in m.workers if w.url == url)
        lines.append(
            f"{mock.worker.config.name:<6}  {url:<23}  {api_calls:>8}  "
            f"{s.prompt_tokens_total:>10}  {s.cached_tokens_total:>10}  {in_flight:>9}"
        )
    print("\n".join(lines), file=out)
    return all(r.result.status == 200 for r in (*tour, *talk, *follow))
