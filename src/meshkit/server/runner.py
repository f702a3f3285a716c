"""
Running the gateway
===================

:func:`serve` runs the gateway in the foreground (``meshkit serve``) on the
built-in server (:mod:`meshkit.server.h1.conn`: httptools on uvloop, meshkit's routes
without an ASGI layer), or, when asked (``--server``, ``[server] http``), on
uvicorn or granian. :class:`GatewayThread` runs it in a background thread for the
demo and tests.

Graceful shutdown, on SIGTERM or SIGINT:

1. ``/readiness`` turns 503 (``ServeApp.draining``) and the listening socket
   closes, so no new connection is accepted;
2. in-flight responses, streams included, run on for up to ``grace_s`` seconds
   (uvicorn's ``timeout_graceful_shutdown``); then they are cancelled, which
   releases their leases;
3. the middleware's upstream pool closes, then the mesh (its prepare pool).

A second SIGINT forces the exit at once. SIGHUP reloads the configuration
(:mod:`meshkit.server.hangup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

import uvicorn

from meshkit.config import MeshConfig
from meshkit.frontends.asgi import MeshMiddleware
from meshkit.mesh import Mesh
from meshkit.server.accept import SHARES_FILE, Shares
from meshkit.server.app import ServeApp, build_gateway
from meshkit.server.h1.acceptor import Inboxes, Sharing
from meshkit.server.h1.server import H1Server
from meshkit.server.hangup import reload_on_hangup
from meshkit.server.settings import ServeSettings
from meshkit.server.supervisor import leave_run_dir

if TYPE_CHECKING:
    from meshkit.server.peers import Peers
    from meshkit.server.supervisor import ChildPlace

__all__ = ["GatewayThread", "listen", "new_event_loop", "serve", "url_of"]

log = logging.getLogger("meshkit.server")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (several times cheaper per request), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (see :func:`url_of`).

    Bound here rather than by the server so the real port is known before
    serving, and a busy port is one clear error instead of a server log line.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _GraceCancelFilter(logging.Filter):
    """Drop the traceback of each stream uvicorn cancels when the grace period ends.

    uvicorn logs one line for the cut ("Cancel N running task(s), timeout graceful
    shutdown exceeded"), then a CancelledError traceback per task: noise that an
    operator would take for a crash.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, asyncio.CancelledError) and "graceful shutdown" in str(exc))


