"""
Sibling processes
=================

``meshkit serve --processes N`` runs N child processes, each a whole gateway (its
own :class:`~meshkit.Mesh`, :class:`~meshkit.server.app.ServeApp` and server) on one
shared listening socket. A client reaches whichever child the kernel picks, so the
children must answer as ONE gateway: each also serves its gateway on a private Unix
socket, and asks its siblings there what it cannot know alone (their metrics,
their load, their share of an admin verb).

* :class:`Peers` — where the siblings listen (``<run_dir>/p<i>.sock``) and
  :meth:`Peers.ask`, the same request to every sibling at once;
* :func:`peer_app` — what a child serves on its own socket: its gateway, with
  every request marked ``scope["meshkit.peer"] = True``. A client on the public
  socket can never set a scope key, so the mark is how the app tells a sibling's
  question (answered locally, never fanned out again) from a client's;
* :func:`fleet_spec` and :func:`copy_fleet` — a child that restarts builds its
  mesh from the configuration, which admin verbs may have changed since: it copies
  the fleet (workers added or removed, drains, sleeps) of the first sibling that
  answers.
  A worker the sibling's discovery put there (a ``dns://`` address, the workers
  file) stays discovery's in the copy: its own discovery removes it when the
  source drops it, as the sibling's does; one an admin added stays the admin's.

Security: the run directory is created by the supervisor with mode 0700, so only
the gateway's own user reaches the sockets. ``GET /_peer/fleet`` answers with the
workers' API keys (a copied worker needs its key) and exists only on those
sockets: from the public socket it is an unknown endpoint. Replies are bounded
(:data:`MAX_REPLY_BYTES`) and an error names its kind, never a body or a header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from meshkit.core.lifecycle import LifecycleError, State
from meshkit.core.states import WorkerStates
from meshkit.core.workers import Worker
from meshkit.errors import ConfigError
from meshkit.frontends.asgi import MeshMiddleware
from meshkit.server.supervisor import MAX_UNIX_PATH, RELAY_INDEX, RELAY_METRICS_SOCKET
from meshkit.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from meshkit.mesh import Mesh
    from meshkit.upstream.fast import FastUpstream

__all__ = [
    "MAX_REPLY_BYTES",
    "PEER_SCOPE_KEY",
    "PeerReply",
    "Peers",
    "copy_fleet",
    "fleet_spec",
    "peer_app",
]

#: The scope key :func:`peer_app` sets: the request came from a sibling.
PEER_SCOPE_KEY: Final = "meshkit.peer"
#: A sibling's reply is read up to this many bytes, then dropped as an error: a
#: ``/metrics`` text of a large fleet is a few MiB, and a scrape holds N of them.
MAX_REPLY_BYTES: Final = 16 * 1024 * 1024
#: the URL every question names: the socket decides where it goes
_ORIGIN: Final = "http://meshkit-peer"
#: copied as asleep: a copy that finds it waking joins that wake (through process 0)
_ASLEEP: Final = (State.SLEEPING.value, State.WAKING.value)


@dataclass(frozen=True, slots=True)
class PeerReply:
    """One sibling's answer; ``status`` None (and ``error`` set) when it gave none."""

    index: int
    status: int | None
    body: bytes
    error: str | None = None

    @property
    def ok(self) -> bool:
        """A 2xx answer."""
        return self.status is not None and 200 <= self.status < 300

    def json(self) -> Any:
        """The body as JSON; None when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class Peers:
    """The sibling processes of one gateway, seen from process ``index`` of ``count``.

    :param run_dir: the directory of the sockets (the supervisor's, mode 0700).
    :param index: this process's index, ``0 <= index < count``.
    :param count: the number of processes (``--processes``).
    :param relay: the gateway also runs a KV-event relay child, whose metrics
        :meth:`ask_one` of :data:`~meshkit.server.supervisor.RELAY_INDEX` reads.

    One keep-alive client per sibling, over its Unix socket, created at the first
    ask: the upstream layer's (:class:`~meshkit.upstream.fast.FastUpstream` with
    ``uds``), not a second HTTP client.
    """

    def __init__(self, run_dir: str, index: int, count: int, relay: bool = False) -> None:
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"process index {index} is not within 0..{count - 1}")
        self.run_dir = run_dir
        self.index = index
        self.count = count
        self.relay = relay
        if len(os.fsencode(self.path(count - 1))) > MAX_UNIX_PATH:
            raise ValueError(f"the run directory path is too long for a Unix socket: {run_dir}")
        self._upstreams: dict[int, FastUpstream] = {}

    def __repr__(self) -> str:
        return f"Peers({self.run_dir!r}, {self.index}, {self.count})"

    def path(self, i: int) -> str:
        """The Unix socket process ``i`` serves its gateway on (the relay child, its
        metrics)."""
        name = RELAY_METRICS_SOCKET if i == RELAY_INDEX else f"p{i}.sock"
        return os.path.join(self.run_dir, name)

    def others(self) -> list[int]:
        """Every process index but this one's."""
        return [i for i in range(self.count) if i != self.index]

    async def ask(
        self,
        method: str,
        path: str,
        *,
        headers: Sequence[tuple[bytes, bytes]] = (),
        body: bytes = b"",
        timeout_s: float = 5.0,
    ) -> list[PeerReply]:
        """The same request to every sibling at once, one reply each (index order).

        ``path`` carries the query string, percent-encoded. A sibling that is down
        (no socket, refused, too slow, a reply that is not HTTP or is over
        :data:`MAX_REPLY_BYTES`) gives a reply with ``status`` None; this never
        raises for that.
        """
        others = self.others()
        if not others:
            return []
        return list(
            await asyncio.gather(
                *(self.ask_one(i, method, path, headers, body, timeout_s) for i in others)
            )
        )

    async def ask_one(
        self,
        i: int,
        method: str,
        path: str,
        headers: Sequence[tuple[bytes, bytes]] = (),
        body: bytes = b"",
        timeout_s: float = 5.0,
    ) -> PeerReply:
        """:meth:`ask` of sibling ``i`` alone."""
        from meshkit.upstream.base import Call, UpstreamFailure

        request = Call(method, _ORIGIN + path, list(headers), body)
        try:
            async with asyncio.timeout(timeout_s):
                exchange = await self._upstream(i).asend(request)
                try:
                    data = await exchange.read(MAX_REPLY_BYTES + 1)
                finally:
                    await exchange.aclose()
        except TimeoutError:
            return PeerReply(i, None, b"", "timeout")
        except (UpstreamFailure, OSError) as exc:
            # The failure names the kind (connect: no socket or refused); no text.
            kind = exc.failure.value if isinstance(exc, UpstreamFailure) else "connect"
            return PeerReply(i, None, b"", f"unreachable ({kind})")
        if len(data) > MAX_REPLY_BYTES:
            return PeerReply(i, None, b"", "reply over MAX_REPLY_BYTES")
        return PeerReply(i, exchange.status, data)

    def _upstream(self, i: int) -> FastUpstream:
        """The client of sibling ``i``: meshkit's own (:mod:`meshkit.upstream.fast`)
        on its Unix socket. It keeps its connections for the loop that made them
        and starts new ones on another loop (a start-up step run before the
        server's loop)."""
        from meshkit.config import UpstreamConfig
        from meshkit.upstream.fast import FastUpstream

        upstream = self._upstreams.get(i)
        if upstream is None:
            # Each ask bounds the whole exchange; these only stop a stuck socket.
            config = UpstreamConfig(connect_timeout_s=5.0, read_timeout_s=60.0)
            upstream = self._upstreams[i] = FastUpstream(config, uds=self.path(i))
        return upstream

    async def aclose(self) -> None:
        """Close the connections."""
        upstreams, self._upstreams = self._upstreams, {}
        for upstream in upstreams.values():
            await upstream.aclose()


