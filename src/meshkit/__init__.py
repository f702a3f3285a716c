"""
meshkit
=======

Places LLM inference requests (OpenAI chat/completions and Responses, Anthropic
Messages, SGLang /generate) on a fleet of inference workers. One pure routing core,
wrapped four ways:

- :class:`MeshMiddleware` (ASGI) and :class:`MeshWSGIMiddleware` (WSGI);
- :class:`MeshTransport` / :class:`AsyncMeshTransport` for httpx and httpx2 clients;
- ``meshkit serve``, a standalone gateway.
"""

from __future__ import annotations

from meshkit.config import MeshConfig
from meshkit.core.policies.base import BasePolicy, Completion, Needs, PlacementContext, Policy
from meshkit.core.workers import Worker
from meshkit.errors import ConfigError, MeshError
from meshkit.frontends.asgi import MeshMiddleware
from meshkit.frontends.transport import AsyncMeshTransport, MeshTransport
from meshkit.frontends.wsgi import MeshWSGIMiddleware
from meshkit.mesh import Mesh

__version__ = "0.1.0"

__all__ = [
    "AsyncMeshTransport",
    "BasePolicy",
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
    "Worker",
]
