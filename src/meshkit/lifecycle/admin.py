"""
The admin API
=============

A pure ASGI app over one :class:`~meshkit.Mesh`, for the standalone gateway to
mount (or any ASGI server to serve on an internal port)::

    admin = AdminApp(mesh)                       # admin_key from MeshConfig
    app = Starlette(routes=[Mount("/admin", app=admin)])

=========================================  =====================================
``GET /workers``                           the fleet: state, load, leases,
                                           breaker, activity (never API keys)
``POST /workers``                          add one: ``{"url", "api_key"?,
                                           "labels"?, "kv_events"?,
                                           "kv_replay"?}`` → 201
``DELETE /workers/{id}``                   drain, then remove → 200
``POST /workers/{id}/drain``               stop placements, wait for leases
``POST /workers/{id}/sleep``               ``?level=N``; 409 while it holds a
                                           lease or is not ready
``POST /workers/{id}/wake``                wake and wait until ready
=========================================  =====================================

``{id}`` is the worker's URL, percent-encoded as one path segment (the ``id``
field of ``GET /workers``, e.g. ``http%3A%2F%2F10.0.0.5%3A8000``), or its
``index`` in that listing (convenient, but it shifts when workers are removed).
Drain, delete and wake take ``?timeout_s=`` (defaults: ``lifecycle.drain_timeout_s``,
``lifecycle.wake_timeout_s``).

Errors are JSON ``{"error": {"message", "type", "code"}}``: 400 bad input, 401
without the admin key, 404 unknown worker or path, 405, 409 a state that does not
allow it, 502 a worker that did not answer, 504 a wake or sleep that did not
end within ``timeout_s`` (a sleep goes on).

Security: when an admin key is configured (``MeshConfig.admin_key`` or the
``admin_key`` argument) every request needs ``Authorization: Bearer <key>``
(compared in constant time), else 401. Without one the app is open: serve it on a
private interface only. Responses never carry a worker's API key, and a request
body is read only on ``POST /workers`` (bounded by ``bounds.max_admin_body_bytes``).
"""

from __future__ import annotations

import hmac
import json
import math
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from meshkit.config import ADMIN_WORKER_KEYS, worker_config
from meshkit.core.lifecycle import LifecycleError
from meshkit.core.workers import Worker
from meshkit.errors import ConfigError, RequestTooLarge
from meshkit.frontends.asgi_body import receive_body
from meshkit.types import Receive, Scope, Send

if TYPE_CHECKING:
    from meshkit.mesh import Mesh

__all__ = ["AdminApp", "index_of", "lifespan"]


_ACTIONS = ("drain", "sleep", "wake")


