"""
A mock worker on its own thread, for synchronous tests
======================================================

::

    with MockWorkerThread(MockConfig(name="w1")) as mock:
        httpx.get(mock.url + "/health")
        mock.kill()      # crash: connections reset, port closed
        mock.restart()   # same port again
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from ssl import SSLContext
from typing import Any, TypeVar

from meshkit.mock.config import MockConfig
from meshkit.mock.loop import new_event_loop
from meshkit.mock.server import MockWorker

__all__ = ["MockWorkerThread"]

T = TypeVar("T")
_TIMEOUT = 30.0


class MockWorkerThread:
    """Runs a :class:`MockWorker` on its own event loop in a daemon thread."""

    def __init__(
        self,
        config: MockConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl: SSLContext | None = None,
    ) -> None:
        self.worker = MockWorker(config, host=host, port=port, ssl=ssl)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.worker.url

    @property
    def kv_events_endpoint(self) -> str | None:
        """The KV-event PUB endpoint actually bound (``MockConfig.kv_events``)."""
        return self.worker.kv_events_endpoint

    @property
    def kv_replay_endpoint(self) -> str | None:
        """The KV-event replay endpoint actually bound (``MockConfig.kv_replay``)."""
        return self.worker.kv_replay_endpoint

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_TIMEOUT)

    def start(self) -> str:
        """Start the loop thread (if needed) and the worker; returns its URL."""
        if self._loop is None:
            loop = new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name=f"mock-worker-{self.worker.config.name}", daemon=True
            )
            self._loop, self._thread = loop, thread
            thread.start()
        if not self.worker.running:
            self._call(self.worker.start())
        return self.worker.url

    def kill(self) -> None:
        """Crash the worker (see :meth:`MockWorker.kill`); the thread keeps running,
        and the port stays bound, refusing connections, until a restart
        (:meth:`MockWorker.hold_port`)."""
        if self._loop is None:
            return

        async def kill() -> None:
            self.worker.kill()
            await asyncio.sleep(0)  # the listener closes
            self.worker.hold_port()

        self._call(kill())

    def restart(self) -> None:
        """Kill (if running) and start again on the same port."""
        if self.worker.running:
            self.kill()
        self.start()

    def stop(self) -> None:
        """Stop the worker and its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self.worker.stop())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_TIMEOUT)
            loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> MockWorkerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
