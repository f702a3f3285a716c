"""
Metrics
=======

Every Prometheus series meshkit exports, one registry per :class:`~meshkit.Mesh`
(so several meshes in one process, as in tests, never collide). Labels carry API
names, status codes, reasons and worker URLs only: never a credential, a prompt or
a completion. ``docs/metrics.md`` lists them all.

* :class:`RequestSeries` — what every relayed request updates, summed as plain
  numbers and rendered at scrape time;
* :class:`RouterMetrics` — the registry, the request series, refusals, retries,
  stream errors, prefill/decode counters;
* :class:`LifecycleCollector` — worker states, breakers, leases, wakes and sleeps,
  read from the :class:`~meshkit.router.Router` at scrape time (the request path
  updates nothing for them);
* :class:`PrepareMetrics` — the prepare pool's ``mesh_prepare_*`` series.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from meshkit.core.lifecycle import Breaker, State

if TYPE_CHECKING:
    from meshkit.router import Router

__all__ = [
    "ERROR_REASONS",
    "KvCollector",
    "LifecycleCollector",
    "PrepareMetrics",
    "RequestSeries",
    "RouterMetrics",
]

# A Sequence, not a tuple type: a compiled build keeps a tuple[float, ...] global
# unboxed and would box its 13 floats again at every bisect (twice per request).
_LATENCY: Final[Sequence[float]] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_PD_LATENCY: Final = tuple(_LATENCY[:-1])
#: a C static per request, not the ``bisect`` module then its attribute
_slot_of: Final = bisect.bisect_left
# A batch is applied within a millisecond on an idle router; tens of milliseconds
# are as long as a short request, seconds a subscriber that fell behind.
_KV_AGE: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _Hist:
    __slots__ = ("buckets", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(_LATENCY) + 1)  # the last one is +Inf
        self.sum = 0.0


class RequestSeries:
    """The series every relayed request updates, as plain numbers under one lock.

    Per request, ``prometheus_client`` would take a lock and validate labels for
    each of ~8 updates (``labels()`` then ``inc``/``observe``/``set``): ~10 % of
    a proxied request's CPU in the built-in server's profile. These series are
    summed here instead and rendered when scraped (a registered collector), with
    the names, types and labels they always had. ``mesh_worker_requests_active``
    is read from the fleet's load at scrape time, so it is never stale and keeps
    no series for removed workers.
    """

    def __init__(self, load: Callable[[], Mapping[str, int]] | None = None) -> None:
        self._lock = threading.Lock()
        # Taken per request through bound methods, not a ``with`` block (as
        # Router's; benchmarks/RESULTS.md, "Builtin methods without a lookup").
        self._acquire = self._lock.acquire
        self._unlock = self._lock.release
        self._requests: dict[tuple[str, str], int] = {}
        self._duration: dict[str, _Hist] = {}
        self._ttft: dict[str, _Hist] = {}
        # input, output, cached: plain int attributes (a dict costs a lookup and a
        # store per kind per request)
        self._input = self._output = self._cached = 0
        self.load = load

    def finished(
        self,
        api: str,
        status: str,
        duration: float,
        ttft: float | None,
        tokens: tuple[int, int, int] | None,
    ) -> None:
        """One response ended (or was cut): count it, time it, add its usage."""
        key = (api, status)
        slot = _slot_of(_LATENCY, duration)
        self._acquire()
        try:
            self._requests[key] = self._requests.get(key, 0) + 1
            h = self._duration.get(api)
            if h is None:
                h = self._duration[api] = _Hist()
            h.buckets[slot] += 1
            h.sum += duration
            if ttft is not None:
                t = self._ttft.get(api)
                if t is None:
                    t = self._ttft[api] = _Hist()
                t.buckets[_slot_of(_LATENCY, ttft)] += 1
                t.sum += ttft
            if tokens is not None:
                self._input += tokens[0]
                self._output += tokens[1]
                self._cached += tokens[2]
        finally:
            self._unlock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            requests = dict(self._requests)
            hists = {
                name: {api: (list(h.buckets), h.sum) for api, h in table.items()}
                for name, table in (("duration", self._duration), ("ttft", self._ttft))
            }
            tokens = {"input": self._input, "output": self._output, "cached": self._cached}
        c = CounterMetricFamily(
            "mesh_router_requests", "Requests answered, by API and status", labels=["api", "status"]
        )
        for (api, status), n in sorted(requests.items()):
            c.add_metric([api, status], n)
        yield c
        yield _histogram("mesh_router_ttft_seconds", "Time to first output token", hists["ttft"])
        yield _histogram(
            "mesh_router_request_duration_seconds",
            "Request duration until the body ended",
            hists["duration"],
        )
        t = CounterMetricFamily("mesh_router_tokens", "Tokens reported by workers", labels=["kind"])
        for kind, n in tokens.items():
            t.add_metric([kind], n)
        yield t
        g = GaugeMetricFamily(
            "mesh_worker_requests_active", "In-flight requests per worker", labels=["worker"]
        )
        for worker, n in sorted((self.load() if self.load else {}).items()):
            g.add_metric([worker], n)
        yield g


def _histogram(name: str, doc: str, table: dict[str, tuple[list[int], float]]) -> Metric:
    h = HistogramMetricFamily(name, doc, labels=["api"])
    for api, (counts, total) in sorted(table.items()):
        running = 0
        buckets = []
        for bound, n in zip((*_LATENCY, None), counts, strict=True):
            running += n
            buckets.append(("+Inf" if bound is None else repr(bound), running))
        h.add_metric([api], buckets, sum_value=total)
    return h


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        #: requests, durations, TTFT, tokens and in-flight load (see RequestSeries)
        self.series = RequestSeries()
        r.register(self.series)
        self.retries = Counter(
            "mesh_router_retries", "Attempts moved to another worker", ["reason"], registry=r
        )
        self.disconnects = Counter(
            "mesh_router_client_disconnects",
            "Clients that left before the response ended",
            registry=r,
        )
        self.rejections = Counter(
            "mesh_router_rejections",
            "Requests refused by meshkit, by code",
            ["code"],
            registry=r,
        )
        self.stream_errors = Counter(
            "mesh_router_stream_errors",
            "Error events seen in worker responses",
            ["api"],
            registry=r,
        )
        self.pd_requests = Counter("mesh_pd_requests", "Disaggregated requests", registry=r)
        self.pd_bootstrap_failures = Counter(
            "mesh_pd_bootstrap_failures", "Prefill legs that failed the KV handover", registry=r
        )
        self.pd_ttft = Histogram(
            "mesh_pd_ttft_seconds",
            "TTFT of disaggregated requests",
            buckets=_PD_LATENCY,
            registry=r,
        )
        self.streams_without_usage = Counter(
            "mesh_router_streams_without_usage",
            "Completed streams that reported no token usage (their tokens are not counted)",
            ["api"],
            registry=r,
        )
        self.stream_overflows = Counter(
            "mesh_router_stream_overflows",
            "Worker answers with an SSE event, or a whole body, over "
            "bounds.max_sse_line_bytes (relayed, no longer parsed for usage and TTFT)",
            ["api"],
            registry=r,
        )

        self.reloads = Counter(
            "mesh_router_reloads",
            "Configuration reloads (SIGHUP), by outcome: ok, or error (the running one stayed)",
            ["outcome"],
            registry=r,
        )
        self.discovery_failures = Counter(
            "mesh_router_discovery_failures",
            "dns:// lookups and workers-file reads that failed (the last good answer stayed)",
            ["source"],
            registry=r,
        )

        self.kv_batches = Counter(
            "mesh_kv_batches",
            "KV-event batches applied to the index, per worker",
            ["worker"],
            registry=r,
        )
        self.kv_age = Histogram(
            "mesh_kv_event_age_seconds",
            "How old a KV-event batch was when it reached the index (this host's "
            "clock minus the engine's ts): how far placement trails the engine's cache",
            ["worker"],
            buckets=_KV_AGE,
            registry=r,
        )
        self.kv_gaps = Counter(
            "mesh_kv_gaps",
            "KV-event sequence breaks, per worker, by outcome: replayed, cleared "
            "(its entries were dropped and rebuilt), restart (the publisher began again)",
            ["worker", "outcome"],
            registry=r,
        )
        self.kv_relay_moves = Counter(
            "mesh_kv_relay_moves",
            "Times a worker's KV events moved to the next kv.relay (the one in use went "
            "away or lost the engine), by outcome: replayed (the next relay had what came "
            "after), followed (no replay endpoint; a batch missed is a gap), cleared "
            "(the worker's entries were dropped and rebuilt)",
            ["worker", "outcome"],
            registry=r,
        )
        self.kv_unmatched = Counter(
            "mesh_kv_unmatched",
            "Requests KV events could have placed that were matched on the approximate "
            "tree instead, by reason: no_tokenizer (none for the request's model), "
            "too_large (a body over prepare.max_tokenize_bytes), unrendered (a prompt "
            "meshkit could not render as the engine does)",
            ["reason"],
            registry=r,
        )
        self.kv_errors = Counter(
            "mesh_kv_errors",
            "KV-event messages that did not decode (the worker's entries were dropped)",
            ["worker"],
            registry=r,
        )
        self.kv_silent = Gauge(
            "mesh_kv_silent",
            "1 while a worker's KV-event publisher is silent (requests placed there, no "
            "batch for kv.silence_s): it is matched on the approximate tree",
            ["worker"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class KvCollector(Collector):
    """The KV index per scrape: ``mesh_kv_blocks{worker}``, ``mesh_kv_index_entries
    {model}``, ``mesh_kv_index_evicted_total``, ``mesh_kv_unchained_total`` and
    ``mesh_worker_prefix_match{worker,kind}`` (events, the approximate tree, or
    the ring)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        rows, groups, evicted, unchained = self.router.kv_rows()
        blocks = GaugeMetricFamily(
            "mesh_kv_blocks", "Blocks the KV index holds for a worker", labels=["worker"]
        )
        kind = GaugeMetricFamily(
            "mesh_worker_prefix_match",
            "How cache_aware matches a worker's prefixes (1 = current): events "
            "(its KV events), approximate (this router's own tree) or ring (other "
            "routers place this one's conversations' turns: prefix_hash's placement)",
            labels=["worker", "kind"],
        )
        for url, n, how in rows:
            blocks.add_metric([url], float(n))
            for k in ("events", "approximate", "ring"):
                kind.add_metric([url, k], 1.0 if how == k else 0.0)
        entries = GaugeMetricFamily(
            "mesh_kv_index_entries",
            "KV index entries per model group (bounded by kv.max_blocks_per_model)",
            labels=["model"],
        )
        for group, n in sorted(groups.items()):
            entries.add_metric([group], float(n))
        yield blocks
        yield kind
        yield entries
        yield CounterMetricFamily(
            "mesh_kv_index_evicted",
            "Index entries replaced, or stored blocks left out, to stay within the budget",
            evicted,
        )
        yield CounterMetricFamily(
            "mesh_kv_unchained", "Stored blocks skipped: their parent was not known", unchained
        )