class _Reply(Exception):
    """Ends a request with a JSON answer (raised from anywhere in a handler)."""

    def __init__(self, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or []


def _error(status: int, code: str, message: str) -> _Reply:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
    body = {"error": {"message": message, "type": kind.get(status, "api_error"), "code": code}}
    return _Reply(status, body)


class AdminApp:
    """Worker administration for one mesh (see the module docstring).

    :param mesh: the :class:`~meshkit.Mesh` to administer.
    :param admin_key: the bearer key required; ``MeshConfig.admin_key`` when
        omitted; no key configured means no check.
    """

    def __init__(self, mesh: Mesh, admin_key: str | None = None) -> None:
        self.mesh = mesh
        key = admin_key if admin_key is not None else mesh.config.admin_key
        self._expected = ("Bearer " + key).encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        # A gateway that has not routed a request yet has not started probing;
        # what the admin lists and does needs the probes (a no-op once started).
        self.mesh.start_lifecycle()
        try:
            if not self.authorized(scope):
                reply = _error(401, "unauthorized", "admin key required")
                reply.headers.append((b"www-authenticate", b"Bearer"))
                raise reply
            await self._dispatch(scope, receive)
        except _Reply as r:
            await _send(send, r.status, r.body, r.headers)

    def authorized(self, scope: Scope) -> bool:
        """Whether ``scope`` carries the admin key (always, when none is set)."""
        if self._expected is None:
            return True
        for k, v in scope.get("headers", ()):
            if k.lower() == b"authorization":
                return hmac.compare_digest(v, self._expected)
        return False

    async def _dispatch(self, scope: Scope, receive: Receive) -> None:
        path = scope.get("path", "/")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        method = scope.get("method", "GET")
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if path.rstrip("/") == "/workers":
            if method == "GET":
                raise _Reply(200, {"workers": self._list()})
            if method == "POST":
                raise _Reply(201, {"worker": await self._add(receive)})
            raise _error(405, "method_not_allowed", "use GET or POST")
        if not path.startswith("/workers/"):
            raise _error(404, "not_found", "no such admin path")
        # The path is percent-decoded already: a quoted worker URL is the URL again.
        rest = path[len("/workers/") :]
        action = None
        for a in _ACTIONS:
            if rest.endswith("/" + a):
                action, rest = a, rest[: -len(a) - 1]
                break
        worker = self._worker(rest)
        timeout = _float(query, "timeout_s")
        if action is None:
            if method != "DELETE":
                raise _error(405, "method_not_allowed", "use DELETE")
            drained = await self.mesh.adrain(worker, timeout_s=timeout)
            await self.mesh.aremove_worker(worker, timeout_s=0)
            raise _Reply(200, {"removed": True, "drained": drained})
        if method != "POST":
            raise _error(405, "method_not_allowed", "use POST")
        try:
            if action == "drain":
                drained = await self.mesh.adrain(worker, timeout_s=timeout)
                raise _Reply(200, {"drained": drained, "worker": self._one(worker)})
            if action == "sleep":
                level = _int(query, "level")
                try:
                    slept = await self.mesh.asleep(worker, level=level, timeout_s=timeout)
                except TimeoutError:
                    # The sleep goes on (it is not abandoned half way): say so.
                    raise _error(
                        504, "sleep_timeout", "the worker is still being put to sleep"
                    ) from None
                if not slept:
                    raise _error(502, "sleep_failed", "the worker did not go to sleep")
                raise _Reply(200, {"slept": True, "worker": self._one(worker)})
            ready = await self.mesh.awake(worker, timeout_s=timeout)
            raise _Reply(200 if ready else 504, {"ready": ready, "worker": self._one(worker)})
        except LifecycleError as exc:
            raise _error(409, "invalid_state", str(exc)) from None

    # -- helpers --------------------------------------------------------------------------

    def _list(self) -> list[dict[str, Any]]:
        return self.mesh.router.describe()

    def _one(self, worker: Worker) -> dict[str, Any] | None:
        found = self.mesh.router.describe(worker.id)
        return found[0] if found else None

    def _worker(self, ident: str) -> Worker:
        router = self.mesh.router
        workers = router.workers
        i = index_of(ident)
        if i is not None:
            if i < len(workers):
                return workers[i]
        else:
            w = router.get(ident)
            if w is None:
                try:
                    w = router.get(Worker(ident).id)  # e.g. a trailing slash
                except ConfigError:
                    w = None
            if w is not None:
                return w
        raise _error(404, "unknown_worker", "no such worker")

    async def _add(self, receive: Receive) -> dict[str, Any]:
        raw = await _read_body(receive, self.mesh.config.bounds.max_admin_body_bytes)
        try:
            obj = json.loads(raw)
        except ValueError:
            raise _error(400, "invalid_json", "the body is not JSON") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("url"), str):
            raise _error(400, "invalid_worker", 'the body must be {"url": ..., ...}')
        unknown = set(obj) - ADMIN_WORKER_KEYS
        if unknown:
            raise _error(400, "invalid_worker", f"unknown keys: {sorted(unknown)}")
        try:
            # Checked as a [[workers]] table is: one set of rules for both.
            table = {k: v for k, v in obj.items() if v is not None}
            worker = worker_config(table, source="POST /workers").build()
        except ConfigError as exc:
            # ConfigError messages name the key and the URL, never the api_key.
            raise _error(400, "invalid_worker", str(exc)) from None
        if not isinstance(worker, Worker):
            raise _error(
                400, "invalid_worker", "dns:// entries come from the configuration, not an admin"
            )
        if self.mesh.router.get(worker.id) is not None:
            raise _error(409, "duplicate_worker", "a worker with this URL exists")
        try:
            self.mesh.add_worker(worker)
        except ConfigError as exc:
            raise _error(409, "duplicate_worker", str(exc)) from None
        one = self._one(worker)
        assert one is not None
        return one


def index_of(ident: str) -> int | None:
    """``ident`` as an index into the listing, None when it is not one (then it is
    a worker id). ASCII digits only: ``"²".isdigit()`` is True but ``int`` refuses
    it, and ``int`` refuses more than 4300 digits too."""
    if ident.isascii() and ident.isdigit() and len(ident) <= 18:
        return int(ident)
    return None


def _float(query: dict[str, list[str]], name: str) -> float | None:
    raw = query.get(name)
    if not raw:
        return None
    try:
        value = float(raw[-1])
    except ValueError:
        raise _error(400, "invalid_query", f"{name} must be a number") from None
    if not 0 <= value < math.inf:  # every wait is bounded: inf and nan are refused
        raise _error(400, "invalid_query", f"{name} must be a finite number >= 0")
    return value


def _int(query: dict[str, list[str]], name: str) -> int | None:
    raw = query.get(name)
    if not raw:
        return None
    try:
        return int(raw[-1])
    except ValueError:
        raise _error(400, "invalid_query", f"{name} must be an integer") from None


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The body, refused (413) past ``limit`` bytes (``bounds.max_admin_body_bytes``)."""
    try:
        body = await receive_body(receive, limit)
    except RequestTooLarge:
        raise too_large(limit) from None
    if body is None:
        raise _error(400, "disconnected", "the client left")
    return body


def too_large(limit: int) -> _Reply:
    """The admin app's answer to a body over ``bounds.max_admin_body_bytes``."""
    return _error(413, "too_large", f"the body is over bounds.max_admin_body_bytes ({limit} bytes)")


async def _send(send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + headers})
    await send({"type": "http.response.body", "body": data})


async def lifespan(receive: Receive, send: Send) -> None:
    """An app's side of the ASGI lifespan protocol, for apps with nothing to set up
    (a ``MeshMiddleware`` around one closes its upstream when shutdown passes)."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
