"""Helpers for the reliability suite: profiles, a request recorder on mock workers,
client-side faults (leaving at chosen points) in every mode, outcome checks and the
settle invariants.

Profiles: ``MESHKIT_PROFILE=full`` runs the big sizes; anything else is the CI
profile. ``MESHKIT_SEED`` changes the seed; ``MESHKIT_REPORT_DIR`` (a directory)
makes every test write its figures there as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx2

from harness import SERVER_MODES, Mode, wait_until
from meshkit import Mesh
from meshkit.mock import MockWorkerThread

PROFILE = os.environ.get("MESHKIT_PROFILE", "ci").strip().lower() or "ci"
FULL = PROFILE == "full"
SEED = int(os.environ.get("MESHKIT_SEED", "20261130"))


def size(ci: int, full: int) -> int:
    """The CI or the full size of something, by profile."""
    return full if FULL else ci


def report(name: str, figures: dict[str, Any]) -> None:
    """Write ``figures`` to ``$MESHKIT_REPORT_DIR/<name>.json`` (when set)."""
    where = os.environ.get("MESHKIT_REPORT_DIR")
    if not where:
        return
    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    payload = {"profile": PROFILE, "seed": SEED, **figures}
    (path / f"{name}.json").write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))


# -- what the workers saw -------------------------------------------------------------


class Recorder:
    """Wraps mock workers' request handling: every request, its path and headers.

    The mock's own stats only keep the last API request; this keeps all of them
    (in the workers' loop threads, under a lock), keyed by the ``x-test-id``
    header the tests put on their requests.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_id: Counter[str] = Counter()
        self.by_worker: Counter[str] = Counter()
        #: (worker name, method, path, query, headers) of every request
        self.requests: list[tuple[str, str, str, str, list[tuple[str, str]]]] = []

    def attach(self, *mocks: MockWorkerThread) -> None:
        for mock in mocks:
            app = mock.worker.app
            name = mock.worker.config.name
            inner = app.handle

            def handle(req: Any, _inner: Any = inner, _name: str = name) -> Any:
                tid = req.header(b"x-test-id")
                headers = [
                    (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in req.headers
                ]
                with self._lock:
                    if tid is not None:
                        self.by_id[tid.decode("latin-1")] += 1
                    self.by_worker[_name] += 1
                    self.requests.append(
                        (
                            _name,
                            req.method.decode("latin-1"),
                            req.path.decode("latin-1"),
                            req.query.decode("latin-1"),
                            headers,
                        )
                    )
                return _inner(req)

            app.handle = handle  # type: ignore[method-assign]

    def seen(self, tid: str) -> int:
        with self._lock:
            return self.by_id[tid]

    def snapshot(self) -> list[tuple[str, str, str, str, list[tuple[str, str]]]]:
        with self._lock:
            return list(self.requests)


# -- responses ------------------------------------------------------------------------


def events_of(body: bytes) -> list[bytes]:
    return [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]


def is_openai_error(obj: Any) -> bool:
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys()


def is_anthropic_error(obj: Any) -> bool:
    if not isinstance(obj, dict) or obj.get("type") != "error":
        return False
    err = obj.get("error")
    return isinstance(err, dict) and {"type", "message"} <= err.keys()


def error_code(obj: Any) -> str | None:
    """The code (OpenAI shape) or type (Anthropic shape) of an error body."""
    if is_anthropic_error(obj):
        return str(obj["error"]["type"])
    if is_openai_error(obj):
        code = obj["error"]["code"]
        return None if code is None else str(code)
    return None


def json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def stream_terminal(api: str, body: bytes) -> str:
    """``complete`` (terminal event last), ``error`` (an error event last) or ``cut``."""
    events = events_of(body)
    if not events:
        return "cut"
    last = events[-1].strip()
    if api == "messages":
        if last.startswith(b"event: message_stop"):
            return "complete"
        if last.startswith(b"event: error"):
            data = last.split(b"data: ", 1)[-1]
            return "error" if is_anthropic_error(json_or_none(data)) else "cut"
        return "cut"
    if last == b"data: [DONE]":
        return "complete"
    if last.startswith(b"data: "):
        return "error" if is_openai_error(json_or_none(last[6:])) else "cut"
    return "cut"


def body_complete(api: str, obj: Any) -> bool:
    """A whole non-stream answer of ``api``."""
    if not isinstance(obj, dict):
        return False
    if api == "messages":
        return obj.get("type") == "message" and isinstance(obj.get("content"), list)
    return isinstance(obj.get("choices"), list) and bool(obj["choices"])


# -- leaving at chosen points -----------------------------------------------------------


class ClientGone(Exception):
    """Raised by a client's own body generator: the client gave up while sending."""


def _host_port(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def raw_request(
    base_url: str, path: str, headers: dict[str, str], body: bytes, *, send: int | None = None
) -> socket.socket:
    """Open a connection and send a POST head plus ``send`` bytes of ``body``
    (all by default); the caller closes the socket to leave."""
    host, port = _host_port(base_url)
    sock = socket.create_connection((host, port), timeout=30)
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    sock.sendall(head + body[: len(body) if send is None else send])
    return sock


def leave(sock: socket.socket) -> None:
    """Close abruptly (RST), the way a killed client goes."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def leave_before_body(mode: Mode, path: str, headers: dict[str, str], body: bytes) -> str:
    """Send part of the body, then go. Returns what the client saw."""
    half = max(1, len(body) // 2)
    if mode.name in SERVER_MODES:
        sock = raw_request(mode.base_url, path, headers, body, send=half)
        time.sleep(0.005)  # pacing only: let the server start reading
        leave(sock)
        return "left"
    if mode.name == "transport":

        def gen() -> Iterator[bytes]:
            yield body[:half]
            raise ClientGone

        try:
            mode.client.post(path, content=gen(), headers=headers)  # type: ignore[attr-defined]
        except ClientGone:
            return "left"
        return "not-left"

    async def go() -> str:
        client: httpx2.AsyncClient = mode.client  # type: ignore[attr-defined]
        started = asyncio.Event()

        async def agen() -> Any:
            yield body[:half]
            started.set()
            await asyncio.Event().wait()  # the rest never comes
            yield body[half:]

        task = asyncio.ensure_future(client.post(path, content=agen(), headers=headers))
        waiter = asyncio.ensure_future(started.wait())
        await asyncio.wait({waiter, task}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            return "not-left"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return "left"

    return str(mode.portal.call(go))  # type: ignore[attr-defined]


def leave_while_waiting(
    mode: Mode, path: str, headers: dict[str, str], body: bytes, seen: Callable[[], bool]
) -> str:
    """Send the whole request, wait until a worker has it, then go.

    The sync transport cannot leave during a blocking call: ``"n/a"``.
    """
    if mode.name in SERVER_MODES:
        sock = raw_request(mode.base_url, path, headers, body)
        ok = wait_until(seen, 20)
        leave(sock)
        return "left" if ok else "never-forwarded"
    if mode.name == "transport":
        return "n/a"

    async def go() -> str:
        client: httpx2.AsyncClient = mode.client  # type: ignore[attr-defined]
        task = asyncio.ensure_future(client.post(path, content=body, headers=headers))
        deadline = time.monotonic() + 20
        while not seen() and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        if task.done():
            return "not-left"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return "left"

    return str(mode.portal.call(go))  # type: ignore[attr-defined]


def stream_all(mode: Mode, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any, bytes]:
    """A streamed request read to its end: status, headers, raw body."""
    if mode.name == "async_transport":

        async def go() -> tuple[int, Any, bytes]:
            client: httpx2.AsyncClient = mode.client  # type: ignore[attr-defined]
            async with client.stream("POST", path, json=body, headers=headers) as r:
                raw = b"".join([c async for c in r.aiter_raw()])
                return r.status_code, r.headers, raw

        return mode.portal.call(go)  # type: ignore[attr-defined,no-any-return]
    client: httpx2.Client = mode.client  # type: ignore[attr-defined]
    with client.stream("POST", path, json=body, headers=headers) as r:
        return r.status_code, r.headers, b"".join(r.iter_raw())


def stream_head(
    mode: Mode, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, bytes]:
    """Status, headers and the first piece of a streamed answer; then leave."""
    if mode.name == "async_transport":

        async def go() -> tuple[int, Any, bytes]:
            client: httpx2.AsyncClient = mode.client  # type: ignore[attr-defined]
            async with client.stream("POST", path, json=body, headers=headers) as r:
                async for chunk in r.aiter_raw():
                    if chunk:
                        return r.status_code, r.headers, bytes(chunk)
                return r.status_code, r.headers, b""

        return mode.portal.call(go)  # type: ignore[attr-defined,no-any-return]
    client: httpx2.Client = mode.client  # type: ignore[attr-defined]
    with client.stream("POST", path, json=body, headers=headers) as r:
        for chunk in r.iter_raw():
            if chunk:
                return r.status_code, r.headers, bytes(chunk)
        return r.status_code, r.headers, b""


def leave_mid_stream(mode: Mode, path: str, headers: dict[str, str], body: Any) -> bytes:
    """Read the first piece of a stream, then go; returns what was read."""
    with mode.stream("POST", path, json=body, headers=headers) as chunks:
        for chunk in chunks:
            if chunk:
                return bytes(chunk)
    return b""


# -- invariants -------------------------------------------------------------------------


def count_submits(mesh: Mesh) -> Callable[[], int]:
    """Count jobs the prepare pool accepted (submits that did not raise)."""
    pool = mesh.pool
    inner = pool.submit
    accepted = [0]
    lock = threading.Lock()

    def submit(fn: Any, within_s: float | None = None) -> Any:
        job = inner(fn, within_s)
        with lock:
            accepted[0] += 1
        return job

    pool.submit = submit  # type: ignore[method-assign]
    return lambda: accepted[0]


def lease_total(mesh: Mesh) -> int | None:
    """The lifecycle's live leases (None when this mesh has no leases view)."""
    leases = mesh.router.states.leases
    total = getattr(leases, "total", None)
    return total if isinstance(total, int) else None


def lease_count(mesh: Mesh, worker: Any) -> int | None:
    leases = mesh.router.states.leases
    count = getattr(leases, "count", None)
    return int(count(worker.id)) if callable(count) else None


def settled(mesh: Mesh) -> bool:
    pool = mesh.pool
    if mesh.total_load() != 0 or pool.queued != 0 or pool.running != 0:
        return False
    if any(mesh.load_of(w) != 0 for w in mesh.workers):
        return False
    total = lease_total(mesh)
    return total in (None, 0)


def assert_settled(
    mesh: Mesh, *, submitted: Callable[[], int] | None = None, timeout: float = 30
) -> dict[str, Any]:
    """Every load, lease and pool job is back to zero; outcomes counted once each."""
    assert wait_until(lambda: settled(mesh), timeout), state_of(mesh)
    for w in mesh.workers:
        assert mesh.load_of(w) == 0, (w.url, state_of(mesh))
        assert lease_count(mesh, w) in (None, 0), (w.url, state_of(mesh))
    outcomes = dict(mesh.pool.outcomes)
    if submitted is not None:
        assert sum(outcomes.values()) == submitted(), (outcomes, submitted())
    return state_of(mesh)


def state_of(mesh: Mesh) -> dict[str, Any]:
    pool = mesh.pool
    return {
        "total_load": mesh.total_load(),
        "loads": {w.url: mesh.load_of(w) for w in mesh.workers},
        "leases": lease_total(mesh),
        "pool_queued": pool.queued,
        "pool_running": pool.running,
        "pool_outcomes": dict(pool.outcomes),
    }


def metric_value(mesh: Mesh, name: str, **labels: str) -> float:
    """A sample of ``mesh.metrics`` (0.0 when absent)."""
    value = mesh.metrics.registry.get_sample_value(name, labels or None)
    return float(value or 0.0)


def describe(records: list[Any]) -> list[str]:
    """Log records, one line each (for assertion messages)."""
    out = []
    for r in records:
        exc = f" {r.exc_info[1]!r}" if r.exc_info else ""
        out.append(f"{r.name}: {r.getMessage()}{exc}")
    return out
