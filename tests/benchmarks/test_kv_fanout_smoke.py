"""``benchmarks/kv_fanout.py`` in small: a publisher's batches reach every
subscriber directly and through ``meshkit kv-relay``, and only the direct way
sends the publisher's host one copy per subscriber."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_fanout.py"


def test_fanout_direct_and_through_the_relay(tmp_path: Path) -> None:
    out = tmp_path / "fanout.md"
    text = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--subscribers",
            "3",
            "--seconds",
            "0.5",
            "--rate",
            "40",
            "--size",
            "4096",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = re.findall(r"N=\s*3 (direct|relay)\s.* egress\s+([\d.]+) MB/s .* got (\d+)/(\d+)", text)
    assert [way for way, *_ in rows] == ["direct", "relay"], text
    for _, _, got, sent in rows:
        assert int(got) == int(sent) > 0  # every subscriber got every batch
    direct, relay = (float(egress) for _, egress, _, _ in rows)
    assert direct == pytest.approx(3 * relay, rel=0.05)  # N copies against one
    assert "| 3 | relay |" in out.read_text()
