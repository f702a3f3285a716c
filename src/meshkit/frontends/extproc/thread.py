"""
The picker on a background thread
=================================

For tests and demos, as :class:`~meshkit.server.runner.GatewayThread` is for the
gateway::

    with ExtProcThread(mesh) as port:      # Envoy's ext_proc cluster: 127.0.0.1:port
        ...

The mesh is not closed on exit: it belongs to the caller.
"""

from __future__ import annotations

import asyncio
import threading

from meshkit.frontends.extproc.server import ExtProcServer, serve_extproc
from meshkit.mesh import Mesh

__all__ = ["ExtProcThread"]


class ExtProcThread:
    def __init__(
        self,
        mesh: Mesh,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        grace_s: float = 5.0,
        max_streams: int | None = None,
    ) -> None:
        x = mesh.config.extproc
        self.mesh = mesh
        self.grace_s = grace_s
        self.server = ExtProcServer(
            mesh,
            host=host,
            port=port,
            max_streams=max_streams or x.max_streams,
            resolve_ttl_s=x.resolve_ttl_s,
            resolve_max=x.resolve_max,
        )
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="meshkit-extproc", daemon=True)

    def _run(self) -> None:
        from meshkit.server.runner import new_event_loop

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve_extproc(
                self.mesh, self.server, grace_s=self.grace_s, stop=self._stop, ready=self._up
            )

        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                runner.run(main())
        except BaseException as exc:  # reported by start()
            self._error = exc
        finally:
            self._ready.set()

    def _up(self, port: int) -> None:
        self.port = port
        self._ready.set()

    def start(self, timeout: float = 30.0) -> int:
        self._thread.start()
        self._ready.wait(timeout)
        if not self.port:
            raise RuntimeError(f"the picker did not start: {self._error!r}")
        return self.port

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(30.0)

    def __enter__(self) -> int:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
