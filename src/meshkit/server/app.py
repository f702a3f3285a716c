"""
The gateway's own app
=====================

``meshkit serve`` is :class:`~meshkit.MeshMiddleware` around :class:`ServeApp`, a
pure ASGI app that answers only what a gateway needs besides inference:

================  ============================================================
``/health``       200 ``{"status": "ok", ...}``; 503 when the prepare pool is
                  unhealthy or no worker is configured
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

Security: bodies are never read, and no response carries a credential, a
prompt or an exception text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from meshkit.core.endpoints import shape_for_path
from meshkit.errors import MeshError, MethodNotAllowed, UnknownEndpoint
from meshkit.frontends.asgi import MeshMiddleware
from meshkit.lifecycle.admin import AdminApp, lifespan
from meshkit.mesh import Mesh
from meshkit.types import Receive, Scope, Send

__all__ = ["METRICS_CONTENT_TYPE", "ServeApp", "build_gateway"]

Reply = tuple[int, bytes, bytes]  # status, content type, body

#: The classic Prometheus text format (what ``generate_latest`` writes).
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_JSON = b"application/json"


def _json(status: int, obj: Any) -> Reply:
    return status, _JSON, json.dumps(obj, separators=(",", ":")).encode()


class ServeApp:
    """Health, metrics and admin routes for one :class:`~meshkit.Mesh`.

    :param mesh: the mesh whose state the routes report.

    ``draining`` turns True when shutdown begins, so load balancers stop sending
    new requests (``/readiness`` answers 503) while streams finish.
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.draining = False
        self._routes: dict[str, Callable[[Scope], Reply]] = {
            "/health": self._health,
            "/liveness": self._liveness,
            "/readiness": self._readiness,
            "/metrics": self._metrics,
        }
        # The lifecycle's admin surface: list, add, remove, drain, sleep, wake.
        self._admin = AdminApp(mesh)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not ours; closing the scope refuses the handshake
        path = scope["path"]
        if path == "/workers" or path.startswith("/workers/"):
            await self._admin(scope, receive, send)
            return
        route = self._routes.get(path)
        try:
            if route is None:
                raise UnknownEndpoint(f"unknown endpoint: {scope['method']} {path[:200]}")
            if scope["method"] not in ("GET", "HEAD"):
                raise MethodNotAllowed(f"{path} is read-only", allowed=("GET", "HEAD"))
            status, ctype, body = route(scope)
            headers = [(b"content-type", ctype)]
        except MeshError as exc:
            status, headers, body = exc.status, exc.headers(), exc.body(shape_for_path(path))
        headers.append((b"content-length", str(len(body)).encode()))
        # Probes poll these routes: a cached answer would hide a state change.
        headers.append((b"cache-control", b"no-store"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )

    # -- routes -------------------------------------------------------------------

    def _health(self, scope: Scope) -> Reply:
        h = self.mesh.health()
        ok = h["pool"] == "ok" and h["workers"] > 0
        return _json(200 if ok else 503, {"status": "ok" if ok else "unavailable", **h})

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


def build_gateway(mesh: Mesh) -> MeshMiddleware:
    """The standalone gateway: ``MeshMiddleware(ServeApp(mesh), mesh=mesh)``.

    The :class:`ServeApp` is ``gateway.app``.
    """
    return MeshMiddleware(ServeApp(mesh), mesh=mesh)
