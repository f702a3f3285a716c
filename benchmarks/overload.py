"""
Overload at ten times the configured capacity (the full size of
``tests/reliability/test_overload.py``)
=====================================================================

Two scenarios, in each embedding mode (``tests/harness.py``):

``prepare``
    ``[prepare] workers = 2, queue_capacity = 16`` (capacity 18) and a slow
    preparation (``--prepare-ms`` of sleep per job, like a slow tokenizer), with
    ``10 x 18`` requests at once. Expected: the excess gets 503
    ``prepare_queue_full`` with ``Retry-After`` at once (its latency is far below
    the admitted requests'), the admitted complete, and a request afterwards
    succeeds.

``upstream``
    Two slow streaming workers and ``upstream.pool_limit_per_worker = 4``
    (capacity 8 streams; the admission limits default to the pool's), with
    ``10 x 8`` streams at once. Expected: the excess is refused at once with 503
    ``overloaded`` (before any byte goes upstream), no breaker opens, and a
    request after the burst succeeds. (Before admission control, the excess got
    502 ``upstream_error`` after waiting ``connect_timeout_s`` for a pooled
    connection, and the breakers opened.)

Every point reports the status counts, latency percentiles per outcome and the
process's RSS before/after (``VmRSS``) and peak (``VmHWM``). Wall times are
reported, never asserted.

::

    python benchmarks/overload.py                      # all modes, both scenarios
    python benchmarks/overload.py --modes asgi --scenarios prepare --out /tmp/o.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from harness import MODE_CLASSES, MODES, wait_until  # noqa: E402
from meshkit import Mesh, Worker  # noqa: E402
from meshkit.mock import MockConfig, MockWorkerThread  # noqa: E402
from meshkit.prepare.pool import current_worker_index  # noqa: E402

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def _summary(latencies: dict[str, list[float]]) -> dict[str, Any]:
    return {
        k: {
            "n": len(v),
            "p50_ms": round(_pct(v, 0.5) * 1000, 1),
            "p99_ms": round(_pct(v, 0.99) * 1000, 1),
            "max_ms": round(max(v) * 1000, 1),
            "mean_ms": round(statistics.fmean(v) * 1000, 1),
        }
        for k, v in sorted(latencies.items())
        if v
    }


def prepare_point(mode_name: str, scale: int, prepare_ms: float) -> dict[str, Any]:
    mock = MockWorkerThread(MockConfig(name="o"))
    mock.start()
    mesh = Mesh(
        workers=[Worker(mock.url)],
        prepare={"workers": 2, "queue_capacity": 16, "inline_threshold_bytes": 0},
        lifecycle={"probe": False},
    )
    inner = mesh.preparer._whole

    def slow(match: Any, body: bytes) -> Any:
        if current_worker_index() is not None:
            time.sleep(prepare_ms / 1000)
        return inner(match, body)

    mesh.preparer._whole = slow  # type: ignore[method-assign]
    mode = MODE_CLASSES[mode_name](mesh)
    try:
        mode.request("GET", "/v1/models")
        capacity = 2 + 16
        offered = scale * capacity
        rss0 = _status_kb("VmRSS")
        barrier = threading.Barrier(offered)

        def one(_: int) -> tuple[str, float, bool]:
            barrier.wait()
            t = time.monotonic()
            r = mode.request("POST", "/v1/chat/completions", json=CHAT)
            hint = "retry-after" in r.headers and "retry-after-ms" in r.headers
            return str(r.status), time.monotonic() - t, hint

        t0 = time.monotonic()
        with ThreadPoolExecutor(offered) as pool:
            results = list(pool.map(one, range(offered)))
        elapsed = time.monotonic() - t0
        rss1 = _status_kb("VmRSS")
        after = mode.request("POST", "/v1/chat/completions", json=CHAT).status
        settled = wait_until(lambda: mesh.total_load() == 0 and mesh.pool.queued == 0, 30)
        lat: dict[str, list[float]] = {}
        for status, seconds, _hint in results:
            lat.setdefault(status, []).append(seconds)
        return {
            "scenario": "prepare",
            "mode": mode_name,
            "capacity": capacity,
            "offered": offered,
            "statuses": dict(Counter(s for s, _, _ in results)),
            "all_503_have_retry_hints": all(h for s, _, h in results if s == "503"),
            "latency": _summary(lat),
            "elapsed_s": round(elapsed, 2),
            "rss_before_mib": round(rss0 / 1024, 1),
            "rss_after_mib": round(rss1 / 1024, 1),
            "rss_growth_mib": round((rss1 - rss0) / 1024, 1),
            "recovered_status": after,
            "settled": settled,
            "pool_outcomes": dict(mesh.pool.outcomes),
        }
    finally:
        mode.close()
        mesh.close()
        mock.stop()


def upstream_point(mode_name: str, scale: int, stream_s: float) -> dict[str, Any]:
    tokens = 50
    mocks = [
        MockWorkerThread(
            MockConfig(name=f"s{i}", per_token_ms=stream_s * 1000 / tokens, output_tokens=tokens)
        )
        for i in range(2)
    ]
    for m in mocks:
        m.start()
    mesh = Mesh(
        workers=[Worker(m.url) for m in mocks],
        upstream={"pool_limit_per_worker": 4, "pool_limit": 8, "connect_timeout_s": 1.0},
        lifecycle={"probe": False},
    )
    mode = MODE_CLASSES[mode_name](mesh)
    try:
        capacity = 8
        offered = scale * capacity
        body = {**CHAT, "stream": True}
        rss0 = _status_kb("VmRSS")
        barrier = threading.Barrier(offered)

        def one(_: int) -> tuple[str, float]:
            barrier.wait()
            t = time.monotonic()
            try:
                with mode.stream("POST", "/v1/chat/completions", json=body) as chunks:
                    raw = b"".join(chunks)
            except Exception as exc:  # reported, not raised
                return f"client-{type(exc).__name__}", time.monotonic() - t
            seconds = time.monotonic() - t
            if raw.rstrip().endswith(b"data: [DONE]"):
                return "200-complete", seconds
            try:
                err = json.loads(raw)["error"]
                return f"error-{err.get('code')}", seconds
            except (ValueError, KeyError, TypeError):
                return "other", seconds

        t0 = time.monotonic()
        with ThreadPoolExecutor(offered) as pool:
            results = list(pool.map(one, range(offered)))
        elapsed = time.monotonic() - t0
        rss1 = _status_kb("VmRSS")
        settled = wait_until(lambda: mesh.total_load() == 0, 30)
        after = mode.request("POST", "/v1/chat/completions", json=CHAT).status
        rejected = mesh.metrics.registry.get_sample_value(
            "mesh_router_rejections_total", {"code": "overloaded"}
        )
        lat: dict[str, list[float]] = {}
        for outcome, seconds in results:
            lat.setdefault(outcome, []).append(seconds)
        return {
            "scenario": "upstream",
            "mode": mode_name,
            "capacity": capacity,
            "offered": offered,
            "stream_s": stream_s,
            "outcomes": dict(Counter(o for o, _ in results)),
            "latency": _summary(lat),
            "elapsed_s": round(elapsed, 2),
            "rss_growth_mib": round((rss1 - rss0) / 1024, 1),
            "recovered_status": after,
            "settled": settled,
            "rejections_overloaded": int(rejected or 0),
            "breaker_trips": sum(mesh.router.states.trips.values()),
            "upstream_requests": sum(
                m.worker.stats.requests_total.get("/v1/chat/completions", 0) for m in mocks
            ),
        }
    finally:
        mode.close()
        mesh.close()
        for m in mocks:
            m.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--scenarios", default="prepare,upstream")
    ap.add_argument("--scale", type=int, default=10, help="offered load / capacity (default 10)")
    ap.add_argument("--prepare-ms", type=float, default=20.0)
    ap.add_argument("--stream-s", type=float, default=3.0)
    ap.add_argument("--out", type=Path)
    ns = ap.parse_args(argv)
    points = []
    peak0 = _status_kb("VmHWM")
    for scenario in ns.scenarios.split(","):
        for mode_name in ns.modes.split(","):
            if scenario == "prepare":
                point = prepare_point(mode_name, ns.scale, ns.prepare_ms)
            else:
                point = upstream_point(mode_name, ns.scale, ns.stream_s)
            points.append(point)
            print(json.dumps(point), flush=True)
    report = {
        "points": points,
        "peak_rss_mib": round(_status_kb("VmHWM") / 1024, 1),
        "peak_rss_at_start_mib": round(peak0 / 1024, 1),
    }
    if ns.out:
        ns.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