# -- what a child serves on its own socket --------------------------------------------


class _PeerScope:
    """An ASGI app whose requests all come from siblings (see :func:`peer_app`)."""

    __slots__ = ("app",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, PEER_SCOPE_KEY: True}
        await self.app(scope, receive, send)


def peer_app(app: Any) -> Any:
    """``app`` for the private socket: every HTTP scope gets ``"meshkit.peer": True``
    (a copy of the scope dict; the original is untouched).

    Given a gateway (a :class:`~meshkit.MeshMiddleware`), the answer is a gateway
    too, over the same mesh, whose inner app is the marked one: the built-in
    server, which routes inference itself and hands only the rest to
    ``gateway.app``, serves it as it serves the public one. It has its own upstream
    (closing one server's gateway leaves the other's pool alone); siblings never
    send it inference.
    """
    if isinstance(app, MeshMiddleware):
        return MeshMiddleware(_PeerScope(app.app), mesh=app.mesh)
    return _PeerScope(app)


# -- copying the fleet ----------------------------------------------------------------


def fleet_spec(mesh: Mesh) -> dict[str, Any]:
    """The workers ``mesh`` routes to, as ``GET /_peer/fleet`` answers them: what
    :class:`~meshkit.Worker` is built from (API keys included) and whether each is
    draining or asleep (with ``lifecycle.probe = false`` nothing else would tell a
    copy that an engine sleeps)."""
    states = {row["url"]: row["state"] for row in mesh.router.describe()}
    discovery = mesh.lifecycle.discovery
    managed = discovery.managed if discovery is not None else frozenset()
    workers = []
    for w in mesh.workers:
        tls = w.tls
        workers.append(
            {
                "url": w.url,
                "api_key": w.api_key,
                "labels": dict(w.labels),
                "tls": None
                if tls is None
                else {
                    "verify": tls.verify,
                    "ca_file": tls.ca_file,
                    "client_cert": tls.client_cert,
                    "client_key": tls.client_key,
                },
                "kv_events": w.kv_events,
                "kv_replay": w.kv_replay,
                "draining": states.get(w.url) == State.DRAINING.value,
                "asleep": states.get(w.url) in _ASLEEP,
                # put there by this process's discovery (not by an admin)
                "discovered": w.id in managed,
            }
        )
    return {"workers": workers}


