"""
Discovery: dns:// entries, the workers file, reloads
====================================================

The I/O half of :mod:`meshkit.core.discovery`, on the lifecycle thread's loop:

* every ``lifecycle.health_interval_s``, each ``dns://name:port`` entry's name is
  looked up again (the system resolver, bounded by ``discovery.resolve_timeout_s``);
* every ``discovery.watch_interval_s``, the ``workers_file`` is checked (its
  modification time, size and inode: a Kubernetes ConfigMap update swaps a
  symlink) and read again when it changed;
* :meth:`Discovery.reconfigure` takes a new configuration's sources (a reload).

After each, the fleet is taken to what the sources say: new workers are added
(unverified until probed, and probed at once), changed ones swapped in place,
and workers that left are drained (``lifecycle.drain_timeout_s``), then removed.

A failed lookup or a file that does not load changes nothing: the last good
answer stays, one log line says why (once, until the source recovers), and
``mesh_router_discovery_failures_total`` counts it. A lookup that returns no
address is a failure too (the resolver raises): so one bad answer never drains
a whole Service's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshkit.config import MeshConfig, load_workers_file
from meshkit.core.discovery import FleetPlan, FleetSources, plan
from meshkit.core.lifecycle import LifecycleError
from meshkit.core.workers import Worker
from meshkit.errors import ConfigError

if TYPE_CHECKING:
    from meshkit.lifecycle.controller import Lifecycle
    from meshkit.router import Router

__all__ = ["Discovery", "look_up"]

log = logging.getLogger("meshkit.discovery")

_Stamp = tuple[int, int, int]


def _stamp(path: str) -> _Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


async def look_up(names: Sequence[str], timeout_s: float) -> dict[str, list[str] | str]:
    """Each name's addresses from the system resolver, at most ``timeout_s`` each
    (all at once), or why its lookup failed. The routers' discovery and the KV
    relay's (:class:`~meshkit.lifecycle.kv_relay.RelayFleet`) look names up here."""
    loop = asyncio.get_running_loop()

    async def one(name: str) -> list[str] | str:
        try:
            async with asyncio.timeout(timeout_s):
                infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:
            return "timed out" if isinstance(exc, TimeoutError) else str(exc)
        return [str(info[4][0]) for info in infos]

    found = await asyncio.gather(*(one(n) for n in names))
    return dict(zip(names, found, strict=True))


