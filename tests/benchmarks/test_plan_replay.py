"""``benchmarks/plan_replay.py``: the plan replay of a multi_router dump (no processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import plan_replay  # noqa: E402


def _row(
    i: int, conv: int, turn: int, tenant: int, router: int, worker: str, run: int = 0
) -> dict[str, Any]:
    return {
        "run": run,
        "workload": "zipf C=2",
        "config": "prefix_hash",
        "k": 2,
        "router": router,
        "worker": worker,
        "status": 200,
        "prompt": 100,
        "cached": 0,
        "t_send": float(i),
        "t_done": float(i) + 0.5,
        "conv": conv,
        "turn": turn,
        "tenant": tenant,
    }


def _two_turns(tenants: int, moved_every: int) -> list[dict[str, Any]]:
    """Conversations of two turns on alternating routers; every ``moved_every``-th
    conversation's second turn goes to another worker than its first."""
    rows = []
    for conv in range(40):
        tenant = conv % tenants
        first = f"w{conv % 4}"
        second = f"w{(conv + 1) % 4}" if conv % moved_every == 0 else first
        rows.append(_row(2 * conv, conv, 0, tenant, conv % 2, first))
        rows.append(_row(2 * conv + 1, conv, 1, tenant, (conv + 1) % 2, second))
    return rows


def test_replay_counts_the_runs_moves_per_tenant() -> None:
    follow, run, plan = plan_replay.replay(_two_turns(tenants=2, moved_every=4))
    assert sum(follow.values()) == 40
    assert sum(run.values()) == 10  # conversations 0, 4, 8, ...: all tenant 0
    assert run[0] == 10 and run[1] == 0
    assert 0 <= sum(plan.values()) <= 40


def test_one_hot_prefix_is_split_by_conversation_so_its_turns_stay() -> None:
    # One tenant is all the traffic: the plan gives it every worker, and a
    # conversation's slot is a hash of the conversation, the same at both routers
    # once both plans have it on every worker.
    rows = []
    for conv in range(400):
        rows.append(_row(2 * conv, conv, 0, 0, conv % 2, "w0"))
        rows.append(_row(2 * conv + 1, conv, 1, 0, (conv + 1) % 2, "w0"))
    for w in range(1, 4):  # the ring needs the fleet's workers
        rows.append(_row(900 + w, 1000 + w, 0, 0, 0, f"w{w}"))
    _, run, plan = plan_replay.replay(rows)
    assert sum(run.values()) == 0
    assert sum(plan.values()) <= 10  # only while the first plans are being made


def test_main_reads_runs_apart_and_refuses_a_dump_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = tmp_path / "dump.jsonl"
    rows = _two_turns(tenants=3, moved_every=5)
    # A repeat: the same conversation numbers again, in a block of its own.
    rows += [dict(r, run=1, t_send=r["t_send"] + 1000) for r in _two_turns(3, 1000)]
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plan_replay.main([str(dump)]) == 0
    out = capsys.readouterr().out
    assert out.count("zipf C=2, K = 2: follow-ups moved") == 2
    assert "moved 8 in the run" in out  # the first repeat: 0, 5, ..., 35
    assert "moved 1 in the run" in out  # the second: conversation 0 only
    assert plan_replay.main([str(dump), "--config", "cache_aware"]) == 1
