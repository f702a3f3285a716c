"""
Workers and the fleet
=====================

A :class:`Worker` is one inference server: a base URL, an optional API key and
labels::

    mesh.apis              comma list of chat, completions, messages, responses,
                           generate, tokenize, models (absent = all)
    mesh.responses_state   "shared" when Responses state is shared across workers
    mesh.role              regular | prefill | decode
    mesh.model             the model names it serves, a comma list (absent: what
                           its ``GET /v1/models`` lists, learned by the probes;
                           any model until then)
    mesh.dp_size           data-parallel ranks: each rank becomes its own candidate
    mesh.bootstrap_port    prefill workers' KV bootstrap port (default 8998)
    mesh.sleep_mode        "vllm" when the worker implements vLLM sleep mode

A :class:`Candidate` is what a policy picks: a worker and, for DP-aware workers, one
rank. Ranks of one worker share an *origin* (scheme://host:port).

:class:`Fleet` holds the workers, their candidates and the in-flight load of
each candidate, of each worker and of the whole fleet, with the admission limits
placement compares them to (``upstream.max_in_flight_per_worker``,
``upstream.max_in_flight``). It is plain data: it holds no lock (``Mesh``
serialises access).

Security: a worker's ``api_key`` never appears in ``repr``, errors or metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from meshkit.core.endpoints import Api
from meshkit.core.engine_load import EngineLoad, others
from meshkit.core.kv_index import KvIndex
from meshkit.core.kv_silence import KvSilence
from meshkit.errors import ConfigError

__all__ = ["Candidate", "Fleet", "Tls", "Worker", "candidates_for", "zmq_endpoint"]

_ROLES: Final = frozenset({"regular", "prefill", "decode"})
#: weight of the newest sample in :attr:`Fleet.hold_s`
_HOLD_ALPHA: Final = 0.1
#: the weight of the newest engine report in the other routers' mean load on a worker
OTHERS_WEIGHT: Final = 0.5
_API_NAMES: Final = frozenset(a.value for a in Api)
# Aliases users write in labels.
_API_ALIASES: Final = {
    "chat_completions": "chat",
    "completion": "completions",
    "message": "messages",
}


class Worker:
    """One inference server.

    :param url: base URL, ``http://host:port`` (a path prefix is kept).
    :param api_key: the worker's own credential; when set, clients' credentials are
        dropped and this one is sent instead. Never shown in a repr or an error.
    :param labels: routing labels (see the module docstring).
    :param tls_verify: check an ``https://`` worker's certificate (default on).
    :param tls_ca_file: a PEM bundle of the CAs to check it against (default: the
        system's).
    :param tls_client_cert: a PEM client certificate for mutual TLS (with
        ``tls_client_key`` unless the file holds the key too).
    :param kv_events: the engine's KV-event publisher (``tcp://host:5557``, vLLM's
        ``--kv-events-config`` endpoint): its events tell ``cache_aware`` which
        prefixes it holds. ``{host}`` stands for the worker URL's host.
    :param kv_replay: the publisher's replay endpoint (a gap is then replayed
        rather than forgotten); ``{host}`` likewise.
    """

    __slots__ = (
        "_api_key",
        "apis",
        "base_path",
        "bootstrap_port",
        "dp_size",
        "host",
        "id",
        "kv_events",
        "kv_replay",
        "labels",
        "model",
        "models",
        "origin",
        "port",
        "responses_state_shared",
        "role",
        "scheme",
        "sleep_mode",
        "tls",
        "url",
    )

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        labels: Mapping[str, str] | None = None,
        *,
        tls_verify: bool = True,
        tls_ca_file: str | None = None,
        tls_client_cert: str | None = None,
        tls_client_key: str | None = None,
        kv_events: str | None = None,
        kv_replay: str | None = None,
    ) -> None:
        parts = urlsplit(url.strip())
        # Checked first, and the URL is not echoed: user info may hold a password.
        if parts.query or parts.fragment or "@" in parts.netloc:
            raise ConfigError("workers.url", "a worker URL takes no query, fragment or user info")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("workers.url", f"not an http(s) URL: {url!r}")
        try:
            explicit = parts.port
        except ValueError:
            raise ConfigError("workers.url", f"bad port in {url!r}") from None
        if explicit == 0:
            raise ConfigError("workers.url", f"port 0 is not a worker's port: {url!r}")
        port = explicit or (443 if parts.scheme == "https" else 80)
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = port
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.origin = f"{self.scheme}://{host}:{port}"
        self.base_path = parts.path.rstrip("/")
        self.url = self.origin + self.base_path
        self.id = self.url
        self._api_key = api_key or None
        self.labels: dict[str, str] = dict(labels or {})
        self.apis = _parse_apis(self.labels.get("mesh.apis"))
        self.role = self.labels.get("mesh.role", "regular").strip() or "regular"
        if self.role not in _ROLES:
            raise ConfigError("workers.labels.mesh.role", f"unknown role {self.role!r}")
        self.model = self.labels.get("mesh.model") or None
        names = {m.strip() for m in (self.model or "").split(",")} - {""}
        #: the models the label names (None: not labelled; the fleet may learn them)
        self.models: frozenset[str] | None = frozenset(names) or None
        self.responses_state_shared = self.labels.get("mesh.responses_state") == "shared"
        self.dp_size = _parse_int(self.labels, "mesh.dp_size", 1, 1, 1024)
        self.bootstrap_port = _parse_int(self.labels, "mesh.bootstrap_port", 8998, 1, 65535)
        self.sleep_mode = self.labels.get("mesh.sleep_mode") or None
        if tls_client_key and not tls_client_cert:
            raise ConfigError("workers.tls_client_key", "a client key needs tls_client_cert")
        tls = Tls(
            bool(tls_verify), tls_ca_file or None, tls_client_cert or None, tls_client_key or None
        )
        #: None: the defaults (verify against the system's CAs, no client certificate)
        self.tls: Tls | None = None if tls == _DEFAULT_TLS else tls
        self.kv_events = zmq_endpoint("workers.kv_events", kv_events, host)
        self.kv_replay = zmq_endpoint("workers.kv_replay", kv_replay, host)
        if self.kv_replay and not self.kv_events:
            raise ConfigError("workers.kv_replay", "a replay endpoint needs kv_events too")

    @property
    def api_key(self) -> str | None:
        return self._api_key

    def serves(self, api: Api) -> bool:
        # Every OpenAI/Anthropic-compatible server lists its models; "models" is
        # not something users write in mesh.apis.
        return self.apis is None or api in self.apis or api is Api.MODELS

    def declares(self, api: Api) -> bool:
        """True when ``mesh.apis`` names ``api`` explicitly (not merely "all")."""
        return self.apis is not None and api in self.apis

    def __repr__(self) -> str:
        key = ", api_key=<set>" if self._api_key else ""
        return f"Worker({self.url!r}{key}, labels={self.labels!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Worker) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)


def zmq_endpoint(key: str, raw: str | None, host: str = "", *, bind: bool = False) -> str | None:
    """``raw`` checked as a ZeroMQ endpoint to connect to (``bind``: to bind, where
    ``tcp://*:port`` is allowed), ``{host}`` replaced by ``host``."""
    if not raw:
        return None
    value = raw.strip().replace("{host}", host)
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest or ("*" in rest and not bind):
        what = "bind" if bind else "connect"
        raise ConfigError(key, f"not a ZeroMQ endpoint to {what} to: {raw!r} (tcp://host:port)")
    return value


def _parse_apis(raw: str | None) -> frozenset[Api] | None:
    if raw is None or not raw.strip() or raw.strip() == "*":
        return None
    out = set()
    for name in raw.split(","):
        name = _API_ALIASES.get(name.strip().lower(), name.strip().lower())
        if not name:
            continue
        if name not in _API_NAMES:
            raise ConfigError("workers.labels.mesh.apis", f"unknown API {name!r}")
        out.add(Api(name))
    return frozenset(out)


def _parse_int(labels: Mapping[str, str], key: str, default: int, lo: int, hi: int) -> int:
    raw = labels.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(f"workers.labels.{key}", f"not an integer: {raw!r}") from exc
    if not lo <= value <= hi:
        raise ConfigError(f"workers.labels.{key}", f"must be in [{lo}, {hi}], got {value}")
    return value


@dataclass(frozen=True, slots=True)
class Tls:
    """How to talk TLS to one ``https://`` worker (file paths; read by the client
    that connects, never here)."""

    verify: bool = True
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None


_DEFAULT_TLS: Final = Tls()


@dataclass(frozen=True, slots=True)
class Candidate:
    """A placement target: a worker, and a DP rank when the worker has several."""

    worker: Worker
    rank: int | None = None
    key: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        key = self.worker.id if self.rank is None else f"{self.worker.id}#dp{self.rank}"
        object.__setattr__(self, "key", key)

    @property
    def origin(self) -> str:
        return self.worker.origin


def candidates_for(worker: Worker) -> tuple[Candidate, ...]:
    """What a policy picks among for ``worker``: one candidate per DP rank, or itself."""
    if worker.dp_size > 1:
        return tuple(Candidate(worker, r) for r in range(worker.dp_size))
    return (Candidate(worker),)


#: ``Fleet.derived`` entries for model names no worker names (clients choose them)
DERIVED_BASE: Final = 256
#: and per model name the workers name (an entry per API and role asked for it)
DERIVED_PER_MODEL: Final = 4


def derived_limit(workers: Iterable[Worker], learned: Mapping[str, frozenset[str]]) -> int:
    """How many eligibility lists placement keeps: a fleet that names more models
    (a vLLM lists its LoRA adapters) gets room for all of them, or its lookups
    would start over on every few requests (45x slower at 300 models, 64 workers)."""
    names: set[str] = set()
    for w in workers:
        if w.models:
            names.update(w.models)
    for listed in learned.values():
        names.update(listed)
    return DERIVED_BASE + DERIVED_PER_MODEL * len(names)


class Fleet:
    """Workers, their candidates, and in-flight load per candidate (no locking).

    :param max_in_flight: admission limit on requests in flight in the whole fleet
        (0: none; a :class:`~meshkit.Mesh` always sets a finite one).
    :param max_in_flight_per_worker: the same per worker, all its DP ranks together
        (0: none).
    """

    def __init__(
        self,
        workers: Iterable[Worker] = (),
        *,
        max_in_flight: int = 0,
        max_in_flight_per_worker: int = 0,
        kv_max_blocks: int = 1_000_000,
        kv_silence_s: float = 60.0,
        kv_max_loras: int = 4096,
        kv_max_worker_sets: int = 256,
    ) -> None:
        self._workers: dict[str, Worker] = {}
        #: the blocks workers with KV events hold (fed by the subscribers)
        self.kv = KvIndex(kv_max_blocks, kv_max_loras, kv_max_worker_sets)
        #: publishers that went quiet while requests were placed on their workers
        self.kv_silence = KvSilence(kv_silence_s)
        #: per worker id: the engine's last load report, and the requests other
        #: routers held there then (see :mod:`meshkit.core.engine_load`)
        self.engine: dict[str, EngineLoad] = {}
        #: per candidate key: those requests, spread over the worker's ranks
        self.others: dict[str, int] = {}
        #: per worker id: the other routers' requests there, averaged over reports
        self._others_mean: dict[str, float] = {}
        self.candidates: tuple[Candidate, ...] = ()
        self._by_worker: dict[str, tuple[Candidate, ...]] = {}
        #: in-flight requests per candidate key
        self.load: dict[str, int] = {}
        #: in-flight prompt weight (characters/tokens) per candidate key
        self.weight: dict[str, int] = {}
        #: in-flight requests per worker id (its DP ranks together) and in all
        self.worker_load: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = max_in_flight
        self.max_in_flight_per_worker = max_in_flight_per_worker
        #: moving average of how long a request holds its slot (seconds; 0: none yet)
        self.hold_s = 0.0
        #: worker ids that health checks / breakers currently exclude
        self.unhealthy: set[str] = set()
        #: a change counter policies use to rebuild derived structures (rings)
        self.version = 0
        #: what callers derive from the workers alone (placement's eligibility
        #: lists), cleared when they change; workers are not mutated once added
        self.derived: dict[object, Any] = {}
        #: entries ``derived`` keeps before it starts over (see :func:`derived_limit`)
        self.derived_limit = DERIVED_BASE
        #: the models unlabelled workers listed when probed (bounded per worker)
        self.learned: dict[str, frozenset[str]] = {}
        for w in workers:
            self.add(w)

    @property
    def workers(self) -> tuple[Worker, ...]:
        return tuple(self._workers.values())

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def add(self, worker: Worker) -> None:
        if worker.id in self._workers:
            raise ConfigError("workers.url", f"duplicate worker {worker.url}")
        self._workers[worker.id] = worker
        cands = candidates_for(worker)
        self._by_worker[worker.id] = cands
        for c in cands:
            self.load.setdefault(c.key, 0)
            self.weight.setdefault(c.key, 0)
        self.worker_load.setdefault(worker.id, 0)
        self._rebuild()

    def replace(self, worker: Worker) -> bool:
        """Swap in ``worker`` for the one with its id (new labels, key or TLS):
        loads, health and learned models are kept, so leases in flight release
        into the same counts. False when no such worker is in the fleet."""
        old = self._workers.get(worker.id)
        if old is None:
            return False
        if (old.kv_events, old.kv_replay) != (worker.kv_events, worker.kv_replay):
            self.kv.forget(worker.id)  # another publisher: its subscriber starts afresh
            self.kv_silence.forget(worker.id)
        self._workers[worker.id] = worker
        cands = candidates_for(worker)
        keep = {c.key for c in cands}
        for c in self._by_worker.get(worker.id, ()):
            if c.key not in keep and self.load.get(c.key, 0) == 0:
                self.load.pop(c.key, None)
                self.weight.pop(c.key, None)
        self._by_worker[worker.id] = cands
        for c in cands:
            self.load.setdefault(c.key, 0)
            self.weight.setdefault(c.key, 0)
        if worker.models is not None:
            self.learned.pop(worker.id, None)
        self._rebuild()
        return True

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return None
        self.report_load(worker_id, None)
        for c in self._by_worker.pop(worker_id, ()):
            # A removed worker's in-flight responses still release; keep counts
            # only while non-zero so memory stays bounded by live requests.
            if self.load.get(c.key, 0) == 0:
                self.load.pop(c.key, None)
                self.weight.pop(c.key, None)
        if self.worker_load.get(worker_id, 0) == 0:
            self.worker_load.pop(worker_id, None)
        self.unhealthy.discard(worker_id)
        self.learned.pop(worker_id, None)
        self.kv.forget(worker_id)
        self.kv_silence.forget(worker_id)
        self._rebuild()
        return worker

    def report_load(self, worker_id: str, report: EngineLoad | None) -> None:
        """The engine's own load report (None: none now, count only ours)."""
        cands = self._by_worker.get(worker_id, ())
        if report is None or not cands:
            self.engine.pop(worker_id, None)
            self._others_mean.pop(worker_id, None)
            for c in cands:
                self.others.pop(c.key, None)
            return
        self.engine[worker_id] = report
        sample = others(report, self.worker_load.get(worker_id, 0))
        # One report is a snapshot held until the next one: where requests last less
        # than the probe interval it is mostly stale, and the in-flight gates spill
        # on its noise. The mean of the last few reports is what the next requests
        # will meet on average; where requests last longer it follows in ~2 reports.
        mean = self._others_mean.get(worker_id)
        mean = float(sample) if mean is None else mean + OTHERS_WEIGHT * (sample - mean)
        self._others_mean[worker_id] = mean
        extra = int(mean + 0.5)
        share, rest = divmod(extra, len(cands))
        for i, c in enumerate(cands):
            n = share + (1 if i < rest else 0)
            if n:
                self.others[c.key] = n
            else:
                self.others.pop(c.key, None)

    def placement_load(self) -> Mapping[str, int]:
        """In-flight requests per candidate as placement weighs them: this router's
        own, plus what other routers held there at the engine's last report."""
        if not self.others:
            return self.load
        extra = self.others
        return {k: v + extra.get(k, 0) for k, v in self.load.items()}

    def kv_group(self, worker: Worker) -> str:
        """The index group of ``worker``'s blocks: the models it serves."""
        models = self.models_of(worker)
        return ",".join(sorted(models)) if models else ""

    def models_of(self, worker: Worker) -> frozenset[str] | None:
        """The models ``worker`` serves: its label's, else what it listed, else
        None (any model)."""
        return worker.models or self.learned.get(worker.id)

    def learn(self, worker_id: str, models: frozenset[str] | None) -> bool:
        """What an unlabelled worker listed at ``GET /v1/models``; True when it changed
        (placement's derived lists are rebuilt then)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.models is not None:
            return False
        if not models:
            if self.learned.pop(worker_id, None) is None:
                return False
        elif self.learned.get(worker_id) == models:
            return False
        else:
            self.learned[worker_id] = models
        self.version += 1
        self.derived.clear()
        self.derived_limit = derived_limit(self._workers.values(), self.learned)
        return True

    def candidates_of(self, worker: Worker) -> tuple[Candidate, ...]:
        return self._by_worker.get(worker.id, ())

    def _rebuild(self) -> None:
        self.candidates = tuple(c for cs in self._by_worker.values() for c in cs)
        self.version += 1
        self.derived.clear()
        self.derived_limit = derived_limit(self._workers.values(), self.learned)

    def admits(self, worker: Worker) -> bool:
        """Whether ``worker`` may take one more request under both admission limits."""
        return not self.at_limit(worker)

    def at_limit(self, worker: Worker) -> bool:
        """Whether one more request on ``worker`` would pass an admission limit."""
        cap = self.max_in_flight
        if cap and self.in_flight >= cap:
            return True
        per = self.max_in_flight_per_worker
        return bool(per) and self.worker_load.get(worker.id, 0) >= per

    def acquire(self, cand: Candidate, weight: int = 0) -> None:
        self.load[cand.key] = self.load.get(cand.key, 0) + 1
        self.weight[cand.key] = self.weight.get(cand.key, 0) + weight
        wid = cand.worker.id
        self.worker_load[wid] = self.worker_load.get(wid, 0) + 1
        self.in_flight += 1

    def release(self, cand: Candidate, weight: int = 0, held_s: float | None = None) -> None:
        """Give back one request's slot; ``held_s`` (how long it held it) feeds
        :attr:`hold_s`, which retry hints of admission refusals are estimated from."""
        if held_s is not None and held_s >= 0:
            hold = self.hold_s
            self.hold_s = held_s if hold == 0.0 else hold + (held_s - hold) * _HOLD_ALPHA
        key = cand.key
        n = self.load.get(key, 0) - 1
        w = self.weight.get(key, 0) - weight
        if n < 0:
            # Never negative: a double release is a bug upstream, not a reason to
            # corrupt every later placement.
            return
        wid = cand.worker.id
        if self.in_flight > 0:
            self.in_flight -= 1
        wn = self.worker_load.get(wid, 0) - 1
        if wn < 0:
            wn = 0
        if w < 0:
            w = 0
        if wid not in self._workers:
            # A removed worker's counts live only while its requests do.
            if n == 0:
                self.load.pop(key, None)
                self.weight.pop(key, None)
            else:
                self.load[key] = n
                self.weight[key] = w
            if wn == 0:
                self.worker_load.pop(wid, None)
            else:
                self.worker_load[wid] = wn
            return
        self.load[key] = n
        self.weight[key] = w
        self.worker_load[wid] = wn

    def healthy(self, worker: Worker) -> bool:
        return worker.id not in self.unhealthy
