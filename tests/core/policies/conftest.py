"""Builders for placement contexts: policies are pure, so tests call them directly."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import pytest

from meshkit.core.endpoints import resolve
from meshkit.core.kv_index import KvIndex
from meshkit.core.policies import PlacementContext
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker

CHAT = resolve("POST", "/v1/chat/completions")
assert CHAT is not None


def cands(n: int, start: int = 1, dp: int = 1) -> list[Candidate]:
    """``n`` workers ``http://127.0.0.1:9001``... (each with ``dp`` ranks)."""
    out: list[Candidate] = []
    for i in range(start, start + n):
        labels = {"mesh.dp_size": str(dp)} if dp > 1 else None
        w = Worker(f"http://127.0.0.1:{9000 + i}", labels=labels)
        if dp > 1:
            out.extend(Candidate(w, r) for r in range(dp))
        else:
            out.append(Candidate(w))
    return out


def view(
    text: str = "",
    *,
    token_ids: list[int] | None = None,
    routing_key: str | None = None,
    model: str | None = None,
    prompt_ids: list[int] | None = None,
) -> RequestView:
    assert CHAT is not None
    return RequestView(
        match=CHAT,
        routing_text=text,
        token_ids=token_ids,
        routing_key=routing_key,
        model=model,
        prompt_weight=len(text),
        prompt_ids=prompt_ids,
    )


def ctx(
    candidates: Sequence[Candidate],
    v: RequestView | None = None,
    *,
    load: Mapping[str, int] | None = None,
    weight: Mapping[str, int] | None = None,
    fleet: Sequence[Candidate] | None = None,
    version: int = 1,
    seed: int = 0,
    now: float = 0.0,
    kv: KvIndex | None = None,
) -> PlacementContext:
    return PlacementContext(
        candidates=list(candidates),
        view=v if v is not None else view(),
        load=dict(load or {}),
        weight=dict(weight or {}),
        rng=random.Random(seed),
        fleet=list(fleet if fleet is not None else candidates),
        fleet_version=version,
        now=now,
        kv=kv,
    )


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """``kit.cands(n)``, ``kit.view(text, ...)``, ``kit.ctx(cands, view, load=...)``."""
    return SimpleNamespace(cands=cands, view=view, ctx=ctx)