# -- lifecycle ------------------------------------------------------------------

_CB: Final = {Breaker.CLOSED: 0.0, Breaker.OPEN: 1.0, Breaker.HALF_OPEN: 2.0}


class LifecycleCollector(Collector):
    """The lifecycle series (``mesh_worker_state``, ``mesh_worker_health``,
    ``mesh_worker_cb_state``, ``mesh_leases_active``, ``mesh_wakes_total``,
    ``mesh_sleeps_total``, ``mesh_idempotent_requests_total``), read from the
    router per scrape."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def describe(self) -> Iterator[Metric]:
        # Nothing up front: registering must not read a half-built lifecycle.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "mesh_worker_state", "Worker lifecycle state (1 = current)", labels=["worker", "state"]
        )
        health = GaugeMetricFamily(
            "mesh_worker_health", "1 when health probes say healthy", labels=["worker"]
        )
        cb = GaugeMetricFamily(
            "mesh_worker_cb_state",
            "Circuit breaker: 0 closed, 1 open, 2 half-open",
            labels=["worker"],
        )
        rows, n = self.router.lifecycle_rows()
        for url, st, br, healthy in rows:
            for s in State:
                state.add_metric([url, s.value], 1.0 if s is st else 0.0)
            health.add_metric([url], 1.0 if healthy else 0.0)
            cb.add_metric([url], _CB[br])
        yield state
        yield health
        yield cb
        yield GaugeMetricFamily("mesh_leases_active", "Live request leases", value=n["leases"])
        yield CounterMetricFamily("mesh_wakes", "Worker wakes started", value=n["wakes"])
        yield CounterMetricFamily("mesh_sleeps", "Worker sleeps started", value=n["sleeps"])
        idem = CounterMetricFamily(
            "mesh_idempotent_requests",
            "Leases by idempotency outcome (joins and replays are counted once)",
            labels=["outcome"],
        )
        idem.add_metric(["started"], n["started"])
        idem.add_metric(["joined"], n["joined"])
        idem.add_metric(["replayed"], n["replayed"])
        yield idem


# -- the prepare pool ------------------------------------------------------------

#: The reasons exported at 0 before anything happened (dashboards see the series).
ERROR_REASONS: Final = ("queue_full", "timeout", "cancelled", "failed", "unavailable", "too_large")

# Preparation spans ~50 µs (a small JSON parse) to seconds (a MiB prompt tokenized).
_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class PrepareMetrics:
    """The preparation pool's collectors, registered in one registry."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._clock = clock
        r = self.registry
        self.queued_jobs = Gauge(
            "mesh_prepare_queued_jobs", "Preparation jobs waiting for a worker.", registry=r
        )
        self.dispatched_jobs = Gauge(
            "mesh_prepare_dispatched_jobs",
            "Preparation jobs inside the pool (queued or executing).",
            registry=r,
        )
        self.busy_workers = Gauge(
            "mesh_prepare_busy_workers", "Preparation threads executing a job.", registry=r
        )
        self.live_workers = Gauge(
            "mesh_prepare_live_workers", "Preparation threads alive.", registry=r
        )
        self.queue_seconds = Histogram(
            "mesh_prepare_queue_seconds",
            "Time a preparation job waited for a worker.",
            buckets=_BUCKETS,
            registry=r,
        )
        self.run_seconds = Histogram(
            "mesh_prepare_run_seconds",
            "Time a worker spent executing a preparation job.",
            buckets=_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "mesh_prepare_stage_seconds",
            "Time spent in one preparation stage.",
            ["stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.errors_total = Counter(
            "mesh_prepare_errors_total",
            "Preparation refusals and failures by reason.",
            ["reason"],
            registry=r,
        )
        for reason in ERROR_REASONS:
            self.errors_total.labels(reason=reason)

    def error(self, reason: str) -> None:
        """Count one refusal or failure."""
        self.errors_total.labels(reason=reason).inc()

    def error_count(self, reason: str) -> float:
        """The current value of ``mesh_prepare_errors_total{reason}`` (tests, health)."""
        value = self.registry.get_sample_value("mesh_prepare_errors_total", {"reason": reason})
        return 0.0 if value is None else value

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block into ``mesh_prepare_stage_seconds{stage=name}``.

        The time is recorded whether the block succeeds or raises: a template that
        fails after a second of work still cost that second.
        """
        start = self._clock()
        try:
            yield
        finally:
            self.stage_seconds.labels(stage=name).observe(max(0.0, self._clock() - start))
