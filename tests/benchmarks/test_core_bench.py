"""The in-process core benchmark runs its request path end to end (no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _printed(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter beside the benchmarks."""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_core_bench_runs_requests_through_the_core() -> None:
    code = (
        "import core_bench\n"
        "us = core_bench.run(1024, 'round_robin', rounds=1, n=50)\n"
        "print(us > 0)\n"
    )
    assert _printed(code) == "True"


def test_core_bench_runs_chat_requests_through_the_core() -> None:
    # A chat body to /v1/chat/completions with a chat answer: a body the route
    # refuses or a flow that does not relay fails the run.
    code = (
        "import core_bench\n"
        "us = core_bench.run(1024, 'round_robin', rounds=1, n=50, api='chat')\n"
        "print(us > 0)\n"
    )
    assert _printed(code) == "True"


def test_the_kv_index_bench_runs() -> None:
    code = (
        "import core_bench\n"
        "out = core_bench.kv_index(workers=2, prompt_tokens=1024, n=10)\n"
        "per, n = core_bench.kv_memory(workers=4, blocks=2000)\n"
        "print(sorted(out), n == 2000, per > 0)\n"
    )
    assert _printed(code) == (
        "['512 cached', 'all cached', 'keys (prepare)', 'none cached'] True True"
    )
