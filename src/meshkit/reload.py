"""
Reloading a running mesh
========================

:meth:`Mesh.reconfigure <meshkit.Mesh.reconfigure>` (and so ``meshkit serve`` on
SIGHUP) applies a new :class:`~meshkit.config.MeshConfig` without a restart:

* ``workers`` (static and ``dns://`` entries) and ``workers_file``: workers added,
  changed ones (labels, key, TLS options) swapped in place with their leases, and
  those gone drained, then removed (:mod:`meshkit.lifecycle.discovery`);
* ``policy`` and ``policies``: a policy whose name or options changed is rebuilt
  (its learned state starts afresh); an unchanged one keeps what it learned.

Everything that can fail is checked before anything changes: a configuration that
does not build, a policy that does not construct or a workers file that does not
load leaves the running configuration as it was. The other keys (pool sizes,
bounds, the server's address ...) need a restart; :attr:`Reload.restart` names the
ones that differ.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshkit.config import RELOADABLE, MeshConfig
from meshkit.core.discovery import FleetPlan
from meshkit.core.policies.base import Policy
from meshkit.core.policies.registry import create_policy

if TYPE_CHECKING:
    from meshkit.mesh import Mesh

__all__ = ["Reload", "reconfigure"]


@dataclass(frozen=True)
class Reload:
    """What a reload changed."""

    fleet: FleetPlan
    #: the placement policy was rebuilt (its name or options changed)
    policy: bool
    #: keys that differ from the running configuration but need a restart
    restart: tuple[str, ...]

    def summary(self) -> str:
        parts = [f"workers: {self.fleet.summary()}"]
        parts.append("policy rebuilt" if self.policy else "policy unchanged")
        if self.restart:
            parts.append(f"restart to apply: {', '.join(self.restart)}")
        return "; ".join(parts)


def _options(config: MeshConfig, name: Any) -> Any:
    return config.policies.get(name, {}) if isinstance(name, str) else None


def reconfigure(mesh: Mesh, config: MeshConfig, *, timeout_s: float) -> Reload:
    """See the module docstring; :meth:`Mesh.reconfigure` is the public entry."""
    old = mesh.config
    policy = None
    if config.policy != old.policy or _options(old, config.policy) != _options(
        config, config.policy
    ):
        policy = create_policy(config.policy, _options(config, config.policy))
    # The PD policies' names are [pd] keys (a restart); their options are reloaded.
    pd: dict[str, Policy] = {}
    for role in ("prefill", "decode"):
        name = getattr(old.pd, f"{role}_policy")
        if config.policies.get(name, {}) != old.policies.get(name, {}):
            pd[role] = create_policy(name, config.policies.get(name, {}))
    discovery = mesh.lifecycle.discovery
    assert discovery is not None
    future = mesh.lifecycle.submit(lambda: discovery.reconfigure(config))
    try:
        fleet = future.result(timeout_s)
    except concurrent.futures.CancelledError:
        raise RuntimeError("the mesh is closed") from None
    mesh.router.set_policy(policy, prefill=pd.get("prefill"), decode=pd.get("decode"))
    applied = dataclasses.replace(old, **{k: getattr(config, k) for k in RELOADABLE})
    mesh.config = mesh.router.config = applied
    restart = tuple(
        f.name
        for f in dataclasses.fields(MeshConfig)
        if f.name not in RELOADABLE and getattr(old, f.name) != getattr(config, f.name)
    )
    return Reload(fleet, policy is not None, restart)
