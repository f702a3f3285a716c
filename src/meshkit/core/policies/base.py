"""
The Policy protocol
===================

A policy picks one candidate among the eligible ones. Placement has already
filtered by API, topology, model, health and Responses state, so a policy only
ranks. It is pure: no clocks, sockets or threads; randomness comes from the
``rng`` in the context so tests can seed it.

A policy declares what preparation must produce for it (:class:`Needs`): nothing
(round robin), the routing text (cache-aware), or the first ``N`` token ids
(prefix hash). The prepare stage produces exactly that, in one job.

Hooks let stateful policies learn: :meth:`Policy.on_placed` after a decision,
:meth:`Policy.on_complete` when the response has ended (with its TTFT and usage),
:meth:`Policy.on_removed` when a worker leaves. The ``Mesh`` calls them under its
lock, so a policy needs no locking of its own.

Writing a plugin::

    from meshkit.core.policies import BasePolicy, Needs, PlacementContext

    class FirstHealthy(BasePolicy):
        name = "first_healthy"
        def select(self, ctx: PlacementContext) -> Candidate:
            return ctx.candidates[0]

and register it under the ``meshkit.policies`` entry-point group, or pass an
instance: ``Mesh(policy=FirstHealthy())``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from meshkit.core.policies.context import PlacementContext
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker

__all__ = ["BasePolicy", "Completion", "Needs", "PlacementContext", "Policy", "merged"]


@dataclass(frozen=True, slots=True)
class Needs:
    """What a policy reads from the request."""

    text: bool = False
    #: the number of leading token ids the policy reads (None: no tokens)
    prefix_tokens: int | None = None
    #: how many characters of routing text the policy reads (None: all)
    prefix_chars: int | None = None
    #: match against the workers' KV events: the engine's prompt token ids
    #: (``RequestView.prompt_ids``) while some worker publishes them
    kv_events: bool = False


def merged(*needs: Needs) -> Needs:
    """What several policies read from one request (a prefill/decode fleet's)."""
    tokens = [n.prefix_tokens for n in needs if n.prefix_tokens is not None]
    # how far the text is read: as far as the farthest reader reads (None: all)
    chars = [n.prefix_chars for n in needs if n.text or n.prefix_tokens is not None]
    limits = [c for c in chars if c is not None]
    return Needs(
        text=any(n.text for n in needs),
        prefix_tokens=max(tokens) if tokens else None,
        prefix_chars=max(limits) if limits and len(limits) == len(chars) else None,
        kv_events=any(n.kv_events for n in needs),
    )


@dataclass(frozen=True, slots=True)
class Completion:
    """What the accounting learned about one finished response."""

    status: int
    ok: bool
    ttft: float | None = None
    duration: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    response_id: str | None = None
    extra: Mapping[str, object] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    name: str
    needs: Needs

    def select(self, ctx: PlacementContext) -> Candidate: ...

    def on_placed(self, cand: Candidate, view: RequestView, now: float) -> None: ...

    def on_complete(
        self, cand: Candidate, view: RequestView, done: Completion, now: float
    ) -> None: ...

    def on_removed(self, worker: Worker) -> None: ...


class BasePolicy:
    """Convenience base: no-op hooks, no needs."""

    name: str = "base"
    needs: Needs = Needs()

    def select(self, ctx: PlacementContext) -> Candidate:  # pragma: no cover
        raise NotImplementedError

    def on_placed(self, cand: Candidate, view: RequestView, now: float) -> None:
        return None

    def on_complete(self, cand: Candidate, view: RequestView, done: Completion, now: float) -> None:
        return None

    def on_removed(self, worker: Worker) -> None:
        return None
