"""The ways meshkit is embedded, behind one test interface.

Each :class:`Mode` takes a Mesh and gives a plain HTTP client (``request`` /
``stream``) and SDK clients that reach the mesh the way a user would: through a
real uvicorn server (ASGI), a real werkzeug server (WSGI), the gateway's own
server, an httpx2 client with the sync or async transport, or a real Envoy whose
ext_proc filter asks meshkit's picker (``extproc``: one Envoy for the session,
in FULL_DUPLEX_STREAMED mode, the Gateway API Inference Extension's).
"""

from __future__ import annotations

import asyncio
import random
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import uvicorn
from anyio.from_thread import BlockingPortal, start_blocking_portal
from werkzeug.serving import make_server

from meshkit import AsyncMeshTransport, Mesh, MeshMiddleware, MeshTransport, MeshWSGIMiddleware
from meshkit.server.runner import GatewayThread
from meshkit.testing.ports import free_port as free_port  # the tests import it from here


def _extproc_available() -> bool:
    try:
        import grpc  # noqa: F401

        from meshkit.testing.envoy import envoy_binary
    except ImportError:
        return False
    return envoy_binary() is not None


EXTPROC = _extproc_available()
MODES: tuple[str, ...] = ("asgi", "wsgi", "transport", "async_transport", "gateway")
#: modes a client reaches over a real socket (a raw client can reset it)
SERVER_MODES: tuple[str, ...] = ("asgi", "wsgi", "gateway")
if EXTPROC:
    MODES += ("extproc",)
    SERVER_MODES += ("extproc",)


@dataclass
class Reply:
    status: int
    headers: httpx2.Headers
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


def reusable_port() -> int:
    """A free port below the kernel's ephemeral range, for a port that several servers
    listen on in turn. A port from :func:`free_port` is ephemeral: between two of
    those servers any outgoing connection of the session may take it as its local
    port, and the next server then fails to bind (CI saw grpc's "Failed to bind")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


async def _host_app(scope: Any, receive: Any, send: Any) -> None:
    """The wrapped app: answers its own routes, proving pass-through."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b"host app: " + scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-host-app", b"1")]})
    await send({"type": "http.response.body", "body": body})


def _wsgi_host_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("x-host-app", "1")])
    return [b"host app: " + environ["PATH_INFO"].encode()]


#: How often a test's server (uvicorn's, werkzeug's, http.server's) looks whether
#: it was told to stop: socketserver's default, 0.5 s, and uvicorn's 0.1 s were
#: waited out by every test that stopped one.
SHUTDOWN_POLL_S = 0.02


def serve_thread(server: socketserver.BaseServer) -> threading.Thread:
    """A daemon thread (not started) that serves ``server`` until its
    ``shutdown()``, looking for it every SHUTDOWN_POLL_S."""
    return threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True)


class _QuickUvicorn(uvicorn.Server):
    """uvicorn's server, looking for ``should_exit`` every SHUTDOWN_POLL_S: uvicorn
    looks every 0.1 s, which every ASGI-mode test waited out as it stopped."""

    async def main_loop(self) -> None:
        tick = 0
        while not await self.on_tick(tick):  # on_tick refreshes the Date header
            tick = (tick + 1) % 864_000
            await asyncio.sleep(SHUTDOWN_POLL_S)


class UvicornThread:
    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = _QuickUvicorn(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class WerkzeugThread:
    def __init__(self, app: Any) -> None:
        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.thread = serve_thread(self.server)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_port}"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.thread.join(10)


class Mode:
    """A running embedding of one Mesh."""

    name: str
    base_url: str = "http://mesh.invalid"

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    # plain HTTP -----------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        raise NotImplementedError

    @contextmanager
    def stream(
        self, method: str, path: str, *, json: Any = None, headers: dict[str, str] | None = None
    ) -> Iterator[Iterator[bytes]]:
        raise NotImplementedError
        yield iter(())

    # SDKs --------------------------------------------------------------------------
    def openai(self, **kw: Any) -> openai.OpenAI:
        raise NotImplementedError

    def anthropic(self, **kw: Any) -> anthropic.Anthropic:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _ClientMode(Mode):
    """A mode whose plain HTTP goes through a sync httpx2 client (``self.client``)."""

    client: httpx2.Client

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        r = self.client.request(method, path, json=json, content=content, headers=headers)
        return Reply(r.status_code, r.headers, r.content)

    @contextmanager
    def stream(
        self, method: str, path: str, *, json: Any = None, headers: dict[str, str] | None = None
    ) -> Iterator[Iterator[bytes]]:
        with self.client.stream(method, path, json=json, headers=headers) as r:
            yield r.iter_raw()


