"""
meshkit.server: the gateway and the ``meshkit`` command
=======================================================

* :mod:`meshkit.server.app` — :class:`ServeApp` (health, metrics, admin routes)
  and :func:`build_gateway` (``MeshMiddleware`` around it);
* :mod:`meshkit.server.settings` — flags over file over environment;
* :mod:`meshkit.server.runner` — uvicorn/granian, graceful shutdown,
  :class:`~meshkit.server.runner.GatewayThread`;
* :mod:`meshkit.server.cli` — ``meshkit serve | mock-worker | demo``;
* ``meshkit demo`` lives in :mod:`meshkit.demo`.

Importing this package does not import a server: uvicorn is the ``[server]`` extra.
"""

from __future__ import annotations

from meshkit.server.app import ServeApp, build_gateway

__all__ = ["ServeApp", "build_gateway"]