def _uvicorn_config(gateway: MeshMiddleware, settings: ServeSettings) -> uvicorn.Config:
    grace: Any = settings.grace_s  # uvicorn annotates int; it passes it to wait_for
    config = uvicorn.Config(
        gateway,
        lifespan="on",
        http="auto",  # httptools when installed, else h11
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=grace,
        server_header=False,
    )
    # After Config(): creating it (re)configures uvicorn's loggers.
    error_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _GraceCancelFilter) for f in error_log.filters):
        error_log.addFilter(_GraceCancelFilter())
    return config


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when draining starts and when it is up."""

    def __init__(
        self, config: uvicorn.Config, app: ServeApp, on_ready: Callable[[], None] | None
    ) -> None:
        super().__init__(config)
        self._serve_app = app
        self._on_ready = on_ready

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._serve_app.draining = True
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None:
            self._on_ready()


def _serve_app(gateway: MeshMiddleware) -> ServeApp:
    app = gateway.app
    assert isinstance(app, ServeApp)
    return app


Runner = Callable[
    [MeshMiddleware, socket.socket, ServeSettings, Callable[[], None], list[int]],
    Coroutine[Any, Any, None],
]


async def _run_uvicorn(
    gateway: MeshMiddleware,
    sock: socket.socket,
    settings: ServeSettings,
    ready: Callable[[], None],
    early: list[int],
) -> None:
    server = _Server(_uvicorn_config(gateway, settings), _serve_app(gateway), ready)
    # A signal that arrived before uvicorn took the handlers over still stops it,
    # right after start-up.
    server.should_exit = bool(early)
    try:
        await server.serve(sockets=[sock])
    finally:
        # Lifespan shutdown already closed it, unless a forced exit skipped lifespan.
        await gateway.aclose()


async def _run_granian(
    gateway: MeshMiddleware,
    sock: socket.socket,
    settings: ServeSettings,
    ready: Callable[[], None],
    early: list[int],
) -> None:
    from granian.constants import Interfaces
    from granian.server.embed import Server

    host, port = sock.getsockname()[:2]
    sock.close()  # granian binds its own socket
    level = "debug" if settings.log_level == "trace" else settings.log_level
    server = Server(
        gateway,
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        log_level=level,
        log_access=settings.access_log,
    )
    app = _serve_app(gateway)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        app.draining = True
        server.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    if early:
        loop.call_soon(stop)
    ready()
    try:
        await server.serve()
    finally:
        await gateway.aclose()


def _h1_server(
    gateway: MeshMiddleware, settings: ServeSettings, sharing: Sharing | None = None
) -> H1Server:
    return H1Server(
        gateway,
        keep_alive_s=settings.keep_alive_s,
        max_connections=settings.max_connections,
        max_pipelined=settings.max_pipelined,
        access_log=settings.access_log,
        sharing=sharing,
    )


async def _run_builtin(
    gateway: MeshMiddleware,
    sock: socket.socket,
    settings: ServeSettings,
    ready: Callable[[], None],
    early: list[int],
    *,
    server: H1Server | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """The built-in server until SIGTERM/SIGINT (in the main thread) or ``stop``."""
    server = server or _h1_server(gateway, settings)
    app = gateway.app if isinstance(gateway.app, ServeApp) else None
    loop = asyncio.get_running_loop()
    stopped = stop or asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if app is not None:
            app.draining = True
        if signals > 1:  # a second signal: no more grace
            raise SystemExit(1)
        stopped.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, on_signal)
    try:
        await server.start(sock)
        if early:
            on_signal()
        ready()
        await stopped.wait()
        if app is not None:
            app.draining = True
        await server.shutdown(settings.grace_s)
    finally:
        await gateway.aclose()


def granian_available() -> bool:
    try:
        import granian.server.embed  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _quiet_signals() -> Iterator[list[int]]:
    """Record SIGTERM/SIGINT instead of dying of them; yields the signals seen.

    uvicorn re-raises a captured signal once it has shut down; with the default
    handlers that would kill the process (or raise KeyboardInterrupt) before the
    mesh is closed and the exit code reported. A signal seen before the server
    installed its own handlers is in the list, so the server stops at once.
    """
    seen: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda sig, _frame: seen.append(sig)) for s in sigs}
    try:
        yield seen
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve(
    mesh: Mesh,
    settings: ServeSettings,
    *,
    on_ready: Callable[[str], None] | None = None,
    reload: Callable[[], MeshConfig] | None = None,
    child: ChildPlace | None = None,
) -> None:
    """Serve ``mesh`` in the foreground until SIGTERM/SIGINT, then close it.

    :param on_ready: called with the gateway's URL once it accepts requests.
    :param reload: builds the configuration again; SIGHUP applies what it returns
        (:mod:`meshkit.server.hangup`).
    :param child: this process is one of ``serve --processes N``'s children
        (:mod:`meshkit.server.supervisor`): it serves the parent's listening socket,
        answers its siblings on a private Unix socket and stops when the parent
        goes away.
    :raises OSError: when the address cannot be bound.
    """
    if child is None:
        sock = listen(settings.host, settings.port)
        peers = None
    else:
        from meshkit.server.peers import Peers

        sock = socket.socket(fileno=child.fd)
        peers = Peers(child.run_dir, child.index, child.count, relay=child.kv_relay is not None)
    url = url_of(sock)
    gateway = build_gateway(mesh, peers=peers)
    gate = None
    if peers is not None:
        from meshkit.server.peer_admin import gate_lifecycle

        gate = gate_lifecycle(mesh, peers)
    mesh.start_lifecycle()  # probe now: /readiness waits for a verified worker
    run: Runner = {"granian": _run_granian, "uvicorn": _run_uvicorn}.get(
        settings.server, _run_builtin
    )

    def ready() -> None:
        if on_ready is not None:
            on_ready(url)

    async def main(early: list[int]) -> None:
        if peers is None:
            await run(gateway, sock, settings, ready, early)
            return
        assert child is not None
        assert gate is not None
        gate.bind(asyncio.get_running_loop())
        await _serve_child(gateway, sock, settings, ready, early, run, peers, child)

    try:
        with (
            reload_on_hangup(mesh, reload),
            _quiet_signals() as early,
            asyncio.Runner(loop_factory=new_event_loop) as runner,
        ):
            runner.run(main(early))
    finally:
        sock.close()
        mesh.close()


async def _serve_child(
    gateway: MeshMiddleware,
    sock: socket.socket,
    settings: ServeSettings,
    ready: Callable[[], None],
    early: list[int],
    run: Runner,
    peers: Peers,
    child: ChildPlace,
) -> None:
    """One child of ``serve --processes``: the public server, plus the private
    socket its siblings ask (metrics, the fleet, admin verbs)."""
    from meshkit.server.peers import copy_fleet, peer_app

    path = peers.path(peers.index)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a previous run of this child
    private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    private.bind(path)
    private.listen(64)
    inner = H1Server(gateway, app=peer_app(gateway.app), max_connections=256)
    await inner.start(private)
    # The parent holds the other end of this pipe: when it is gone (even killed),
    # the pipe reads EOF and this child drains as if told SIGTERM.
    loop = asyncio.get_running_loop()
    lifeline = child.lifeline_fd
    orphaned = False

    def parent_gone() -> None:
        nonlocal orphaned
        orphaned = True
        loop.remove_reader(lifeline)
        os.kill(os.getpid(), signal.SIGTERM)

    loop.add_reader(lifeline, parent_gone)
    if child.restarted:
        try:
            # The fleet its siblings run: admin verbs may have changed it since start.
            await copy_fleet(peers, gateway.mesh)
        except Exception:  # the configured fleet then; never a reason not to serve
            log.exception("could not copy the fleet from the other processes")
    sharing = Sharing(
        Shares(os.path.join(child.run_dir, SHARES_FILE), child.count),
        Inboxes(
            socket.socket(fileno=child.inbox_fd),
            [socket.socket(fileno=fd) for fd in child.outbox_fds],
        ),
        child.index,
    )
    if run is _run_builtin:
        # The children share out the connections (meshkit.server.accept).
        run = functools.partial(_run_builtin, server=_h1_server(gateway, settings, sharing))
        if isinstance(gateway.app, ServeApp):
            gateway.app.shares = sharing.shares
    try:
        await run(gateway, sock, settings, ready, early)
    finally:
        sharing.inboxes.close()
        sharing.shares.close()
        loop.remove_reader(lifeline)
        await inner.shutdown(0.0)
        private.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        await peers.aclose()
        if orphaned:
            leave_run_dir(child.run_dir)


class GatewayThread:
    """The gateway on a background thread, for demos and tests.

    ::

        with GatewayThread(mesh) as url:
            httpx.get(url + "/health")

    :param mesh: the mesh; the gateway is ``build_gateway(mesh)``...
    :param gateway: ...unless a gateway (a ``MeshMiddleware`` around any ASGI app)
        is given; then ``mesh`` may be omitted.
    :param server: ``"builtin"`` (default) or ``"uvicorn"``.
    :param sock: a listening socket to serve on instead of ``host:port`` (a Unix
        one too: its ``url`` is then ``unix:<path>``); it is closed on exit.

    The mesh is not closed on exit: it belongs to the caller.
    """

    def __init__(
        self,
        mesh: Mesh | None = None,
        *,
        gateway: MeshMiddleware | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        server: str = "builtin",
        grace_s: float = 5.0,
        keep_alive_s: float = 5.0,
        max_connections: int = 4096,
        max_pipelined: int = 16,
        access_log: bool = False,
        sock: socket.socket | None = None,
    ) -> None:
        if gateway is None:
            if mesh is None:
                raise TypeError("GatewayThread needs a mesh or a gateway")
            gateway = build_gateway(mesh)
        self.gateway = gateway
        self._sock = sock if sock is not None else listen(host, port)
        if self._sock.family == socket.AF_UNIX:
            self.url = f"unix:{self._sock.getsockname()}"
        else:
            self.url = url_of(self._sock)
        self.settings = ServeSettings(
            host=host,
            port=port,
            grace_s=grace_s,
            log_level="warning",
            access_log=access_log,
            server=server,
            keep_alive_s=keep_alive_s,
            max_connections=max_connections,
            max_pipelined=max_pipelined,
        )
        self._ready = threading.Event()
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.h1: H1Server | None = None
        self.uvicorn: _Server | None = None
        if server == "uvicorn":
            self.uvicorn = _Server(
                _uvicorn_config(self.gateway, self.settings),
                _serve_app(self.gateway),
                self._ready.set,
            )
        self._thread = threading.Thread(target=self._run, name="meshkit-gateway", daemon=True)

    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                runner.run(self._serve())
        finally:
            self._ready.set()  # never leave start() waiting on a failed server

    async def _serve(self) -> None:
        if self.uvicorn is not None:
            try:
                await self.uvicorn.serve(sockets=[self._sock])
            finally:
                await self.gateway.aclose()
            return
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.h1 = _h1_server(self.gateway, self.settings)
        await _run_builtin(
            self.gateway, self._sock, self.settings, self._up, [], server=self.h1, stop=self._stop
        )

    def _up(self) -> None:
        self._started = True
        self._ready.set()

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """``fn()`` run on the built-in server's loop (where its state lives)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("call() needs the built-in server, started")

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    @property
    def started(self) -> bool:
        return self.uvicorn.started if self.uvicorn is not None else self._started

    def start(self, timeout: float = 30.0) -> str:
        self.gateway.mesh.start_lifecycle()  # as ``serve`` does
        self._thread.start()
        self._ready.wait(timeout)
        if not self.started:
            raise RuntimeError("the gateway did not start")
        return self.url

    def stop(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True
        elif self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30.0)
        self._sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
