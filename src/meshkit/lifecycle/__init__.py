"""
meshkit.lifecycle: worker lifecycle at run time
===============================================

What takes time in a worker's lifecycle (``docs/lifecycle.md``); the state itself
is the :class:`~meshkit.router.Router`'s (:mod:`meshkit.core.states`):

* :mod:`~meshkit.lifecycle.controller` — :class:`Lifecycle`, one per
  :class:`~meshkit.Mesh` (``mesh.lifecycle``): drains, and the background thread
  that probes, wakes and sleeps workers;
* :mod:`~meshkit.lifecycle.admin` — :class:`AdminApp`, the admin API as a pure
  ASGI app to mount.
"""

from __future__ import annotations

from meshkit.lifecycle.admin import AdminApp
from meshkit.lifecycle.controller import Lifecycle

__all__ = ["AdminApp", "Lifecycle"]
