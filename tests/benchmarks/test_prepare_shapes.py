"""benchmarks/prepare_shapes.py: its bodies are what their names say (valid chat
requests, from one message to an agent's session with JSON inside strings), and it
measures them here and under a base checkout's interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from prepare_shapes import SHAPES  # noqa: E402


def test_the_shapes_are_the_requests_they_are_named_for() -> None:
    bodies = {name: make() for name, make in SHAPES.items()}
    assert bodies == {name: make() for name, make in SHAPES.items()}  # deterministic
    for name, body in bodies.items():
        messages = json.loads(body)["messages"]
        assert all(m["role"] in ("system", "user", "assistant", "tool") for m in messages), name
    assert len(bodies["one message, 1 KiB"]) == 1024
    assert len(bodies["one message, 1 MiB"]) == 1 << 20
    agent = json.loads(bodies["agent: 100 turns, 10 tools"])
    assert len(agent["tools"]) == 10
    assert sum(1 for m in agent["messages"] if m.get("tool_calls")) == 100
    # tool arguments and results are JSON inside strings: escaped quotes
    assert bodies["agent: 100 turns, 10 tools"].count(b'\\"') > 1_000
    openers = [b.count(b"{") + b.count(b"[") for b in bodies.values()]
    assert openers[0] < 64 < max(openers)  # both sides of bounds.max_json_depth


def test_it_measures_here_and_under_a_base(tmp_path: Path) -> None:
    # a base checkout is a directory with .venv/bin/python: here, this interpreter
    # (a script: a symlink would lose the virtual environment it belongs to)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "prepare_shapes.py"), "--base", str(tmp_path),
         "--rounds", "1", "--loop-s", "0.002"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| ") and "µs" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == list(SHAPES)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 10, row
        prepare, depth, decode = (float(c.replace(",", "")) for c in cells[3:6])
        assert prepare > 0 and depth > 0 and decode > 0, row
