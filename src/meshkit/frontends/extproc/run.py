"""
Running ``meshkit extproc``
===========================

In the foreground until SIGTERM/SIGINT: the gRPC health service turns
NOT_SERVING, new streams are refused, and the streams in flight (requests Envoy is
still relaying) get ``grace_s`` to end. SIGHUP reloads the configuration as for
``meshkit serve`` (:mod:`meshkit.server.hangup`). The gateway's own routes
(``/metrics``, ``/health``, ``/readiness``, ``/workers``) answer on
``metrics_port`` through uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator

from meshkit.config import ExtProcConfig, MeshConfig
from meshkit.frontends.extproc.server import ExtProcServer, serve_extproc
from meshkit.mesh import Mesh
from meshkit.server.hangup import reload_on_hangup

__all__ = ["run_extproc"]


async def _metrics(mesh: Mesh, host: str, port: int) -> asyncio.Task[None] | None:
    if not port:
        return None
    import uvicorn

    from meshkit.server.app import ServeApp
    from meshkit.server.runner import listen

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # The picker owns SIGTERM/SIGINT: uvicorn would take them and re-raise them.
            yield

    sock = listen(host, port)
    config = uvicorn.Config(ServeApp(mesh), lifespan="off", log_level="warning", access_log=False)
    return asyncio.create_task(_Server(config).serve(sockets=[sock]))


def run_extproc(
    mesh: Mesh,
    settings: ExtProcConfig,
    *,
    on_ready: Callable[[str], None],
    reload: Callable[[], MeshConfig] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then close ``mesh``.

    :raises OSError: a port cannot be bound.
    """
    from meshkit.server.runner import new_event_loop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        server = ExtProcServer(
            mesh,
            host=settings.host,
            port=settings.port,
            max_streams=settings.max_streams,
            resolve_ttl_s=settings.resolve_ttl_s,
            resolve_max=settings.resolve_max,
        )
        metrics = await _metrics(mesh, settings.host, settings.metrics_port)

        def ready(port: int) -> None:
            on_ready(f"{settings.host}:{port}")

        try:
            await serve_extproc(mesh, server, grace_s=settings.grace_s, stop=stop, ready=ready)
        finally:
            if metrics is not None:
                metrics.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await metrics

    try:
        with reload_on_hangup(mesh, reload), asyncio.Runner(loop_factory=new_event_loop) as r:
            r.run(main())
    finally:
        mesh.close()
