"""
One ``GET /workers`` for many processes
=======================================

Each process of ``meshkit serve --processes N`` keeps its own books of every worker
(its in-flight requests, its leases, its breaker). The listing a client gets is
this process's rows merged with its siblings' (:mod:`meshkit.server.peers`), per
worker ``id``, field by field:

=====================================  ============================================
``load``, ``leases``, ``breaker_trips``  summed: each process counts only its own
                                       requests
``activity``                           ``active`` when any process is; ``idle``
                                       when all are, with the shortest ``idle_s``;
                                       else this process's (``unknown``: untracked)
everything else                        this process's: identity (``id``, ``url``,
                                       ``labels``, ``models``, ``sleep_mode``,
                                       ``tracked``), and what it decides on alone
                                       (``state``, ``healthy``, ``breaker``,
                                       ``prefix_match``, ``kv_blocks``,
                                       ``kv_silent``, ``kv_heard_s``: each
                                       process keeps its own index;
                                       ``engine_load``: the engine's own count)
``processes``                          added: ``{"<index>": {load, leases,
                                       breaker_trips, activity, state, breaker,
                                       healthy}}`` of each process that answered
=====================================  ============================================

A worker only siblings list (their fleets diverged: a sibling down during an admin
verb) is listed too, from the lowest such sibling, with ``index`` None (it has no
index here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PER_PROCESS", "SUMMED", "merge_row", "merge_rows"]

#: summed over the processes
SUMMED = ("load", "leases", "breaker_trips")
#: copied from each process into ``processes``
PER_PROCESS = (*SUMMED, "activity", "state", "breaker", "healthy")


def _activity(rows: Sequence[dict[str, Any]]) -> Any:
    acts = [r.get("activity") for r in rows]
    kinds = [a.get("kind") if isinstance(a, dict) else None for a in acts]
    if "active" in kinds:
        return {"kind": "active"}
    if kinds and all(k == "idle" for k in kinds):
        idle = [a.get("idle_s") for a in acts if isinstance(a, dict)]
        numbers = [s for s in idle if isinstance(s, int | float)]
        if numbers:
            return {"kind": "idle", "idle_s": min(numbers)}
    return acts[0]


def merge_row(
    row: dict[str, Any], index: int, siblings: Sequence[tuple[int, dict[str, Any]]]
) -> dict[str, Any]:
    """``row`` (process ``index``'s) merged with the siblings' rows of the same worker."""
    rows = [row, *(r for _, r in siblings)]
    out = dict(row)
    for key in SUMMED:
        values = [r.get(key) for r in rows]
        out[key] = sum(v for v in values if isinstance(v, int | float) and not isinstance(v, bool))
    out["activity"] = _activity(rows)
    out["processes"] = {
        str(i): {k: r.get(k) for k in PER_PROCESS}
        for i, r in sorted([(index, row), *siblings], key=lambda t: t[0])
    }
    return out


def merge_rows(
    rows: Sequence[dict[str, Any]],
    index: int,
    siblings: Sequence[tuple[int, Sequence[Any]]],
) -> list[dict[str, Any]]:
    """This process's ``GET /workers`` rows merged with the siblings' ``(index, rows)``."""
    by_id: dict[Any, list[tuple[int, dict[str, Any]]]] = {}
    order: list[Any] = []
    for i, theirs in sorted(siblings, key=lambda t: t[0]):
        for r in theirs:
            if isinstance(r, dict) and "id" in r:
                if r["id"] not in by_id:
                    by_id[r["id"]] = []
                    order.append(r["id"])
                by_id[r["id"]].append((i, r))
    mine = {r.get("id") for r in rows}
    out = [merge_row(r, index, by_id.get(r.get("id"), [])) for r in rows]
    for wid in order:
        if wid not in mine:
            (first, row), *rest = by_id[wid]
            merged = merge_row(row, first, rest)
            merged["index"] = None
            out.append(merged)
    return out
