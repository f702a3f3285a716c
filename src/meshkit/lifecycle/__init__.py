"""
meshkit.lifecycle: worker lifecycle at run time
===============================================

The stateful side of :mod:`meshkit.core.lifecycle` (issue 6, ``docs/lifecycle.md``):

* :mod:`~meshkit.lifecycle.controller` — :class:`Lifecycle`, one per
  :class:`~meshkit.Mesh` (``mesh.lifecycle``): worker machines, leases, waiters;
* :mod:`~meshkit.lifecycle.runner` — the background thread that probes, wakes
  and sleeps workers;
* :mod:`~meshkit.lifecycle.admin` — :class:`AdminApp`, the admin API as a pure
  ASGI app to mount;
* :mod:`~meshkit.lifecycle.metrics` — the Prometheus collector.
"""

from __future__ import annotations

from meshkit.lifecycle.admin import AdminApp
from meshkit.lifecycle.controller import Lifecycle

__all__ = ["AdminApp", "Lifecycle"]
