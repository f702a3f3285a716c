"""
meshkit.policies: what a placement-policy plugin imports
========================================================

A policy is a class with ``name``, ``needs`` and ``select(ctx) -> Candidate``
(:class:`Policy`; subclass :class:`BasePolicy` for the optional hooks), registered
under an entry point of the ``meshkit.policies`` group or with
:func:`register_policy`. ``docs/policies.md`` walks through one::

    from meshkit.policies import BasePolicy, Candidate, Needs, PlacementContext

    class FirstHealthy(BasePolicy):
        name = "first_healthy"
        needs = Needs()

        def select(self, ctx: PlacementContext) -> Candidate:
            return ctx.candidates[0]

Every name here is stable; the modules under ``meshkit.core`` that define them
may move. :func:`resolve` (the endpoint of a request line) is here to build a
:class:`RequestView` in a policy's tests.
"""

from __future__ import annotations

from meshkit.core.endpoints import resolve
from meshkit.core.policies.base import BasePolicy, Completion, Needs, PlacementContext, Policy
from meshkit.core.policies.registry import available, create_policy, register_policy
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker
from meshkit.errors import ConfigError

__all__ = [
    "BasePolicy",
    "Candidate",
    "Completion",
    "ConfigError",
    "Needs",
    "PlacementContext",
    "Policy",
    "RequestView",
    "Worker",
    "available",
    "create_policy",
    "register_policy",
    "resolve",
]
