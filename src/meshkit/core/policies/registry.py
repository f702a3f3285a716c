"""
Policy registry
===============

Names map to import strings, resolved at first use (like uvicorn's protocol table
and fsspec's registry): a built-in name, then the ``meshkit.policies`` entry-point
group. A missing plugin is a :class:`~meshkit.errors.ConfigError` that names the
policy and the package to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

from meshkit.core.policies.base import Policy
from meshkit.errors import ConfigError

__all__ = ["BUILTIN", "available", "create_policy", "register_policy"]

ENTRY_POINT_GROUP = "meshkit.policies"

_builtin: dict[str, str] = {
    "round_robin": "meshkit.core.policies.simple:RoundRobin",
    "random": "meshkit.core.policies.simple:RandomPolicy",
    "power_of_two": "meshkit.core.policies.simple:PowerOfTwo",
    "least_load": "meshkit.core.policies.simple:LeastLoad",
    "prefix_hash": "meshkit.core.policies.prefix_hash:PrefixHash",
    "cache_aware": "meshkit.core.policies.cache_aware:CacheAware",
    "session": "meshkit.core.policies.affinity:SessionAffinity",
}
_registered: dict[str, Any] = {}
BUILTIN: Mapping[str, str] = MappingProxyType(_builtin)


def register_policy(name: str, factory: Any, *, clobber: bool = False) -> None:
    """Register a policy class/factory (or an ``"module:attr"`` string) under ``name``."""
    if not clobber and (name in _registered or name in _builtin):
        raise ValueError(f"policy {name!r} is already registered")
    _registered[name] = factory


def available() -> list[str]:
    names = set(_builtin) | set(_registered)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def _load(target: str, name: str) -> Any:
    module, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            "policy", f"policy {name!r} needs module {module!r}, which is not installed ({exc})"
        ) from exc
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _factory(name: str) -> Any:
    if name in _registered:
        f = _registered[name]
        return _load(f, name) if isinstance(f, str) else f
    if name in _builtin:
        return _load(_builtin[name], name)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                return ep.load()
            except ImportError as exc:
                dist = ep.dist.name if ep.dist else "its package"
                raise ConfigError(
                    "policy", f"policy {name!r} from {dist} failed to import: {exc}"
                ) from exc
    raise ConfigError(
        "policy",
        f"unknown policy {name!r}; built-in: {', '.join(sorted(_builtin))}. A plugin policy "
        f"needs its package installed (entry-point group {ENTRY_POINT_GROUP!r}).",
    )


def create_policy(spec: str | Policy, options: Mapping[str, Any] | None = None) -> Policy:
    """Build a policy from a name (with options) or return an instance unchanged."""
    if not isinstance(spec, str):
        if not isinstance(spec, Policy):
            raise ConfigError("policy", f"{spec!r} does not implement the Policy protocol")
        return spec
    factory = _factory(spec)
    try:
        policy = factory(**dict(options or {}))
    except TypeError as exc:
        raise ConfigError(f"policies.{spec}", f"bad options for policy {spec!r}: {exc}") from exc
    if not isinstance(policy, Policy):
        raise ConfigError("policy", f"{spec!r} did not build a Policy")
    return policy
