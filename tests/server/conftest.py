"""The ``meshkit`` command as a subprocess (:mod:`procs`)."""

from procs import meshkit_run, spawn

__all__ = ["meshkit_run", "spawn"]
