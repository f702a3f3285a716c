"""The ext-proc benchmark runs end to end (``benchmarks/extproc_bench.py --smoke``):
every mode served requests through its Envoy, without errors. No timing assertion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import EXTPROC

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not EXTPROC,
    reason="needs Linux (/proc), grpcio and an envoy binary (the test extra)",
)


def test_smoke_measures_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "extproc.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "extproc_bench.py"),
            "--smoke",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["mode"] for r in rows} == {"full-duplex", "buffered", "envoy-alone"}
    for r in rows:
        assert r["ok"] > 0 and r["errors"] == 0, r
        assert (r["picker_us"] is None) == (r["mode"] == "envoy-alone"), r
