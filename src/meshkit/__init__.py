"""
meshkit
=======

Places LLM inference requests (OpenAI chat/completions and Responses, Anthropic
Messages, SGLang /generate) on a fleet of inference workers. One pure routing core,
wrapped four ways:

- :class:`MeshMiddleware` (ASGI) and :class:`MeshWSGIMiddleware` (WSGI);
- :class:`MeshTransport` / :class:`AsyncMeshTransport` for httpx and httpx2 clients;
- ``meshkit serve``, a standalone gateway.

``import meshkit`` is light: the front ends, and the HTTP clients, tokenizers,
template engine and WSGI library they need, are imported when first used.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
from typing import TYPE_CHECKING, Any

from meshkit.config import MeshConfig
from meshkit.core.policies.base import BasePolicy, Completion, Needs, PlacementContext, Policy
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker
from meshkit.errors import ConfigError, MeshError
from meshkit.mesh import Mesh

if TYPE_CHECKING:
    from meshkit.frontends.asgi import MeshMiddleware
    from meshkit.frontends.transport import AsyncMeshTransport, MeshTransport
    from meshkit.frontends.wsgi import MeshWSGIMiddleware

__version__ = "0.1.0"

#: the front ends, imported on first use (name -> module)
_LAZY = {
    "AsyncMeshTransport": "meshkit.frontends.transport",
    "MeshMiddleware": "meshkit.frontends.asgi",
    "MeshTransport": "meshkit.frontends.transport",
    "MeshWSGIMiddleware": "meshkit.frontends.wsgi",
}


def compiled() -> bool:
    """Whether this is the compiled build: the request path's modules are C
    extensions mypyc built from their source (a wheel; ``hatch_build.py``), not
    interpreted (an editable install, or ``MESHKIT_COMPILE=0``). Both behave alike;
    the compiled one spends about half the CPU per proxied request under load
    (``benchmarks/RESULTS.md``)."""
    spec = importlib.util.find_spec("meshkit.router")
    origin = spec.origin if spec is not None else None
    return origin is not None and origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def build() -> str:
    """``"compiled"`` or ``"interpreted"`` (:func:`compiled`): what ``--version``,
    ``/health`` and the benchmarks' reports name."""
    return "compiled" if compiled() else "interpreted"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AsyncMeshTransport",
    "BasePolicy",
    "Candidate",
    "Completion",
    "ConfigError",
    "Mesh",
    "MeshConfig",
    "MeshError",
    "MeshMiddleware",
    "MeshTransport",
    "MeshWSGIMiddleware",
    "Needs",
    "PlacementContext",
    "Policy",
    "RequestView",
    "Worker",
    "build",
    "compiled",
]
