"""
Metrics
=======

Prometheus collectors, one registry per :class:`~meshkit.Mesh` (so several meshes
in one process, as in tests, never collide). Labels carry API names, status codes
and worker URLs only: never a credential, a prompt or a completion.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

__all__ = ["RequestSeries", "RouterMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
        self._requests: dict[tuple[str, str], int] = {}
        self._duration: dict[str, _Hist] = {}
        self._ttft: dict[str, _Hist] = {}
        self._tokens = {"input": 0, "output": 0, "cached": 0}
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
        slot = bisect.bisect_left(_LATENCY, duration)
        with self._lock:
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
                t.buckets[bisect.bisect_left(_LATENCY, ttft)] += 1
                t.sum += ttft
            if tokens is not None:
                totals = self._tokens
                totals["input"] += tokens[0]
                totals["output"] += tokens[1]
                totals["cached"] += tokens[2]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            requests = dict(self._requests)
            hists = {
                name: {api: (list(h.buckets), h.sum) for api, h in table.items()}
                for name, table in (("duration", self._duration), ("ttft", self._ttft))
            }
            tokens = dict(self._tokens)
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
        self.stream_overflows = Counter(
            "mesh_router_stream_overflows",
            "Worker streams with an SSE event over bounds.max_sse_line_bytes "
            "(relayed, no longer parsed for usage and TTFT)",
            ["api"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
