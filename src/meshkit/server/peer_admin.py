"""
The admin API of many processes
===============================

With ``meshkit serve --processes N`` an admin request reaches one child. For the
gateway to behave as one, :class:`PeerAdmin` (in front of that child's
:class:`~meshkit.lifecycle.admin.AdminApp`) applies it here and on every sibling
(:mod:`meshkit.server.peers`); the siblings apply what they are sent locally and
fan nothing out again.

=================================  ==================================================
``GET /workers``                   this process's listing merged with the siblings'
                                   (:mod:`meshkit.server.merged_workers`), plus
                                   ``"processes": {"answered", "failed"}``
``POST /workers``                  added here; when that answers 2xx, the same body
                                   is sent to every sibling
``DELETE /workers/{id}``,          here and on every sibling at once (a drain stops
``POST /workers/{id}/drain``       placements in every process together, and the
                                   waits for their leases overlap)
``POST /workers/{id}/sleep``       the engine is put to sleep once, by this process,
                                   after every sibling agreed: each marks the worker
                                   asleep first, state only, and one that holds a
                                   lease on it vetoes (409, the others roll back);
                                   one that does not answer may hold one, and stops
                                   it too (503 ``process_unavailable``); one that
                                   does not know the worker holds none
``POST /workers/{id}/wake``        the engine is woken once, here; then every
                                   sibling marks it awake (state only)
=================================  ==================================================

A write's answer is this process's plus ``"processes": {"applied": <processes
that applied it, this one included>, "failed": [<sibling indexes>]}``; a
``"worker"`` row in it is merged like the listing. A write whose local answer is
not 2xx is answered as is and sent nowhere. Siblings are sent the path with the
worker's ``id`` (an index in the path means this process's listing), the query
string, the body and the ``Authorization`` header, so each checks the admin key
itself.

Sibling-only routes, answered on the private socket only (a peer request):

* ``GET /_peer/fleet`` — :func:`~meshkit.server.peers.fleet_spec` (carries API keys);
* ``POST /_peer/workers/{id}/asleep`` and ``.../awake`` — the state follows a sleep
  or a wake another process makes
  (:meth:`~meshkit.core.states.WorkerStates.follow_sleep`): ``{"changed",
  "worker"}``, 409 when this process must not let the engine sleep.

They take no admin key: the socket's directory (mode 0700) is their boundary, and
the admin request that leads to them was checked where it arrived.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qs, quote

from meshkit.core.lifecycle import LifecycleError
from meshkit.core.states import WorkerStates
from meshkit.core.workers import Worker
from meshkit.errors import ConfigError, RequestTooLarge
from meshkit.frontends.asgi_body import receive_body
from meshkit.lifecycle.admin import AdminApp, index_of, too_large
from meshkit.server.merged_workers import merge_row, merge_rows
from meshkit.server.peers import PeerReply, Peers, fleet_spec
from meshkit.types import Message, Receive, Scope, Send

if TYPE_CHECKING:
    from meshkit.lifecycle.controller import Undo
    from meshkit.mesh import Mesh

__all__ = ["PeerAdmin", "PeerSleepGate", "gate_lifecycle", "peer_route"]

#: A forwarded drain waits for the sibling's leases (``timeout_s``); this much more
#: covers its answer travelling back.
_MARGIN_S: Final = 5.0
#: State-only changes and listings: a sibling slower than this is counted down.
_ASK_S: Final = 5.0
_ACTIONS: Final = ("drain", "sleep", "wake")
_JSON: Final = b"application/json"


class _Answer:
    """A response held back to be merged: status, headers, and the body as JSON."""

    __slots__ = ("body", "headers", "obj", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        try:
            self.obj: Any = json.loads(body) if body else None
        except ValueError:
            self.obj = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and isinstance(self.obj, dict)


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "api_error", "code": code}}


async def _send(
    send: Send, status: int, obj: Any, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    hdrs = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"content-type")]
    hdrs += [(b"content-type", _JSON), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})


def _split(path: str) -> tuple[str, str | None]:
    """``/workers/{id}[/action]`` -> (id, action) (the admin app's own parse)."""
    rest = path[len("/workers/") :]
    for a in _ACTIONS:
        if rest.endswith("/" + a):
            return rest[: -len(a) - 1], a
    return rest, None


def _resolve(mesh: Mesh, ident: str) -> Worker | None:
    """The worker ``ident`` names here, as the admin app resolves it."""
    router = mesh.router
    i = index_of(ident)
    if i is not None:
        return router.workers[i] if i < len(router.workers) else None
    w = router.get(ident)
    if w is None:
        try:
            w = router.get(Worker(ident).id)
        except ConfigError:
            w = None
    return w


class PeerAdmin:
    """The admin API of a gateway of many processes (see the module docstring).

    :param admin: this process's admin app (it answers every local part).
    :param peers: the siblings.
    """

    def __init__(self, admin: AdminApp, peers: Peers) -> None:
        self.admin = admin
        self.mesh = admin.mesh
        self.peers = peers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.admin.authorized(scope):
            # Its 401, before any body is read or any sibling asked: in one place
            # for every verb, as the admin app of one process answers it.
            await self.admin(scope, receive, send)
            return
        method = scope.get("method", "GET")
        path = scope.get("path", "/")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path.rstrip("/") == "/workers":
            if method == "GET":
                await self._list(scope, send)
                return
            if method == "POST":
                await self._add(scope, receive, send)
                return
        elif path.startswith("/workers/") and method in ("POST", "DELETE"):
            ident, action = _split(path)
            if (method, action) in (("DELETE", None), ("POST", "drain")):
                await self._drain(scope, send, ident, action)
                return
            if (method, action) == ("POST", "sleep"):
                await self._sleep(scope, send, ident)
                return
            if (method, action) == ("POST", "wake"):
                await self._wake(scope, send)
                return
        await self.admin(scope, receive, send)  # an error: this process answers it

    # -- the parts ------------------------------------------------------------------

    async def _local(self, scope: Scope, body: bytes = b"") -> _Answer:
        """This process's admin answer, held back."""
        delivered = False
        start: Message = {}
        chunks: list[bytes] = []

        async def receive() -> Message:
            nonlocal delivered
            if delivered:
                return {"type": "http.disconnect"}
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.admin(scope, receive, send)
        headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", ())]
        return _Answer(int(start.get("status", 500)), headers, b"".join(chunks))

    async def _relay(self, send: Send, answer: _Answer) -> None:
        await send(
            {"type": "http.response.start", "status": answer.status, "headers": answer.headers}
        )
        await send({"type": "http.response.body", "body": answer.body})

    def _forwarded(
        self, scope: Scope, extra: Sequence[tuple[bytes, bytes]] = ()
    ) -> list[tuple[bytes, bytes]]:
        """The client's headers a sibling needs: its admin key, and ``extra``."""
        auth = [(k, v) for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        return [*auth[:1], *extra]

    def _query(self, scope: Scope) -> str:
        q = scope.get("query_string", b"")
        return "?" + q.decode("latin-1") if q else ""

    def _merge_worker(self, obj: dict[str, Any], replies: Sequence[PeerReply]) -> None:
        """Merge the siblings' ``worker`` rows into the local answer's."""
        row = obj.get("worker")
        if not isinstance(row, dict):
            return
        theirs = []
        for r in replies:
            other = r.json() if r.ok else None
            if isinstance(other, dict) and isinstance(other.get("worker"), dict):
                theirs.append((r.index, other["worker"]))
        obj["worker"] = merge_row(row, self.peers.index, theirs)

    async def _answer(self, send: Send, local: _Answer, replies: Sequence[PeerReply]) -> None:
        obj = dict(local.obj)
        self._merge_worker(obj, replies)
        ok = [r.index for r in replies if r.ok]
        obj["processes"] = {
            "applied": 1 + len(ok),
            "failed": [r.index for r in replies if not r.ok],
        }
        await _send(send, local.status, obj, local.headers)

    # -- the verbs ------------------------------------------------------------------

    async def _list(self, scope: Scope, send: Send) -> None:
        local = await self._local(scope)
        if not local.ok or not isinstance(local.obj.get("workers"), list):
            await self._relay(send, local)
            return
        replies = await self.peers.ask(
            "GET", "/workers" + self._query(scope), headers=self._forwarded(scope), timeout_s=_ASK_S
        )
        answered = []
        failed = []
        for r in replies:
            other = r.json() if r.status == 200 else None
            if isinstance(other, dict) and isinstance(other.get("workers"), list):
                answered.append((r.index, other["workers"]))
            else:
                failed.append(r.index)
        obj = dict(local.obj)
        obj["workers"] = merge_rows(local.obj["workers"], self.peers.index, answered)
        obj["processes"] = {"answered": 1 + len(answered), "failed": failed}
        await _send(send, local.status, obj, local.headers)

    async def _add(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.mesh.config.bounds.max_admin_body_bytes
        try:
            body = await receive_body(receive, limit)
        except RequestTooLarge:
            reply = too_large(limit)
            await _send(send, reply.status, reply.body, reply.headers)
            return
        if body is None:
            return  # the client left: nobody to answer
        local = await self._local(scope, body)
        if not local.ok:
            await self._relay(send, local)
            return
        replies = await self.peers.ask(
            "POST",
            "/workers",
            headers=self._forwarded(scope, [(b"content-type", _JSON)]),
            body=body,
            timeout_s=_ASK_S,
        )
        await self._answer(send, local, replies)

    async def _drain(self, scope: Scope, send: Send, ident: str, action: str | None) -> None:
        worker = _resolve(self.mesh, ident)
        wait = _wait_s(scope, self.mesh.config.lifecycle.drain_timeout_s)
        if worker is None or wait is None:
            await self._relay(send, await self._local(scope))  # its error
            return
        # Both at once: the local answer is 2xx once the key and the worker are
        # good (a drain that timed out answers 200 with drained false).
        path = f"/workers/{quote(worker.id, safe='')}" + (f"/{action}" if action else "")
        local, replies = await asyncio.gather(
            self._local(scope),
            self.peers.ask(
                scope["method"],
                path + self._query(scope),
                headers=self._forwarded(scope),
                timeout_s=wait + _MARGIN_S,
            ),
        )
        if not local.ok:
            await self._relay(send, local)
            return
        await self._answer(send, local, replies)

    async def _follow(
        self, worker: Worker, asleep: bool, among: Sequence[int] | None = None
    ) -> list[PeerReply]:
        return await follow(self.peers, worker, asleep, among)

    async def _sleep(self, scope: Scope, send: Send, ident: str) -> None:
        worker = _resolve(self.mesh, ident)
        if worker is None:
            await self._relay(send, await self._local(scope))  # its 404
            return
        try:
            self.mesh.router.do(WorkerStates.check_sleep, worker.id)
        except LifecycleError:
            await self._relay(send, await self._local(scope))  # its 409
            return
        # Every sibling first, state only: one with a lease must be able to say no
        # before the engine is asleep under its request.
        agreed = await self._follow(worker, True)
        changed = [r.index for r in agreed if r.ok and (r.json() or {}).get("changed") is True]
        refused = [r.index for r in agreed if r.status == 409]
        # One that did not answer may hold a lease as well as not: a no, as for
        # an idle sleep (PeerSleepGate.agree).
        unasked = [r.index for r in agreed if not _no_lease(r) and r.status != 409]
        if refused or unasked:
            await self._follow(worker, False, changed)
            if refused:
                status, code, why = 409, "invalid_state", "cannot let the worker sleep now"
            else:
                status, code = 503, "process_unavailable"
                why = "did not answer whether it holds a lease on the worker"
            who = ", ".join(str(i) for i in refused or unasked)
            obj = _error(code, f"process {who} {why}")
            obj["processes"] = {"applied": 0, "failed": [r.index for r in agreed if not r.ok]}
            await _send(send, status, obj)
            return
        local = await self._local(scope)
        if local.status == 504 and isinstance(local.obj, dict):
            # The engine is still being put to sleep here (the wait ran out, the
            # sleep goes on): the siblings stay asleep, or they would place
            # requests on a sleeping engine.
            await self._answer(send, local, agreed)
            return
        if not local.ok:
            await self._follow(worker, False, changed)
            await self._relay(send, local)
            return
        await self._answer(send, local, agreed)

    async def _wake(self, scope: Scope, send: Send) -> None:
        local = await self._local(scope)
        row = local.obj.get("worker") if local.ok else None
        worker = _resolve(self.mesh, str(row.get("url"))) if isinstance(row, dict) else None
        if worker is None:
            await self._relay(send, local)
            return
        await self._answer(send, local, await self._follow(worker, False))


async def follow(
    peers: Peers,
    worker: Worker,
    asleep: bool,
    among: Sequence[int] | None = None,
    idle_s: float = 0.0,
) -> list[PeerReply]:
    """Ask the siblings (``among``: only those) to mark ``worker`` asleep or awake,
    state only; going to sleep, one that used it within ``idle_s`` refuses (409)."""
    path = f"/_peer/workers/{quote(worker.id, safe='')}/{'asleep' if asleep else 'awake'}"
    if asleep and idle_s > 0:
        path += f"?idle_s={idle_s:g}"
    if among is None:
        return await peers.ask("POST", path, timeout_s=_ASK_S)
    return list(
        await asyncio.gather(*(peers.ask_one(i, "POST", path, timeout_s=_ASK_S) for i in among))
    )


class PeerSleepGate:
    """The :class:`~meshkit.lifecycle.controller.SleepGate` and
    :class:`~meshkit.lifecycle.controller.WakeGate` of one process of many.

    * An idle sleep goes ahead only when every sibling marked the worker asleep,
      none having used it within ``idle_s`` (a sibling that cannot be asked counts
      as a no).
    * A wake (a request found the worker asleep) is asked of process 0, which wakes
      engines for the whole gateway, so two processes never both call the engine;
      when process 0 cannot be asked, this process wakes it itself.

    The lifecycle runs on its own thread and loop; the siblings are asked on the
    server's loop (``bind``), where the peers' clients live. Unbound, it refuses.
    """

    def __init__(self, peers: Peers, wake_timeout_s: float = 60.0) -> None:
        self.peers = peers
        self.wake_timeout_s = wake_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def _on_server(self, coro: Any) -> Any:
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError("the sleep gate is not bound to the server's loop")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def agree(self, worker: Worker, idle_s: float) -> Undo | None:
        try:
            replies = await self._on_server(follow(self.peers, worker, True, idle_s=idle_s))
        except RuntimeError:
            return None
        changed = [r.index for r in replies if r.ok and (r.json() or {}).get("changed") is True]

        async def undo() -> None:
            # Only the siblings this agreement changed: one asleep before it stays so.
            if changed:
                await self._on_server(follow(self.peers, worker, False, changed))

        if all(_no_lease(r) for r in replies):
            return undo
        await undo()
        return None

    async def wake(self, worker: Worker) -> bool | None:
        path = f"/_peer/workers/{quote(worker.id, safe='')}/wake"
        ask = self.peers.ask_one(0, "POST", path, timeout_s=self.wake_timeout_s + _MARGIN_S)
        try:
            reply = await self._on_server(ask)
        except RuntimeError:
            return None
        obj = reply.json() if reply.status == 200 else None
        if not isinstance(obj, dict) or not isinstance(obj.get("ready"), bool):
            return None  # process 0 is down or does not know the worker: wake it here
        return bool(obj["ready"])


def _no_lease(reply: PeerReply) -> bool:
    """A sibling's yes to a sleep: it marked the worker asleep, or it does not know
    the worker (it missed an admin add while it was down), so it holds no lease on
    it and places nothing there."""
    if reply.ok:
        return True
    if reply.status != 404:
        return False
    obj = reply.json()
    error = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(error, dict) and error.get("code") == "unknown_worker"


def gate_lifecycle(mesh: Mesh, peers: Peers) -> PeerSleepGate:
    """Make ``mesh``'s lifecycle that of process ``peers.index`` of many (before it
    starts): process 0 decides idle sleeps and the others each have a veto, and
    process 0 wakes engines for all of them. Bind the answer to the server's loop."""
    gate = PeerSleepGate(peers, mesh.config.lifecycle.wake_timeout_s)
    mesh.lifecycle.idle_sleeps = peers.index == 0
    mesh.lifecycle.sleep_gate = gate
    if peers.index != 0:
        mesh.lifecycle.wake_gate = gate
    return gate


async def peer_wake(mesh: Mesh, scope: Scope) -> tuple[int, Any]:
    """``POST /_peer/workers/{id}/wake``: wake the engine for a sibling (once: a wake
    already under way is joined) and answer whether it is ready."""
    if scope["method"] != "POST":
        return 405, _error("method_not_allowed", "use POST")
    ident = scope["path"][len("/_peer/workers/") : -len("/wake")]
    worker = _resolve(mesh, ident)
    if worker is None:
        return 404, _error("unknown_worker", "no such worker")
    try:
        ready = await mesh.awake(worker)
    except LifecycleError as exc:
        return 409, _error("invalid_state", str(exc))
    return 200, {"ready": ready}


def _wait_s(scope: Scope, default: float) -> float | None:
    """``?timeout_s=`` (None when the admin app will refuse it)."""
    raw = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("timeout_s")
    if not raw:
        return default
    try:
        value = float(raw[-1])
    except ValueError:
        return None
    return value if value >= 0 else None


# -- what siblings ask ------------------------------------------------------------------


def peer_route(mesh: Mesh, scope: Scope) -> tuple[int, Any]:
    """A sibling's ``/_peer/...`` request: (status, JSON body)."""
    path = scope["path"]
    method = scope["method"]
    if path == "/_peer/fleet":
        if method != "GET":
            return 405, _error("method_not_allowed", "use GET")
        return 200, fleet_spec(mesh)
    if path.startswith("/_peer/workers/"):
        rest = path[len("/_peer/workers/") :]
        ident, _, verb = rest.rpartition("/")
        if verb in ("asleep", "awake"):
            if method != "POST":
                return 405, _error("method_not_allowed", "use POST")
            worker = _resolve(mesh, ident)
            if worker is None:
                return 404, _error("unknown_worker", "no such worker")
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            try:
                idle_s = max(0.0, float(query.get("idle_s", ["0"])[-1]))
            except ValueError:
                return 400, _error("invalid_request", "idle_s must be a number")
            try:
                changed = mesh.router.do(
                    WorkerStates.follow_sleep, worker.id, verb == "asleep", idle_s=idle_s
                )
            except LifecycleError as exc:
                return 409, _error("invalid_state", str(exc))
            found = mesh.router.describe(worker.id)
            return 200, {"changed": changed, "worker": found[0] if found else None}
    return 404, _error("unknown_endpoint", f"unknown endpoint: {method} {path[:200]}")
