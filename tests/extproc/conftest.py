"""The ``meshkit`` command as a subprocess (:mod:`procs`)."""

from procs import spawn

__all__ = ["spawn"]