class Discovery:
    """The sources of one Mesh's fleet, kept applied (see the module docstring).

    Built with the mesh: the static workers are already in the router's fleet;
    the workers file is read here, so a missing or bad one fails at start.
    """

    def __init__(self, router: Router, lifecycle: Lifecycle, config: MeshConfig) -> None:
        self.router = router
        self.lifecycle = lifecycle
        self.cfg = config.discovery
        self.interval_s = max(0.01, config.lifecycle.health_interval_s)
        self.sources = FleetSources(self.cfg.max_addresses)
        self.sources.configure(config.workers, config.dns_workers)
        #: ids the sources put in the fleet (the only ones they remove)
        self.managed: set[str] = {w.id for w in config.workers}
        #: managed ids copied from a sibling (adopt): kept until every name has
        #: answered here once, as a sibling keeps its last answer when a lookup fails
        self.adopted: set[str] = set()
        self.leaving: set[str] = set()
        self.file = config.workers_file
        self._stamp: _Stamp | None = None
        if self.file:
            self._stamp = _stamp(self.file)
            self.sources.set_file(*load_workers_file(self.file, self.cfg.max_file_bytes))
        self._failing: dict[str, str] = {}
        #: names with more addresses than discovery.max_addresses -> what was said
        self._cut: dict[str, str] = {}
        self._next_lookup = 0.0
        self._poke: asyncio.Event | None = None
        self.apply()

    @property
    def needed(self) -> bool:
        """Whether there is anything to look up or watch."""
        return bool(self.file or self.sources.names())

    # -- on the lifecycle loop ------------------------------------------------------------

    async def run(self) -> None:
        """Watch and look up until cancelled (the lifecycle thread stops)."""
        self._poke = asyncio.Event()
        while True:
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # pragma: no cover - a bug must not stop discovery
                log.exception("discovery round failed")
            timeout = self.cfg.watch_interval_s if self.needed else None
            with contextlib.suppress(TimeoutError):  # not wait_for: see Lifecycle
                async with asyncio.timeout(timeout):
                    await self._poke.wait()
            self._poke.clear()

    async def round(self) -> None:
        changed = self._check_file()
        now = asyncio.get_running_loop().time()
        if self.sources.names() and now >= self._next_lookup:
            self._next_lookup = now + self.interval_s
            await self._look_up(self.sources.names())
            changed = True
        if changed:
            self.apply()

    async def reconfigure(self, config: MeshConfig) -> FleetPlan:
        """Take ``config``'s sources; a new name is looked up before the plan, so
        its workers are not taken for gone.

        :raises ConfigError: the workers file does not load (nothing changed).
        """
        file_entries = None
        if config.workers_file:
            file_entries = load_workers_file(config.workers_file, self.cfg.max_file_bytes)
        self.sources.configure(config.workers, config.dns_workers)
        self.file = config.workers_file
        if file_entries is not None:
            assert self.file is not None
            self._stamp = _stamp(self.file)
            self.sources.set_file(*file_entries)
            self._failing.pop("file", None)
        else:
            self._stamp = None
            self.sources.set_file((), ())
        if self.sources.unresolved():
            await self._look_up(self.sources.unresolved())
        if self._poke is not None:
            self._poke.set()  # the watch interval may have changed from none to some
        return self.apply()

    async def adopt(self, worker_ids: Sequence[str]) -> None:
        """(the loop) Take ``worker_ids`` as put in the fleet by the sources: a
        restarted ``serve --processes`` child copied them from a sibling whose
        discovery did (:func:`~meshkit.server.peers.copy_fleet`). They are removed
        when the sources stop naming them, as the sibling removes them, but not
        before every ``dns://`` name has answered here once: until then the
        sibling's answer is the last one known (a failed lookup keeps it)."""
        ids = [wid for wid in worker_ids if self.router.get(wid) is not None]
        self.managed.update(ids)
        if self.sources.unresolved():
            self.adopted.update(ids)

    def _check_file(self) -> bool:
        if not self.file:
            return False
        stamp = _stamp(self.file)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            entries = load_workers_file(self.file, self.cfg.max_file_bytes)
        except ConfigError as exc:
            self._fail("file", "file", f"{exc}; keeping its last workers")
            return False
        self._recover("file", f"workers file {self.file} read again")
        self.sources.set_file(*entries)
        return True

    async def _look_up(self, names: tuple[str, ...]) -> None:
        for name, found in (await look_up(names, self.cfg.resolve_timeout_s)).items():
            if isinstance(found, str):
                message = f"dns://{name}: lookup failed ({found}); keeping its last workers"
                self._fail("dns:" + name, "dns", message)
                continue
            self._recover("dns:" + name, f"dns://{name} resolves again")
            self.sources.set_addresses(name, found)
            self._cut_addresses(name, len(set(found)))

    def _cut_addresses(self, name: str, found: int) -> None:
        """Say once (until it changes) that a name has more addresses than become
        workers: the ones past the bound get no traffic from any router."""
        most = self.cfg.max_addresses
        if found <= most:
            self._cut.pop(name, None)
            return
        message = (
            f"dns://{name} resolves to {found} addresses; discovery.max_addresses "
            f"makes workers of the first {most}"
        )
        if self._cut.get(name) != message:
            self._cut[name] = message
            log.warning("%s", message)

    def _fail(self, key: str, kind: str, message: str) -> None:
        self.router.metrics.discovery_failures.labels(kind).inc()
        if self._failing.get(key) != message:
            self._failing[key] = message
            log.warning("%s", message)

    def _recover(self, key: str, message: str) -> None:
        if self._failing.pop(key, None) is not None:
            log.info("%s", message)

    # -- applying (the loop thread, or the constructor before it starts) ------------------

    def apply(self) -> FleetPlan:
        """Take the fleet to what the sources say now."""
        router = self.router
        fleet = {w.id: w for w in router.workers}
        managed = self.managed
        if self.adopted:
            if self.sources.unresolved():
                managed = managed - self.adopted  # no answer of our own to go by yet
            else:
                self.adopted.clear()
        change = plan(fleet, managed, self.sources.desired(), leaving=self.leaving)
        if not change:
            return change
        for w in change.add:
            try:
                router.add(w)
            except ConfigError:  # added meanwhile (admin API): it is not ours
                continue
            self.managed.add(w.id)
        for w in change.update:
            router.replace(w)
        for wid in change.remove:
            self.leaving.add(wid)
            self.lifecycle.spawn(self._retire(wid))
        if change.add or change.update:
            self.lifecycle.kick()  # probes and KV subscribers follow at once
        log.info("fleet: %s", change.summary())
        return change

    async def _retire(self, worker_id: str) -> None:
        """Drain, then remove: its streams in flight end normally either way."""
        worker: Worker | None = self.router.get(worker_id)
        try:
            with contextlib.suppress(LifecycleError):  # removed meanwhile
                await self.lifecycle.adrain(worker_id)
            self.router.remove(worker_id)
        finally:
            self.leaving.discard(worker_id)
            self.managed.discard(worker_id)
        if worker is not None:
            log.info("worker %s removed", worker.url)
        self.apply()  # one that came back while it drained is added now
