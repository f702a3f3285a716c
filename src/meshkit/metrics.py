"""
Metrics
=======

Prometheus collectors, one registry per :class:`~meshkit.Mesh` (so several meshes
in one process, as in tests, never collide). Labels carry API names, status codes
and worker URLs only: never a credential, a prompt or a completion.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["RouterMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "mesh_router_requests",
            "Requests answered, by API and status",
            ["api", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "mesh_router_ttft_seconds",
            "Time to first output token",
            ["api"],
            buckets=_LATENCY,
            registry=r,
        )
        self.duration = Histogram(
            "mesh_router_request_duration_seconds",
            "Request duration until the body ended",
            ["api"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens = Counter(
            "mesh_router_tokens", "Tokens reported by workers", ["kind"], registry=r
        )
        self.retries = Counter(
            "mesh_router_retries", "Attempts moved to another worker", ["reason"], registry=r
        )
        self.disconnects = Counter(
            "mesh_router_client_disconnects",
            "Clients that left before the response ended",
            registry=r,
        )
        self.active = Gauge(
            "mesh_worker_requests_active",
            "In-flight requests per worker",
            ["worker"],
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
