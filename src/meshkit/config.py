"""
Configuration
=============

One validated configuration, from keyword arguments, a TOML file
(:meth:`MeshConfig.from_file`) or the environment (:meth:`MeshConfig.from_env`:
``MESHKIT_CONFIG`` = a TOML path, ``MESHKIT_WORKERS`` = a comma list of URLs).

Every section is a frozen dataclass; every bound has a key and a default. An
error is a :class:`~meshkit.errors.ConfigError` that names the key at fault and,
for files, the file (and line, where TOML says it).

Security: ``api_key`` values are never echoed in errors; prefer ``api_key_env``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshkit.core.discovery import DNS_SCHEME, DnsWorkers
from meshkit.core.workers import Worker, zmq_endpoint
from meshkit.errors import ConfigError

__all__ = [
    "ADMIN_WORKER_KEYS",
    "BoundsConfig",
    "DiscoveryConfig",
    "ExtProcConfig",
    "KvConfig",
    "LifecycleConfig",
    "MeshConfig",
    "MetricsConfig",
    "PdConfig",
    "PrepareConfig",
    "RoutingConfig",
    "ServerConfig",
    "UpstreamConfig",
    "WorkerConfig",
    "load_workers_file",
    "worker_config",
]


@dataclass(frozen=True)
class PrepareConfig:
    """The bounded prepare pool (``[prepare]``)."""

    workers: int | None = None  # default: half the CPUs, minimum 1
    queue_capacity: int = 256
    queue_timeout_ms: int = 30_000
    timeout_ms: int = 60_000
    shutdown_grace_ms: int = 5_000
    inline_threshold_bytes: int = 64 * 1024
    max_tokenize_bytes: int = 4 * 1024 * 1024
    workers_per_tokenizer: int = 4
    # Prefix ids through tiktoken (the `fast` extra) where it is proven exact.
    fast_tokenizer: bool = True
    # Prefix pieces (text between two safe cuts, a few KiB) each tokenizer copy
    # remembers: a shared system prompt is tokenized once (0: none remembered).
    prefix_cache_entries: int = 512

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ConfigError("prepare.workers", "must be at least 1")
        for name in ("queue_timeout_ms", "timeout_ms", "workers_per_tokenizer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"prepare.{name}", "must be at least 1")
        for name in (
            "queue_capacity",
            "shutdown_grace_ms",
            "inline_threshold_bytes",
            "max_tokenize_bytes",
            "prefix_cache_entries",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"prepare.{name}", "must not be negative")

    @property
    def resolved_workers(self) -> int:
        """``workers``, or the default (half the CPUs this process may run on, at
        least one)."""
        if self.workers is not None:
            return self.workers
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cpus = os.cpu_count() or 1
        return max(1, cpus // 2)


@dataclass(frozen=True)
class UpstreamConfig:
    """Connections to workers (``[upstream]``)."""

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    pool_limit: int = 1000
    pool_limit_per_worker: int = 256
    # Below the workers' keep-alive (SGLang closes idle connections after 5 s):
    # a reused connection the worker already closed fails with a reset.
    idle_timeout_s: float = 3.0
    max_attempts: int = 3
    backoff_base_s: float = 0.05
    backoff_max_s: float = 1.0
    # Admission control (503 ``overloaded`` at once, before any byte goes upstream).
    # None: the pool's own limits, where waiting for a pooled connection would begin;
    # per worker 0 = no per-worker limit (the global one still applies).
    max_in_flight_per_worker: int | None = None
    max_in_flight: int | None = None
    # Unread bytes of one response held while its client reads slowly: reading from
    # the worker pauses above it and resumes below a quarter of it (asyncio client).
    read_buffer_bytes: int = 1024 * 1024
    # Request URLs (a worker's, with the client's path and query) whose parse a
    # client keeps; the cache starts over when full.
    max_cached_urls: int = 4096
    # Distinct per-request `timeout` extensions (httpx's) whose bounds a transport
    # keeps worked out; the memo starts over when full (clients use a few).
    max_cached_timeouts: int = 64

    def __post_init__(self) -> None:
        for name in ("read_buffer_bytes", "max_cached_urls", "max_cached_timeouts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"upstream.{name}", "must be >= 1")
        if self.max_in_flight == 0:
            raise ConfigError(
                "upstream.max_in_flight", "must be >= 1: requests in flight are always bounded"
            )

    @property
    def in_flight_limit_per_worker(self) -> int:
        """Upstream requests one worker may have in flight (0: no per-worker limit)."""
        per = self.max_in_flight_per_worker
        return self.pool_limit_per_worker if per is None else per

    @property
    def in_flight_limit(self) -> int:
        """Upstream requests the whole fleet may have in flight (always finite)."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return self.pool_limit or DEFAULT_MAX_IN_FLIGHT