def _worker_of(spec: Any) -> tuple[Worker, bool, bool] | None:
    """The worker an entry of :func:`fleet_spec` describes, and whether it drains
    and sleeps there (None: not one)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        return None
    tls = spec.get("tls") or {}
    labels = spec.get("labels") or {}
    if not isinstance(tls, dict) or not isinstance(labels, dict):
        return None
    try:
        worker = Worker(
            spec["url"],
            api_key=spec.get("api_key"),
            labels={str(k): str(v) for k, v in labels.items()},
            tls_verify=bool(tls.get("verify", True)),
            tls_ca_file=tls.get("ca_file"),
            tls_client_cert=tls.get("client_cert"),
            tls_client_key=tls.get("client_key"),
            kv_events=spec.get("kv_events"),
            kv_replay=spec.get("kv_replay"),
        )
    except (ConfigError, TypeError):
        return None
    return worker, spec.get("draining") is True, spec.get("asleep") is True


async def copy_fleet(peers: Peers, mesh: Mesh, *, timeout_s: float = 5.0) -> bool:
    """Make ``mesh``'s fleet the one of the first sibling (lowest index) that answers
    ``GET /_peer/fleet``: add the workers it has and ``mesh`` lacks, remove those it
    lacks (no drain: a starting process holds no lease), mark asleep (state only)
    those asleep there, drain those it drains. A worker both have keeps this
    process's own settings.

    :returns: False when no sibling answered (``mesh`` is left as it is).
    """
    for reply in await peers.ask("GET", "/_peer/fleet", timeout_s=timeout_s):
        obj = reply.json() if reply.status == 200 else None
        if isinstance(obj, dict) and isinstance(obj.get("workers"), list):
            break
    else:
        return False
    wanted: dict[str, tuple[Worker, bool, bool]] = {}
    discovered: list[str] = []
    for spec in obj["workers"]:
        found = _worker_of(spec)
        if found is not None:
            wanted[found[0].id] = found
            if spec.get("discovered") is True:
                discovered.append(found[0].id)
    for w in mesh.workers:
        if w.id not in wanted:
            await mesh.aremove_worker(w, timeout_s=0)
    for wid, (worker, draining, asleep) in wanted.items():
        if mesh.router.get(wid) is None:
            mesh.add_worker(worker)
        if asleep:
            # Taken for ready (or not probed yet, which is routable), it would be
            # sent requests while its engine sleeps. A worker with no sleep mode
            # here is refused and left as it is.
            with contextlib.suppress(LifecycleError):
                mesh.router.do(WorkerStates.follow_sleep, wid, True)
        if draining:
            await mesh.adrain(wid, timeout_s=0)
    discovery = mesh.lifecycle.discovery
    if discovered and discovery is not None:
        # On the lifecycle loop, where discovery plans: nothing else touches its set.
        await asyncio.wrap_future(mesh.lifecycle.submit(lambda: discovery.adopt(discovered)))
    return True
