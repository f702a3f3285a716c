"""
The gateway's own app
=====================

``meshkit serve`` is :class:`~meshkit.MeshMiddleware` around :class:`ServeApp`, a
pure ASGI app that answers only what a gateway needs besides inference:

================  ============================================================
``/health``       200 ``{"status": "ok", ..., "build": "compiled"}``; 503 when the
                  prepare pool is unhealthy or no worker is configured
``/liveness``     200 unless the prepare pool failed (restarting is the fix)
``/readiness``    200 only when the pool is up, a probe has found a worker
                  healthy (probing starts with the gateway) and the gateway is
                  not draining
``/metrics``      Prometheus text of ``mesh.metrics.registry`` (404 when
                  ``[metrics] enabled = false``)
``/workers``      admin (:class:`~meshkit.lifecycle.admin.AdminApp`): list, add,
                  remove, drain, sleep, wake (never keys), behind
                  ``Authorization: Bearer <admin_key>`` when configured
================  ============================================================

Everything else is a 404 ``unknown_endpoint`` in the error shape of the API the
path belongs to (a 405 ``method_not_allowed`` for a write to a read-only route):
inference paths never reach this app, the middleware routes them first.

One process of many (``meshkit serve --processes N``, ``peers`` given): the
processes answer as one gateway. ``/metrics`` merges every process's text
(:mod:`meshkit.server.merged_metrics`), ``/health`` adds ``process`` (the index of
the one answering), ``processes``, ``processes_up`` (this one, and the siblings
whose ``/liveness`` answered 200) and, on the built-in server, ``connections`` (the
client connections each process holds, ``null`` for one not accepting), and
the admin routes list and apply across the processes
(:mod:`meshkit.server.peer_admin`). A sibling's own request (marked by
:func:`~meshkit.server.peers.peer_app`) is answered by this process alone, and only
it reaches the ``/_peer/...`` routes; ``/liveness`` and ``/readiness`` are always
this process's.

Security: bodies are never read (but by the admin routes, bounded), and no
response carries a credential, a prompt or an exception text. The one exception,
``GET /_peer/fleet`` (the workers' API keys, for a restarted sibling), exists only
for a sibling's request, which comes only over the private socket in the
supervisor's mode-0700 run directory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

from meshkit import build
from meshkit.core.endpoints import shape_for_path
from meshkit.errors import MeshError, MethodNotAllowed, UnknownEndpoint
from meshkit.frontends.asgi import MeshMiddleware
from meshkit.lifecycle.admin import AdminApp, lifespan
from meshkit.mesh import Mesh
from meshkit.server.peers import PEER_SCOPE_KEY
from meshkit.server.supervisor import RELAY_INDEX
from meshkit.types import Receive, Scope, Send

if TYPE_CHECKING:
    from meshkit.server.accept import Shares
    from meshkit.server.peers import Peers

__all__ = ["METRICS_CONTENT_TYPE", "ServeApp", "build_gateway"]

Reply = tuple[int, bytes, bytes]  # status, content type, body

#: The classic Prometheus text format (what ``generate_latest`` writes).
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_JSON = b"application/json"
#: which build answers (``meshkit.build()``), in /health
_BUILD = build()
#: ``/health`` asks the siblings' ``/liveness`` for at most this long: a health
#: check must answer fast, and a sibling this slow is counted down.
_LIVENESS_ASK_S: Final = 1.0


def _json(status: int, obj: Any) -> Reply:
    return status, _JSON, json.dumps(obj, separators=(",", ":")).encode()


class ServeApp:
    """Health, metrics and admin routes for one :class:`~meshkit.Mesh`.

    :param mesh: the mesh whose state the routes report.
    :param peers: the sibling processes, when this is one process of many (see
        the module docstring); None: the only one.

    ``draining`` turns True when shutdown begins, so load balancers stop sending
    new requests (``/readiness`` answers 503) while streams finish.
    """

    def __init__(self, mesh: Mesh, peers: Peers | None = None) -> None:
        self.mesh = mesh
        self.peers = peers
        self.draining = False
        #: the connection counts the processes share (the built-in server's children)
        self.shares: Shares | None = None
        self._routes: dict[str, Callable[[Scope], Reply]] = {
            "/health": self._health,
            "/liveness": self._liveness,
            "/readiness": self._readiness,
            "/metrics": self._metrics,
        }
        #: the routes that speak for every process (a client's request, peers given)
        self._fleet_routes: dict[str, Callable[[Scope], Awaitable[Reply]]] = {
            "/health": self._fleet_health,
            "/metrics": self._fleet_metrics,
        }
        # The lifecycle's admin surface: list, add, remove, drain, sleep, wake.
        self._admin = AdminApp(mesh)
        self._peer_admin: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None
        if peers is not None:
            from meshkit.server.peer_admin import PeerAdmin

            self._peer_admin = PeerAdmin(self._admin, peers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not ours; closing the scope refuses the handshake
        path = scope["path"]
        # Set only by peer_app, on the private socket: a client cannot forge it.
        peer = scope.get(PEER_SCOPE_KEY) is True
        if path == "/workers" or path.startswith("/workers/"):
            if self._peer_admin is not None and not peer:
                await self._peer_admin(scope, receive, send)
            else:
                await self._admin(scope, receive, send)
            return
        if peer and path.startswith("/_peer/"):
            from meshkit.server.peer_admin import peer_route, peer_wake

            if path.startswith("/_peer/workers/") and path.endswith("/wake"):
                code, obj = await peer_wake(self.mesh, scope)
            else:
                code, obj = peer_route(self.mesh, scope)
            status, ctype, body = _json(code, obj)
            await _whole(send, scope, status, [(b"content-type", ctype)], body)
            return
        route = self._routes.get(path)
        fleet = self._fleet_routes.get(path) if self.peers is not None and not peer else None
        try:
            if route is None:
                raise UnknownEndpoint(f"unknown endpoint: {scope['method']} {path[:200]}")
            if scope["method"] not in ("GET", "HEAD"):
                raise MethodNotAllowed(f"{path} is read-only", allowed=("GET", "HEAD"))
            status, ctype, body = await fleet(scope) if fleet is not None else route(scope)
            headers = [(b"content-type", ctype)]
        except MeshError as exc:
            status, headers, body = exc.status, exc.headers(), exc.body(shape_for_path(path))
        await _whole(send, scope, status, headers, body)

    # -- routes -------------------------------------------------------------------

    def _health_state(self) -> tuple[int, dict[str, Any]]:
        h = self.mesh.health()
        ok = h["pool"] == "ok" and h["workers"] > 0
        status = "ok" if ok else "unavailable"
        return 200 if ok else 503, {"status": status, **h, "build": _BUILD}

    def _health(self, scope: Scope) -> Reply:
        return _json(*self._health_state())

    def _liveness(self, scope: Scope) -> Reply:
        alive = self.mesh.health()["pool"] != "failed"
        return _json(200 if alive else 503, {"status": "ok" if alive else "failed"})

    def _readiness(self, scope: Scope) -> Reply:
        h = self.mesh.health()
        if self.draining:
            return _json(503, {"status": "draining"})
        ready = h["pool"] == "ok" and h["verified_workers"] > 0
        return _json(200 if ready else 503, {"status": "ready" if ready else "not ready"})

    def _metrics(self, scope: Scope) -> Reply:
        if not self.mesh.config.metrics.enabled:
            raise UnknownEndpoint("metrics are disabled ([metrics] enabled = false)")
        return 200, METRICS_CONTENT_TYPE, self.mesh.metrics.render()

    # -- the same routes, for every process --------------------------------------------

    async def _fleet_health(self, scope: Scope) -> Reply:
        assert self.peers is not None
        status, obj = self._health_state()
        replies = await self.peers.ask("GET", "/liveness", timeout_s=_LIVENESS_ASK_S)
        obj["process"] = self.peers.index  # which one answered
        obj["processes"] = self.peers.count
        obj["processes_up"] = 1 + sum(1 for r in replies if r.status == 200)
        if self.shares is not None:
            # null: that process is not accepting (starting, restarting or stopping)
            obj["connections"] = [n if n >= 0 else None for n in self.shares.held()]
        return _json(status, obj)

    async def _fleet_metrics(self, scope: Scope) -> Reply:
        assert self.peers is not None
        from meshkit.server.merged_metrics import merge_metrics

        _, ctype, local = self._metrics(scope)  # 404 when disabled: for every process
        peers = self.peers
        ask = peers.ask("GET", "/metrics")
        if peers.relay:  # the KV-event relay child's counts too, at the same time
            of_relay = peers.ask_one(RELAY_INDEX, "GET", "/metrics")
            siblings, relay = await asyncio.gather(ask, of_relay)
            replies = [*siblings, relay]
        else:
            replies = await ask
        texts = [(peers.index, local)]
        texts += [(r.index, r.body) for r in replies if r.status == 200]
        shares = self.shares
        held, handed = (None, None) if shares is None else (shares.held(), shares.handed())
        return 200, ctype, merge_metrics(texts, peers.count, held, handed, relay=peers.relay)


async def _whole(
    send: Send, scope: Scope, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    # Probes poll these routes: a cached answer would hide a state change.
    headers.append((b"cache-control", b"no-store"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


def build_gateway(mesh: Mesh, peers: Peers | None = None) -> MeshMiddleware:
    """The standalone gateway: ``MeshMiddleware(ServeApp(mesh, peers), mesh=mesh)``.

    The :class:`ServeApp` is ``gateway.app``.

    :param peers: the sibling processes (``meshkit serve --processes``); serve
        :func:`~meshkit.server.peers.peer_app` of the gateway on
        ``peers.path(peers.index)`` so that they can ask this one.
    """
    return MeshMiddleware(ServeApp(mesh, peers), mesh=mesh)
