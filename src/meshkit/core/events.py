"""
Response event shapes
=====================

The msgspec types :mod:`meshkit.core.streams` decodes response events with. They
live apart from it because a compiled build (``hatch_build.py``) compiles
``streams`` with mypyc, which does not build msgspec ``Struct`` classes: defined
in a compiled module, a Struct loses the field types msgspec reads.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["Indexed", "Lifecycle", "LifecycleResponse"]


class LifecycleResponse(msgspec.Struct):
    """The ``response`` of a Responses lifecycle event: only what the books read."""

    id: Any = None
    usage: Any = None
    error: Any = None


class Lifecycle(msgspec.Struct):
    """A Responses lifecycle event (``response.created``, ``response.completed``...)."""

    response: LifecycleResponse | None = None


class Indexed(msgspec.Struct):
    """A streamed chat chunk's choice ``index``, and nothing else."""

    index: Any = 0
