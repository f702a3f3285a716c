"""
SIGHUP: reload the configuration
================================

``meshkit serve`` re-reads its configuration on SIGHUP (the same flags, file and
environment as at start) and applies it with :meth:`Mesh.reconfigure
<meshkit.Mesh.reconfigure>`. One line is logged either way: what changed, or why
the new configuration was refused (the key at fault), the running one staying.
Reloads run one at a time on a thread of their own: draining a removed worker
never holds up the server, and a SIGHUP during a reload is not lost.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from meshkit.config import MeshConfig
from meshkit.errors import ConfigError
from meshkit.mesh import Mesh

__all__ = ["reload_on_hangup"]

log = logging.getLogger("meshkit.server")


class _Reloader:
    def __init__(self, mesh: Mesh, load: Callable[[], MeshConfig]) -> None:
        self.mesh = mesh
        self.load = load
        self._lock = threading.Lock()

    def signalled(self, _sig: int, _frame: Any) -> None:
        threading.Thread(target=self.reload, name="meshkit-reload", daemon=True).start()

    def reload(self) -> None:
        with self._lock:
            outcome = "error"
            try:
                report = self.mesh.reconfigure(self.load())
            except ConfigError as exc:
                log.error("reload refused, the running configuration stays: %s", exc)
            except RuntimeError as exc:  # closed while shutting down
                log.warning("reload skipped: %s", exc)
            except Exception:  # a bug: say so, keep serving
                log.exception("reload failed, the running configuration stays")
            else:
                outcome = "ok"
                log.info("reloaded: %s", report.summary())
            self.mesh.metrics.reloads.labels(outcome).inc()


@contextlib.contextmanager
def reload_on_hangup(
    mesh: Mesh, load: Callable[[], MeshConfig] | None
) -> Iterator[Callable[[], None] | None]:
    """SIGHUP reloads ``mesh`` from ``load()`` while the block runs (main thread
    only); yields the reload itself (for callers without signals), or None."""
    if load is None:
        yield None
        return
    reloader = _Reloader(mesh, load)
    try:
        previous = signal.signal(signal.SIGHUP, reloader.signalled)
    except ValueError:  # not the main thread
        yield reloader.reload
        return
    try:
        yield reloader.reload
    finally:
        signal.signal(signal.SIGHUP, previous)
