"""
Deprecated: the front ends moved to :mod:`meshkit.frontends` (0.2).

``meshkit.adapters.asgi``, ``.wsgi`` and ``.transport`` still import, with a
``DeprecationWarning``; the public names have always been importable from
``meshkit`` itself (``from meshkit import MeshMiddleware``), which is the way to
import them.
"""

from __future__ import annotations

import importlib
import sys
import warnings

warnings.warn(
    "meshkit.adapters is deprecated: import from meshkit (or meshkit.frontends)",
    DeprecationWarning,
    stacklevel=2,
)

for _name in ("asgi", "wsgi", "transport"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"meshkit.frontends.{_name}")
