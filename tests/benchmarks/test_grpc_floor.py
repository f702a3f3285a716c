"""``benchmarks/grpc_floor.py`` runs: a do-nothing ext_proc server on grpcio's
asyncio server answers every message of every stream. No timing assertion."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed (the test extra)")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="taskset, /proc")
def test_every_stream_is_answered_and_measured() -> None:
    script = REPO / "benchmarks" / "grpc_floor.py"
    argv = ["--messages", "1,3", "--streams", "30", "--server-cpu", "0", "--client-cpu", "0"]
    proc = subprocess.run(
        [sys.executable, str(script), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "3"]
    assert all(int(wall) > 0 for _, _, wall in rows)
    assert "one more exchange" in proc.stdout
