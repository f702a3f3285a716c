"""
Where the fleet comes from
==========================

A running mesh's workers have three sources (``docs/configuration.md``, "Reload
and discovery"):

* the static ``workers`` entries of its configuration (replaced by a reload);
* ``dns://name:port`` entries: every address ``name`` resolves to is a worker on
  ``port``, with the entry's labels and key (a Kubernetes headless Service lists
  one address per ready pod);
* a ``workers_file``: the same entries, in a file meshkit watches.

:class:`FleetSources` holds what each source last said; :meth:`FleetSources.desired`
is the fleet they add up to and :func:`plan` the changes that take the running fleet
there. Pure: resolving names and reading files belong to the lifecycle thread
(:mod:`meshkit.lifecycle.discovery`), which feeds the results in.

Only workers a source put in the fleet are ever removed by it: a worker added
through the admin API or ``Mesh.add_worker`` stays until removed the same way.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from meshkit.core.workers import Worker
from meshkit.errors import ConfigError

__all__ = ["DnsWorkers", "FleetPlan", "FleetSources", "plan", "same_worker"]

DNS_SCHEME = "dns"


@dataclass(frozen=True, eq=True)
class DnsWorkers:
    """A ``dns://name:port[/path]`` worker entry: one worker per address of ``name``.

    Workers found this way are plain ``http://``: a certificate names the Service,
    not each pod's address.
    """

    name: str
    port: int
    base_path: str = ""
    api_key: str | None = field(default=None, repr=False)
    labels: Mapping[str, str] = field(default_factory=dict)
    #: per address, ``{host}`` being the address (see :class:`Worker`)
    kv_events: str | None = None
    kv_replay: str | None = None

    @classmethod
    def parse(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        labels: Mapping[str, str] | None = None,
        kv_events: str | None = None,
        kv_replay: str | None = None,
    ) -> DnsWorkers:
        parts = urlsplit(url.strip())
        if parts.query or parts.fragment or "@" in parts.netloc:
            raise ConfigError("workers.url", "a dns:// entry takes no query, fragment or user info")
        if parts.scheme != DNS_SCHEME or not parts.hostname:
            raise ConfigError("workers.url", f"not a dns://name:port entry: {url!r}")
        try:
            port = parts.port
        except ValueError:
            raise ConfigError("workers.url", f"bad port in {url!r}") from None
        if not port:
            raise ConfigError("workers.url", f"a dns:// entry needs the workers' port: {url!r}")
        entry = cls(
            parts.hostname,
            port,
            parts.path.rstrip("/"),
            api_key or None,
            {str(k): str(v) for k, v in (labels or {}).items()},
            kv_events or None,
            kv_replay or None,
        )
        entry.worker("127.0.0.1")  # the labels are checked now, not at the first answer
        return entry

    @property
    def source(self) -> str:
        """``dns://name:port`` (no key): how logs and metrics name the entry."""
        return f"{DNS_SCHEME}://{self.name}:{self.port}"

    def worker(self, address: str) -> Worker:
        host = f"[{address}]" if ":" in address else address
        return Worker(
            f"http://{host}:{self.port}{self.base_path}",
            api_key=self.api_key,
            labels=self.labels,
            kv_events=self.kv_events,
            kv_replay=self.kv_replay,
        )

    def workers(self, addresses: Iterable[str], limit: int) -> tuple[Worker, ...]:
        """The workers for the addresses a lookup returned: valid IPs only, each
        once, in address order (so every router numbers the fleet alike), at most
        ``limit`` (``discovery.max_addresses``)."""
        ips: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
        for a in addresses:
            try:
                ip = ipaddress.ip_address(a.split("%", 1)[0])  # drop an IPv6 zone
            except ValueError:
                continue
            ips.add(ip)
        ordered = sorted(ips, key=lambda ip: (ip.version, ip))
        return tuple(self.worker(str(ip)) for ip in ordered[: max(0, limit)])


