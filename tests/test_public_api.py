"""``meshkit.__all__``: sorted, complete, importable."""

from __future__ import annotations

import importlib

import meshkit

# the entry points of README.md and docs/quickstart.md (tests outside the repo use these)
DESIGN_NAMES = {
    "Mesh",
    "Worker",
    "MeshMiddleware",
    "MeshWSGIMiddleware",
    "MeshTransport",
    "AsyncMeshTransport",
}
# the documented public names: those plus config, errors and the policy protocol
PUBLIC = [
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


def test_all_is_sorted() -> None:
    assert list(meshkit.__all__) == sorted(meshkit.__all__)
    assert len(set(meshkit.__all__)) == len(meshkit.__all__)


def test_all_is_the_documented_names() -> None:
    assert list(meshkit.__all__) == PUBLIC
    assert set(meshkit.__all__) >= DESIGN_NAMES


def test_every_name_is_importable() -> None:
    fresh = importlib.import_module("meshkit")
    for name in meshkit.__all__:
        obj = getattr(fresh, name)
        assert obj is not None
        assert getattr(obj, "__name__", name) == name
    ns: dict[str, object] = {}
    exec("from meshkit import *", ns)
    assert set(meshkit.__all__) <= set(ns)


def test_public_objects_come_from_their_modules() -> None:
    from meshkit.core.workers import Worker
    from meshkit.errors import ConfigError, MeshError
    from meshkit.mesh import Mesh

    assert meshkit.Mesh is Mesh
    assert meshkit.Worker is Worker
    assert meshkit.MeshError is MeshError
    assert issubclass(meshkit.ConfigError, ValueError)
    assert meshkit.ConfigError is ConfigError


def test_version() -> None:
    assert isinstance(meshkit.__version__, str)
    assert meshkit.__version__.count(".") >= 1
