"""
The relay child's metrics
=========================

``meshkit serve --processes N`` runs its KV-event relay as a child of its own
(:mod:`meshkit.server.supervisor`). Its counts (``mesh_kv_relay_*``) belong in the
gateway's one ``/metrics``, so it answers ``GET /metrics`` on a Unix socket in the
run directory, where the router child that is scraped asks it as it asks its
siblings (:mod:`meshkit.server.merged_metrics`). prometheus-client's own handler,
on a socket only the gateway's user reaches (the run directory is mode 0700); it
logs nothing.
"""

from __future__ import annotations

import contextlib
import os
import socketserver
import threading
from typing import Any

from prometheus_client.exposition import MetricsHandler

__all__ = ["MetricsSocket"]


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class MetricsSocket:
    """``GET /metrics`` of ``registry`` on the Unix socket ``path``, served by a
    daemon thread until :meth:`close`."""

    def __init__(self, path: str, registry: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a killed predecessor's
        self.path = path
        self._server = _Server(path, MetricsHandler.factory(registry))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kv-relay-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
