"""Placement policies: the Policy protocol, the built-ins and the plugin registry."""

from __future__ import annotations

from meshkit.core.policies.affinity import ResponsesAffinity, SessionAffinity
from meshkit.core.policies.base import BasePolicy, Completion, Needs, PlacementContext, Policy
from meshkit.core.policies.cache_aware import CacheAware
from meshkit.core.policies.prefix_hash import PrefixHash
from meshkit.core.policies.radix import RadixTree
from meshkit.core.policies.registry import available, create_policy, register_policy
from meshkit.core.policies.ring import HashRing
from meshkit.core.policies.simple import LeastLoad, PowerOfTwo, RandomPolicy, RoundRobin

__all__ = [
    "BasePolicy",
    "CacheAware",
    "Completion",
    "HashRing",
    "LeastLoad",
    "Needs",
    "PlacementContext",
    "Policy",
    "PowerOfTwo",
    "PrefixHash",
    "RadixTree",
    "RandomPolicy",
    "ResponsesAffinity",
    "RoundRobin",
    "SessionAffinity",
    "available",
    "create_policy",
    "register_policy",
]