#: ``upstream.max_in_flight`` when neither it nor ``pool_limit`` is set (0 = unbounded pool)
DEFAULT_MAX_IN_FLIGHT = 4096


@dataclass(frozen=True)
class BoundsConfig:
    """Request bounds (``[bounds]``)."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_headers: int = 128
    max_sse_line_bytes: int = 1024 * 1024
    max_json_depth: int = 64
    # A worker's body read whole before it is answered: an error compared across
    # workers, a model list merged, a PD answer whose logprobs are merged.
    max_captured_body_bytes: int = 8 * 1024 * 1024
    # A request body of the admin API (worker definitions, JSON of a few hundred bytes).
    max_admin_body_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ConfigError(f"bounds.{f.name}", "must be >= 1")


@dataclass(frozen=True)
class RoutingConfig:
    """Placement inputs (``[routing]``)."""

    session_header: str | None = "x-session-id"
    responses_affinity_max: int = 100_000
    responses_affinity_ttl_s: float = 3600.0
    # A referenced response no worker holds is not asked for again this long.
    responses_lookup_ttl_s: float = 60.0
    # Background responses whose usage this process counted (so a later read of one
    # does not count it again); the least recently read are forgotten past this.
    responses_counted_max: int = 100_000
    seed: int | None = None

    def __post_init__(self) -> None:
        # Checked here, so that the error names the key the user wrote.
        for key in ("responses_affinity_max", "responses_counted_max"):
            if getattr(self, key) < 1:
                raise ConfigError(f"routing.{key}", "must be >= 1")
        for key in ("responses_affinity_ttl_s", "responses_lookup_ttl_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"routing.{key}", "must be > 0")


@dataclass(frozen=True)
class LifecycleConfig:
    """Worker health, breakers, sleep and drain (``[lifecycle]``)."""

    health_path: str = "/health"
    health_interval_s: float = 10.0
    health_timeout_s: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2
    breaker_failures: int = 5
    breaker_open_s: float = 10.0
    wake_wait_s: float = 30.0
    wake_retry_after_s: float = 5.0
    idle_sleep_s: float | None = None
    sleep_level: int = 1
    drain_timeout_s: float = 60.0
    probe: bool = True
    # Issue 6 (docs/lifecycle.md). How long one POST /wake_up or /sleep may take.
    wake_timeout_s: float = 300.0
    # A finished Idempotency-Key is recognised as a replay this long (bounded map).
    idempotency_ttl_s: float = 600.0
    idempotency_max: int = 10_000
    # Refuse untracked workers (label mesh.tracking other than "complete").
    require_tracking: bool = False
    # How often an unlabelled worker's GET /v1/models is read again (0: never read).
    models_interval_s: float = 60.0
    # Model ids kept from one worker's list (a vLLM lists its LoRA adapters too); a
    # longer list leaves the worker's models unknown (the engine decides).
    max_models_per_worker: int = 4096
    # Read each engine's load (vLLM, SGLang and llama.cpp Prometheus gauges) with every probe, so
    # this router sees what the other routers put there too ("" = off).
    engine_metrics_path: str = "/metrics"
    # An engine's metrics text is read up to this many bytes (vLLM's are ~100 KiB).
    max_metrics_bytes: int = 4 * 1024 * 1024
    # What is read of a worker's answer to a probe, /is_sleeping, a sleep or a wake
    # (engines answer a few bytes); the rest of a longer one is not read.
    max_probe_bytes: int = 64 * 1024
    # Workers the controller's own tables remember (when each one's model list was
    # read, which warnings it was given); past it a table starts over.
    max_tracked_workers: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "max_models_per_worker",
            "max_metrics_bytes",
            "max_probe_bytes",
            "max_tracked_workers",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"lifecycle.{name}", "must be >= 1")


@dataclass(frozen=True)
class PdConfig:
    """Prefill/decode disaggregation (``[pd]``; used when the fleet has both roles)."""

    protocol: str = "sglang"  # "sglang": concurrent legs; "vllm": kv_transfer_params
    prefill_policy: str = "cache_aware"
    decode_policy: str = "power_of_two"
    # Threads that run SGLang's prefill legs beside the decode legs for sync callers
    # (WSGI, MeshTransport): more pairs at once wait for one, their decode leg sent.
    sync_leg_threads: int = 32

    def __post_init__(self) -> None:
        if self.sync_leg_threads < 1:
            raise ConfigError("pd.sync_leg_threads", "must be >= 1")


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True


@dataclass(frozen=True)
class DiscoveryConfig:
    """``dns://`` worker entries and the ``workers_file`` (``[discovery]``).

    Names are looked up again every ``lifecycle.health_interval_s``.
    """

    # Workers one dns:// entry may become (a lookup returning more keeps the first).
    max_addresses: int = 256
    resolve_timeout_s: float = 5.0
    # How often the workers file's modification time is checked.
    watch_interval_s: float = 1.0
    max_file_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_addresses < 1:
            raise ConfigError("discovery.max_addresses", "must be at least 1")
        for name in ("resolve_timeout_s", "watch_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"discovery.{name}", "must be > 0")


@dataclass(frozen=True)
class KvConfig:
    """KV-cache events from the engines (``[kv]``; workers name their publishers
    with ``kv_events``). Needs ``meshkit[kv]`` (pyzmq)."""

    # (worker, block) entries the index keeps per model, each worker at most its share;
    # past it a worker's new block replaces its newest entry (kv_index.py says why).
    max_blocks_per_model: int = 1_000_000
    # Leading prompt tokens a request is matched on (prepare renders and tokenizes
    # at most the prompt's bytes it needs for these).
    match_tokens: int = 32768
    # A gap is replayed from the publisher's replay endpoint within this, or forgotten.
    replay_timeout_s: float = 2.0
    # Batches read from the socket before they are applied (in apply_blocks pieces).
    apply_batch: int = 64
    # Blocks applied under one hold of the routing lock: a batch (or one event) with
    # more is applied in pieces, placement running between them.
    apply_blocks: int = 1024
    # LoRA adapter names remembered from events (a request naming one is matched on
    # its adapter's blocks); an adapter seen past this is not matched.
    max_lora_names: int = 4096
    # Messages ZeroMQ queues for a subscriber that falls behind (then it drops: a gap).
    # vLLM keeps 10,000 batches for replay: a subscriber further behind cannot be
    # caught up anyway. What one subscriber may queue: receive_hwm x max_message_bytes.
    receive_hwm: int = 10_000
    # A message over this drops the publisher's connection (libzmq's MAXMSGSIZE); the
    # subscriber starts again, the worker's entries rebuilt (replayed, or from new events).
    max_message_bytes: int = 16 * 1024 * 1024
    # A worker placed on whose publisher then sends nothing for this long is matched on
    # the approximate tree until it publishes again (kv_silence.py says why); 0: never.
    silence_s: float = 60.0
    # A `meshkit kv-relay` to take every worker's events from instead of its engine
    # (one subscription per engine for any number of routers), or a list of them: the
    # first is used, and the next when it goes away (lifecycle/kv.py says how).
    relay: str | tuple[str, ...] | None = None
    # The relay's replay endpoint (a list: one per relay, in the same order): joins,
    # gaps and a move to another relay are replayed from its buffer, not asked of the
    # engines (without it, of the workers' kv_replay endpoints).
    relay_replay: str | tuple[str, ...] | None = None
    # A publisher or relay connection that answers nothing for this long is dropped
    # (ZeroMQ heartbeats, sent every third of it), and a relay not reached within it
    # is passed for the next one; 0: never.
    heartbeat_s: float = 10.0
    # The stamps of the last this many batches per worker are remembered, so that a
    # copy (a replay's live twin, or a batch from a relay that trails the one before
    # it by up to this many) is skipped and not taken for a restarted publisher.
    trail_batches: int = 1024
    # Candidate sets (the workers a request may go to) whose per-block-size masks
    # the index remembers; past it the memo starts over.
    max_worker_sets: int = 256

    def __post_init__(self) -> None:
        for name in (
            "max_blocks_per_model",
            "match_tokens",
            "apply_batch",
            "apply_blocks",
            "max_lora_names",
            "max_worker_sets",
            "max_message_bytes",
            "receive_hwm",
            "trail_batches",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv.{name}", "must be at least 1")
        if not self.replay_timeout_s > 0:
            raise ConfigError("kv.replay_timeout_s", "must be > 0")
        if not self.silence_s >= 0:
            raise ConfigError("kv.silence_s", "must be >= 0 (0: never)")
        if not self.heartbeat_s >= 0:
            raise ConfigError("kv.heartbeat_s", "must be >= 0 (0: never)")
        for endpoint in self.relays:
            zmq_endpoint("kv.relay", endpoint)
        if self.relay_replay is not None:
            if not self.relays:
                raise ConfigError("kv.relay_replay", "a relay's replay endpoint needs kv.relay")
            if len(self.relay_replays) != len(self.relays):
                raise ConfigError(
                    "kv.relay_replay", "needs one endpoint per kv.relay entry, in the same order"
                )
            for endpoint in self.relay_replays:
                zmq_endpoint("kv.relay_replay", endpoint)

    @property
    def relays(self) -> tuple[str, ...]:
        """``relay`` as a tuple (empty: every engine directly)."""
        return _endpoints(self.relay)

    @property
    def relay_replays(self) -> tuple[str, ...]:
        """``relay_replay`` as a tuple, one per relay (empty: none)."""
        return _endpoints(self.relay_replay)


def publisher_endpoints(entries: Iterable[str], key: str) -> dict[str, str | None]:
    """``kv_relay.publishers`` entries (``--publisher`` flags) checked: each
    ``"EVENTS"`` or ``"EVENTS,REPLAY"``, as {events endpoint: replay endpoint}."""
    out: dict[str, str | None] = {}
    for entry in entries:
        parts = entry.split(",")
        if len(parts) > 2:
            raise ConfigError(key, f"not EVENTS or EVENTS,REPLAY: {entry!r}")
        events = zmq_endpoint(key, parts[0])
        if events is None:
            raise ConfigError(key, f"not EVENTS or EVENTS,REPLAY: {entry!r}")
        replay = zmq_endpoint(key, parts[1]) if len(parts) == 2 else None
        out[events] = out.get(events) or replay
    return out


def _endpoints(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class KvRelayConfig:
    """``meshkit kv-relay`` (``[kv_relay]``; its flags take precedence): it subscribes
    once to every publisher the workers name and republishes for the routers."""

    # Where routers subscribe (`[kv] relay` on their side).
    bind: str = "tcp://127.0.0.1:5600"
    # Publishers besides the workers' kv_events (engines this config does not route to),
    # each "EVENTS" or "EVENTS,REPLAY" (the engine's replay endpoint, asked on connecting).
    publishers: tuple[str, ...] = ()
    # Messages queued per router that falls behind; past it that router sees a gap.
    send_hwm: int = 10_000
    # Where routers ask for replays ("": none): answered from the messages kept below.
    replay_bind: str = "tcp://127.0.0.1:5601"
    # Bytes of each engine's newest messages kept for replays (the oldest go first).
    replay_bytes: int = 16 * 1024 * 1024
    # /metrics over HTTP on metrics_host; 0 = none.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # Also relay the engines routers subscribe to that no worker or publisher here
    # names (a worker added by an admin verb, found by a router's own discovery).
    follow_routers: bool = True
    # Engines followed that way, at most (past it a router's subscription is refused).
    max_followed: int = 1024

    def __post_init__(self) -> None:
        zmq_endpoint("kv_relay.bind", self.bind, bind=True)
        object.__setattr__(self, "publishers", tuple(self.publishers))
        publisher_endpoints(self.publishers, "kv_relay.publishers")
        if self.replay_bind:
            zmq_endpoint("kv_relay.replay_bind", self.replay_bind, bind=True)
        for name in ("send_hwm", "replay_bytes", "max_followed"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_relay.{name}", "must be at least 1")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError("kv_relay.metrics_port", "must be in [0, 65535]")


@dataclass(frozen=True)
class ServerConfig:
    """The standalone gateway, ``meshkit serve`` (``[server]``); its flags take precedence."""

    host: str = "127.0.0.1"
    port: int = 8080
    # How long in-flight responses (streams) may run on after SIGTERM/SIGINT.
    grace_s: float = 30.0
    log_level: str = "info"
    # Off by default: an access log line carries paths and client addresses.
    access_log: bool = False
    # The HTTP server: "builtin" (meshkit.server.h1.conn, the fastest), "uvicorn" or "granian".
    http: str = "builtin"
    # Built-in server: idle keep-alive connections close after this many seconds.
    keep_alive_s: float = 5.0
    # Built-in server: connections over this are answered 503 and closed.
    max_connections: int = 4096
    # Built-in server: requests a connection pipelines behind the running one are
    # parsed this far ahead, then reading pauses (meshkit.server.h1.conn).
    max_pipelined: int = 16
    # Router processes accepting on the one port ("auto": the usable CPUs); a
    # supervisor restarts a child that dies (meshkit.server.supervisor).
    processes: int | str = 1
    # With processes > 1, the children take the engines' KV events through one relay
    # process the supervisor runs (one subscription per engine, not one per child),
    # unless [kv] relay names a relay of your own; false: each child subscribes.
    kv_relay: bool = True


@dataclass(frozen=True)
class ExtProcConfig:
    """``meshkit extproc``, the Envoy endpoint picker (``[extproc]``); its flags take
    precedence."""

    host: str = "127.0.0.1"
    # 9002 and 9090: the ports the Gateway API Inference Extension's pickers use.
    port: int = 9002
    # The gateway's own routes (/metrics, /health, /readiness, /workers); 0 = none.
    metrics_port: int = 9090
    # gRPC streams (requests in flight through Envoy) at once; more are refused.
    max_streams: int = 4096
    grace_s: float = 30.0
    # Worker host names are looked up for Envoy (it needs IP literals) and kept this long.
    resolve_ttl_s: float = 30.0
    resolve_max: int = 4096
    # The largest gRPC message taken from or given to Envoy: a BUFFERED body is one
    # message. None: twice bounds.max_body_bytes and 1 MiB, so a body over that
    # bound still reaches the picker and gets its 413 (gRPC's own default, 4 MiB,
    # failed larger bodies with Envoy's empty 500).
    max_message_bytes: int | None = None

    def message_limit(self, max_body_bytes: int) -> int:
        """``max_message_bytes``, or what it defaults to for ``bounds.max_body_bytes``."""
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        return min(2 * max_body_bytes + (1 << 20), 2**31 - 1)

    def __post_init__(self) -> None:
        if self.max_message_bytes is not None and self.max_message_bytes < 1:
            raise ConfigError("extproc.max_message_bytes", "must be >= 1")
        for name in ("max_streams", "resolve_max"):
            if getattr(self, name) < 1:
                raise ConfigError(f"extproc.{name}", "must be at least 1")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"extproc.{name}", "must be in [0, 65535]")


@dataclass(frozen=True)
class WorkerConfig:
    url: str
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    tls_verify: bool = True
    tls_ca_file: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None

    def _key(self) -> str | None:
        if not self.api_key_env:
            return self.api_key
        key = os.environ.get(self.api_key_env)
        if key is None:
            raise ConfigError(
                "workers.api_key_env", f"environment variable {self.api_key_env} is not set"
            )
        return key

    def build(self) -> Worker | DnsWorkers:
        key = self._key()
        labels = {str(k): str(v) for k, v in self.labels.items()}
        if self.url.strip().lower().startswith(DNS_SCHEME + "://"):
            if self.tls_ca_file or self.tls_client_cert or self.tls_client_key:
                raise ConfigError("workers.url", "dns:// entries are plain http: no TLS options")
            return DnsWorkers.parse(
                self.url,
                api_key=key,
                labels=labels,
                kv_events=self.kv_events,
                kv_replay=self.kv_replay,
            )
        return Worker(
            self.url,
            api_key=key,
            labels=labels,
            tls_verify=self.tls_verify,
            tls_ca_file=self.tls_ca_file,
            tls_client_cert=self.tls_client_cert,
            tls_client_key=self.tls_client_key,
            kv_events=self.kv_events,
            kv_replay=self.kv_replay,
        )


_SECTIONS: dict[str, type[Any]] = {
    "prepare": PrepareConfig,
    "upstream": UpstreamConfig,
    "bounds": BoundsConfig,
    "routing": RoutingConfig,
    "lifecycle": LifecycleConfig,
    "metrics": MetricsConfig,
    "pd": PdConfig,
    "server": ServerConfig,
    "discovery": DiscoveryConfig,
    "extproc": ExtProcConfig,
    "kv": KvConfig,
    "kv_relay": KvRelayConfig,
}

#: the keys a reload (SIGHUP, ``Mesh.reconfigure``) applies; the rest need a restart
RELOADABLE = frozenset({"workers", "dns_workers", "workers_file", "policy", "policies"})


@dataclass(frozen=True)
class MeshConfig:
    """The whole configuration; the same keys are ``Mesh(...)`` keyword arguments."""

    workers: tuple[Worker, ...] = ()
    #: the ``dns://name:port`` entries of ``workers``
    dns_workers: tuple[DnsWorkers, ...] = ()
    #: a file of more worker entries, watched (relative: to the config file's folder)
    workers_file: str | None = None
    policy: Any = "round_robin"
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    tokenizer: str | None = None
    tokenizers: Mapping[str, str] = field(default_factory=dict)
    admin_key: str | None = field(default=None, repr=False)
    prepare: PrepareConfig = PrepareConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    bounds: BoundsConfig = BoundsConfig()
    routing: RoutingConfig = RoutingConfig()
    lifecycle: LifecycleConfig = LifecycleConfig()
    metrics: MetricsConfig = MetricsConfig()
    pd: PdConfig = PdConfig()
    server: ServerConfig = ServerConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    kv: KvConfig = KvConfig()
    kv_relay: KvRelayConfig = KvRelayConfig()
    extproc: ExtProcConfig = ExtProcConfig()

    @classmethod
    def build(cls, source: str | None = None, **kwargs: Any) -> MeshConfig:
        """Validate keyword arguments (sections as dicts or section objects)."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in known:
                raise ConfigError(key, "unknown key", source=source)
        values: dict[str, Any] = {}
        for key, raw in kwargs.items():
            if key in _SECTIONS:
                values[key] = _section(_SECTIONS[key], key, raw, source)
            elif key == "workers":
                values["workers"], dns = _workers(raw, source)
                values["dns_workers"] = tuple(values.get("dns_workers", ())) + dns
            elif key == "dns_workers":
                static, dns = _workers(raw, source)
                if static:
                    raise ConfigError(key, "takes dns:// entries only", source=source)
                values[key] = tuple(values.get(key, ())) + dns
            elif key in ("tokenizer", "admin_key", "workers_file"):
                if raw is not None and not isinstance(raw, str):
                    raise ConfigError(key, "must be a string", source=source)
                values[key] = raw
            elif key in ("policies", "tokenizers"):
                if not isinstance(raw, Mapping):
                    raise ConfigError(key, "must be a table", source=source)
                values[key] = dict(raw)
            else:
                values[key] = raw
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MeshConfig:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("MESHKIT_CONFIG", f"no such file: {p}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("toml", str(exc), source=str(p)) from None
        config = cls.build(source=str(p), **data)
        if config.workers_file and not Path(config.workers_file).is_absolute():
            where = str(p.parent / config.workers_file)
            config = dataclasses.replace(config, workers_file=where)
        return config

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MeshConfig:
        env = os.environ if environ is None else environ
        path = env.get("MESHKIT_CONFIG")
        config = cls.from_file(path) if path else cls()
        urls = env.get("MESHKIT_WORKERS")
        if urls:
            # commas separate workers only before a scheme: label values such as
            # mesh.apis=chat,completions contain commas too
            items = [x for x in re.split(r",(?=\s*(?:https?|dns)://)", urls) if x.strip()]
            workers, dns = _workers([parse_worker_arg(u) for u in items], "MESHKIT_WORKERS")
            config = dataclasses.replace(
                config, workers=config.workers + workers, dns_workers=config.dns_workers + dns
            )
        policy = env.get("MESHKIT_POLICY")
        if policy:
            config = dataclasses.replace(config, policy=policy)
        return config


def parse_worker_arg(arg: str) -> dict[str, Any]:
    """``URL#label=value;label=value`` (the CLI and ``MESHKIT_WORKERS`` form).

    Labels are separated by ``;`` because ``mesh.apis`` values contain commas:
    ``http://h:8000#mesh.apis=chat,completions;mesh.model=m``.
    """
    url, _, frag = arg.strip().partition("#")
    labels: dict[str, str] = {}
    for item in filter(None, frag.split(";")):
        k, eq, v = item.partition("=")
        if not eq:
            raise ConfigError("workers.labels", f"label {item!r} is not key=value")
        labels[k.strip()] = v.strip()
    return {"url": url, "labels": labels}


def _workers(raw: Any, source: str | None) -> tuple[tuple[Worker, ...], tuple[DnsWorkers, ...]]:
    if raw is None:
        raw = ()
    if isinstance(raw, str | Mapping) or not isinstance(raw, typing.Iterable):
        raise ConfigError("workers", "must be a list of worker entries", source=source)
    workers: list[Worker] = []
    dns: list[DnsWorkers] = []
    for i, w in enumerate(raw):
        built = _worker(w, i, source)
        (dns if isinstance(built, DnsWorkers) else workers).append(built)  # type: ignore[arg-type]
    return tuple(workers), tuple(dns)


def load_workers_file(
    path: str | os.PathLike[str], max_bytes: int
) -> tuple[tuple[Worker, ...], tuple[DnsWorkers, ...]]:
    """The entries of a ``workers_file``: TOML ``[[workers]]`` tables, or JSON
    (``.json``: ``{"workers": [...]}`` or the list itself), the same keys as the
    config file's worker entries.

    :raises ConfigError: naming the file and the entry at fault.
    """
    p = Path(path)
    source = str(p)
    try:
        with p.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError("workers_file", f"cannot read {p}: {exc.strerror}") from None
    if len(raw) > max_bytes:
        raise ConfigError(
            "discovery.max_file_bytes", f"{p} is over {max_bytes} bytes", source=source
        )
    try:
        text = raw.decode("utf-8")
        if p.suffix.lower() == ".json":
            import json

            data: Any = json.loads(text)
        else:
            data = tomllib.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError("workers_file", f"cannot parse: {exc}", source=source) from None
    if isinstance(data, Mapping):
        unknown = set(data) - {"workers"}
        if unknown:
            raise ConfigError(sorted(unknown)[0], "unknown key (only workers)", source=source)
        data = data.get("workers", ())
    return _workers(data, source)


#: what an admin may set on a worker it adds over HTTP (``POST /workers``): not
#: ``api_key_env`` (it would send any of the gateway's environment variables to a
#: URL the caller picks) nor the TLS files (paths on the gateway's disk)
ADMIN_WORKER_KEYS = frozenset({"url", "api_key", "labels", "kv_events", "kv_replay"})


def worker_config(raw: Mapping[str, Any], *, source: str) -> WorkerConfig:
    """A worker's table (TOML, or its JSON twin) checked as ``[[workers]]`` entries
    are: the same keys, types and messages.

    :raises ConfigError: naming the key and ``source``.
    """
    config: WorkerConfig = _section(WorkerConfig, "workers", raw, source)
    return config


def _worker(raw: Any, index: int, source: str | None) -> Worker | DnsWorkers:
    if isinstance(raw, Worker | DnsWorkers):
        return raw
    if isinstance(raw, str):
        raw = {"url": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"workers[{index}]", "must be a table, a URL or a Worker", source=source)
    try:
        wc: WorkerConfig = _section(WorkerConfig, f"workers[{index}]", raw, source)
        return wc.build()
    except ConfigError as exc:
        if exc.source is None and source is not None:
            raise ConfigError(exc.key, str(exc).split(": ", 1)[-1], source=source) from None
        raise


def _section(cls: type[Any], name: str, raw: Any, source: str | None) -> Any:
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(name, "must be a table", source=source)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"{name}.{key}", "unknown key", source=source)
        values[key] = _check(f"{name}.{key}", hints[key], value, source)
    return cls(**values)


def _check(key: str, hint: Any, value: Any, source: str | None) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        # The first type the value fits (``int | str``: 4 or "auto"); else the
        # first type's complaint.
        first: ConfigError | None = None
        for hint_ in inner:
            try:
                return _check(key, hint_, value, source)
            except ConfigError as exc:
                first = first or exc
        assert first is not None
        raise first
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}", source=source)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}", source=source)
        if value < 0:
            raise ConfigError(key, f"must be >= 0, got {value}", source=source)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"must be a number, got {value!r}", source=source)
        if not value >= 0:  # also refuses nan, which TOML can spell
            raise ConfigError(key, f"must be >= 0, got {value}", source=source)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, "must be a string", source=source)
        return value
    if origin in (Mapping, dict) or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(key, "must be a table", source=source)
        if args == (str, str):
            # Names to strings (labels, tokenizers); an integer is taken as written
            # (`mesh.dp_size = 4`), anything else would become its Python repr.
            out = {}
            for k, v in value.items():
                if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, str | int):
                    raise ConfigError(key, "must map names to strings", source=source)
                out[k] = str(v)
            return out
        return dict(value)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, "must be a list", source=source)
        return tuple(_check(key, args[0], item, source) for item in value)
    return value
