"""The gateway's own routes, called in-process (no server): every health state."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import pytest

import meshkit
from meshkit import Mesh, Worker
from meshkit.server import ServeApp, build_gateway

URL = "http://127.0.0.1:9"


def call(
    app: Any, path: str, method: str = "GET", headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


@pytest.fixture
def make() -> Iterator[Callable[..., ServeApp]]:
    meshes: list[Mesh] = []

    def build(*workers: Worker | str, **kw: Any) -> ServeApp:
        mesh = Mesh(workers=list(workers), **kw)
        meshes.append(mesh)
        return ServeApp(mesh)

    yield build
    for m in meshes:
        m.close()


def statuses(app: ServeApp) -> tuple[int, int, int]:
    return tuple(call(app, p)[0] for p in ("/health", "/liveness", "/readiness"))  # type: ignore[return-value]


def test_all_good(make: Any) -> None:
    app = make(URL, lifecycle={"probe": False})  # nothing to verify: assumed ready
    assert statuses(app) == (200, 200, 200)
    body = json.loads(call(app, "/health")[2])
    assert body == {
        "status": "ok",
        "pool": "ok",
        "workers": 1,
        "healthy_workers": 1,
        "verified_workers": 1,
        "in_flight": 0,
        "build": meshkit.build(),
    }


def test_a_worker_no_probe_has_answered_yet_is_not_ready(make: Any) -> None:
    """Routable (healthy), but readiness waits for a probe to verify it."""
    app = make(URL)
    assert statuses(app) == (200, 200, 503)
    body = json.loads(call(app, "/health")[2])
    assert (body["healthy_workers"], body["verified_workers"]) == (1, 0)


def test_no_worker_configured(make: Any) -> None:
    assert statuses(make()) == (503, 200, 503)


def test_no_healthy_worker_is_not_ready_but_alive(make: Any) -> None:
    app = make(URL, lifecycle={"probe": False})
    app.mesh.set_healthy(app.mesh.workers[0], False)
    assert statuses(app) == (200, 200, 503)


def test_a_dead_prepare_pool_fails_liveness(make: Any) -> None:
    app = make(URL)
    app.mesh.pool.kill_worker_for_testing()
    assert statuses(app) == (503, 503, 503)


def test_a_closed_pool_is_unhealthy_but_alive(make: Any) -> None:
    app = make(URL)
    app.mesh.close()
    assert statuses(app) == (503, 200, 503)


def test_draining_is_not_ready(make: Any) -> None:
    app = make(URL, lifecycle={"probe": False})
    app.draining = True
    assert statuses(app) == (200, 200, 503)


def test_metrics(make: Any) -> None:
    status, headers, body = call(make(URL), "/metrics")
    assert status == 200
    assert headers[b"content-type"] == b"text/plain; version=0.0.4; charset=utf-8"
    assert b"# TYPE mesh_router_requests_total counter" in body
    assert call(make(URL, metrics={"enabled": False}), "/metrics")[0] == 404


def test_methods_and_unknown_paths(make: Any) -> None:
    app = make(URL)
    assert call(app, "/health", "POST")[0] == 405
    assert call(app, "/nope")[0] == 404
    status, headers, body = call(app, "/health", "HEAD")
    assert (status, body) == (200, b"")
    assert int(headers[b"content-length"]) > 0


def test_workers_route_needs_the_admin_key_and_never_shows_keys(make: Any) -> None:
    app = make(Worker(URL, api_key="sk-secret-worker"), admin_key="adm")
    assert call(app, "/workers")[0] == 401
    assert call(app, "/workers", headers=[(b"authorization", b"Bearer wrong")])[0] == 401
    status, _, body = call(app, "/workers", headers=[(b"authorization", b"Bearer adm")])
    assert status == 200
    assert b"127.0.0.1:9" in body and b"sk-secret" not in body and b"adm" not in body


def test_build_gateway_wraps_the_serve_app(make: Any) -> None:
    app = make(URL)
    gateway = build_gateway(app.mesh)
    assert isinstance(gateway.app, ServeApp) and gateway.mesh is app.mesh
    assert call(gateway, "/health")[0] == 200  # not an inference path: passes through


def test_the_gateway_mounts_the_admin_routes() -> None:
    """POST /workers (add) and /workers/{id}/drain answer through the gateway app."""
    import asyncio

    from meshkit import Mesh
    from meshkit.server.app import ServeApp

    mesh = Mesh(workers=[], lifecycle={"probe": False}, admin_key="adm")
    app = ServeApp(mesh)
    sent: list[MutableMapping[str, Any]] = []

    async def call(method: str, path: str, body: bytes, auth: bool) -> int:
        headers = [(b"authorization", b"Bearer adm")] if auth else []
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "headers": headers,
            "query_string": b"",
            "raw_path": path.encode(),
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(msg: MutableMapping[str, Any]) -> None:
            sent.append(msg)

        await app(scope, receive, send)
        return int(next(m["status"] for m in reversed(sent) if m["type"] == "http.response.start"))

    try:
        assert asyncio.run(call("GET", "/workers", b"", auth=False)) == 401
        added = asyncio.run(call("POST", "/workers", b'{"url": "http://127.0.0.1:9"}', auth=True))
        assert added in (200, 201)
        assert [w.url for w in mesh.workers] == ["http://127.0.0.1:9"]
    finally:
        mesh.close()