class _ServerMode(_ClientMode):
    def __init__(self, mesh: Mesh) -> None:
        super().__init__(mesh)
        self.client = httpx2.Client(base_url=self.base_url, timeout=30)

    def openai(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("api_key", "client-key")
        return openai.OpenAI(base_url=self.base_url + "/v1", **kw)

    def anthropic(self, **kw: Any) -> anthropic.Anthropic:
        kw.setdefault("api_key", "client-key")
        return anthropic.Anthropic(base_url=self.base_url, **kw)


class AsgiMode(_ServerMode):
    name = "asgi"

    def __init__(self, mesh: Mesh) -> None:
        self.middleware = MeshMiddleware(_host_app, mesh=mesh)
        self.server = UvicornThread(self.middleware)
        self.base_url = self.server.__enter__()
        super().__init__(mesh)

    def close(self) -> None:
        self.client.close()
        self.server.__exit__()


class GatewayMode(_ServerMode):
    """The standalone gateway's server (meshkit.server.h1.conn) around the middleware."""

    name = "gateway"

    def __init__(self, mesh: Mesh) -> None:
        self.middleware = MeshMiddleware(_host_app, mesh=mesh)
        self.server = GatewayThread(gateway=self.middleware)
        self.base_url = self.server.__enter__()
        super().__init__(mesh)

    def close(self) -> None:
        self.client.close()
        self.server.__exit__()


class WsgiMode(_ServerMode):
    name = "wsgi"

    def __init__(self, mesh: Mesh) -> None:
        self.middleware = MeshWSGIMiddleware(_wsgi_host_app, mesh=mesh)
        self.server = WerkzeugThread(self.middleware)
        self.base_url = self.server.__enter__()
        super().__init__(mesh)

    def close(self) -> None:
        self.client.close()
        self.server.__exit__()
        self.middleware.close()


class TransportMode(_ClientMode):
    name = "transport"

    def __init__(self, mesh: Mesh) -> None:
        super().__init__(mesh)
        self.transport = MeshTransport(mesh)
        self.client = httpx2.Client(transport=self.transport, base_url=self.base_url, timeout=30)

    def openai(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("api_key", "client-key")
        return openai.OpenAI(
            base_url=self.base_url + "/v1",
            http_client=httpx2.Client(transport=MeshTransport(self.mesh)),
            **kw,
        )

    def anthropic(self, **kw: Any) -> anthropic.Anthropic:
        kw.setdefault("api_key", "client-key")
        return anthropic.Anthropic(
            base_url=self.base_url,
            http_client=httpx2.Client(transport=MeshTransport(self.mesh)),
            **kw,
        )

    def close(self) -> None:
        self.client.close()


class AsyncTransportMode(Mode):
    """The async transport, driven from a background event loop (a portal)."""

    name = "async_transport"

    def __init__(self, mesh: Mesh) -> None:
        super().__init__(mesh)
        self._cm = start_blocking_portal()
        self.portal: BlockingPortal = self._cm.__enter__()
        self.transport = AsyncMeshTransport(mesh)
        self.client = httpx2.AsyncClient(
            transport=self.transport, base_url=self.base_url, timeout=30
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        async def go() -> Reply:
            r = await self.client.request(method, path, json=json, content=content, headers=headers)
            return Reply(r.status_code, r.headers, r.content)

        return self.portal.call(go)

    @contextmanager
    def stream(
        self, method: str, path: str, *, json: Any = None, headers: dict[str, str] | None = None
    ) -> Iterator[Iterator[bytes]]:
        req = self.client.build_request(method, path, json=json, headers=headers)
        resp = self.portal.call(lambda: self.client.send(req, stream=True))
        it = resp.aiter_raw()

        def chunks() -> Iterator[bytes]:
            while True:
                try:
                    yield self.portal.call(it.__anext__)
                except StopAsyncIteration:
                    return

        try:
            yield chunks()
        finally:
            self.portal.call(resp.aclose)

    def run(self, fn: Callable[[], Any]) -> Any:
        return self.portal.call(fn)

    def async_openai(self, **kw: Any) -> openai.AsyncOpenAI:
        kw.setdefault("api_key", "client-key")
        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1",
            http_client=httpx2.AsyncClient(transport=AsyncMeshTransport(self.mesh)),
            **kw,
        )

    def async_anthropic(self, **kw: Any) -> anthropic.AsyncAnthropic:
        kw.setdefault("api_key", "client-key")
        return anthropic.AsyncAnthropic(
            base_url=self.base_url,
            http_client=httpx2.AsyncClient(transport=AsyncMeshTransport(self.mesh)),
            **kw,
        )

    def close(self) -> None:
        self.portal.call(self.client.aclose)
        self._cm.__exit__(None, None, None)


class _SharedEnvoy:
    """One Envoy for the whole session, its ext_proc cluster on a fixed port that
    each :class:`ExtProcMode` serves in turn (Envoy reconnects to the new one)."""

    envoy: Any = None
    port = 0

    @classmethod
    def get(cls) -> Any:
        if cls.envoy is None:
            import atexit

            from meshkit.testing.envoy import EnvoyProcess

            cls.port = reusable_port()  # each ExtProcMode's picker binds it in turn
            cls.envoy = EnvoyProcess(cls.port, message_timeout_s=60.0)
            cls.envoy.__enter__()
            atexit.register(cls.envoy.stop)
        return cls.envoy


class ExtProcMode(_ServerMode):
    """A real Envoy in front, meshkit's picker behind its ext_proc filter."""

    name = "extproc"

    def __init__(self, mesh: Mesh) -> None:
        from meshkit.frontends.extproc.thread import ExtProcThread

        envoy = _SharedEnvoy.get()
        self.picker = ExtProcThread(mesh, port=_SharedEnvoy.port, grace_s=1.0)
        self.picker.start()
        self.base_url = envoy.url
        super().__init__(mesh)

    def close(self) -> None:
        self.client.close()
        self.picker.stop()


MODE_CLASSES: dict[str, type[Mode]] = {
    "extproc": ExtProcMode,
    "asgi": AsgiMode,
    "wsgi": WsgiMode,
    "transport": TransportMode,
    "async_transport": AsyncTransportMode,
    "gateway": GatewayMode,
}


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``pred`` (a condition, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


__all__ = [
    "MODES",
    "MODE_CLASSES",
    "SERVER_MODES",
    "Mode",
    "Reply",
    "asyncio",
    "httpx",
    "wait_until",
]