def same_worker(a: Worker, b: Worker) -> bool:
    """Whether ``b`` needs no change to become ``a`` (same id, labels, key, TLS)."""
    return (
        a.id == b.id
        and a.labels == b.labels
        and a.api_key == b.api_key
        and a.tls == b.tls
        and a.kv_events == b.kv_events
        and a.kv_replay == b.kv_replay
    )


@dataclass(frozen=True)
class FleetPlan:
    """What takes the fleet to the sources' workers."""

    add: tuple[Worker, ...] = ()
    #: same id, new labels, key or TLS options: swapped in place, leases kept
    update: tuple[Worker, ...] = ()
    #: ids to drain, then remove
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.add or self.update or self.remove)

    def summary(self) -> str:
        return f"{len(self.add)} added, {len(self.update)} updated, {len(self.remove)} removed"


def plan(
    fleet: Mapping[str, Worker],
    managed: Iterable[str],
    desired: Sequence[Worker],
    *,
    leaving: Iterable[str] = (),
) -> FleetPlan:
    """The changes from ``fleet`` (id → worker) to ``desired``.

    :param managed: the ids the sources put in the fleet; only these are removed.
    :param leaving: ids already draining out; not added, updated or removed again
        (one that comes back is added once its removal is done).
    """
    out = set(leaving)
    want = {w.id: w for w in desired}
    add: list[Worker] = []
    update: list[Worker] = []
    for wid, w in want.items():
        if wid in out:
            continue
        have = fleet.get(wid)
        if have is None:
            add.append(w)
        elif not same_worker(w, have):
            update.append(w)
    gone = [wid for wid in managed if wid not in want and wid in fleet and wid not in out]
    return FleetPlan(tuple(add), tuple(update), tuple(sorted(gone)))


class FleetSources:
    """What each source last said (see the module docstring); no I/O.

    :param max_addresses: workers one ``dns://`` entry may become.
    """

    def __init__(self, max_addresses: int) -> None:
        self.max_addresses = max_addresses
        self.static: tuple[Worker, ...] = ()
        self.dns: tuple[DnsWorkers, ...] = ()
        #: the workers file's entries, as last read well
        self.file_workers: tuple[Worker, ...] = ()
        self.file_dns: tuple[DnsWorkers, ...] = ()
        #: the addresses each name last resolved to (a failed lookup keeps them)
        self.resolved: dict[str, tuple[str, ...]] = {}

    def configure(self, static: Sequence[Worker], dns: Sequence[DnsWorkers]) -> None:
        self.static = tuple(static)
        self.dns = tuple(dns)
        self._forget_unused()

    def set_file(self, workers: Sequence[Worker], dns: Sequence[DnsWorkers]) -> None:
        self.file_workers = tuple(workers)
        self.file_dns = tuple(dns)
        self._forget_unused()

    def entries(self) -> tuple[DnsWorkers, ...]:
        """Every dns entry, each once, in the order written."""
        out: list[DnsWorkers] = []
        for e in self.dns + self.file_dns:
            if e not in out:
                out.append(e)
        return tuple(out)

    def names(self) -> tuple[str, ...]:
        """The names to look up, each once."""
        return tuple(dict.fromkeys(e.name for e in self.entries()))

    def unresolved(self) -> tuple[str, ...]:
        """Names never looked up well: a new entry's workers are not known yet."""
        return tuple(n for n in self.names() if n not in self.resolved)

    def set_addresses(self, name: str, addresses: Iterable[str]) -> None:
        self.resolved[name] = tuple(addresses)

    def _forget_unused(self) -> None:
        keep = set(self.names())
        for name in [n for n in self.resolved if n not in keep]:
            del self.resolved[name]

    def desired(self) -> tuple[Worker, ...]:
        """The fleet the sources add up to. A worker two sources name is the first
        one's: static entries, then the file's, then each dns entry's addresses."""
        found: dict[str, Worker] = {}
        groups: list[Iterable[Worker]] = [self.static, self.file_workers]
        groups += [
            e.workers(self.resolved.get(e.name, ()), self.max_addresses) for e in self.entries()
        ]
        for group in groups:
            for w in group:
                found.setdefault(w.id, w)
        return tuple(found.values())
