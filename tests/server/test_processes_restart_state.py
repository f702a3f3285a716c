"""What a child of ``meshkit serve --processes`` restarted by the supervisor knows of
the workers' states: with no probes, only what it copies from a sibling."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

from harness import wait_until
from server.test_processes import (
    CHAT,
    _client_of,
    _sleepy_config,
    children_of,
    fresh,
    processes_seen,
)


def _kill_a_child(gw: Any) -> int:
    """SIGKILL one child, wait until the supervisor started it again: its index."""
    parent = gw.popen.pid
    victim = children_of(parent)[-1]
    os.kill(victim, signal.SIGKILL)
    assert wait_until(
        lambda: len(children_of(parent)) == 2 and victim not in children_of(parent), timeout=60
    )
    assert wait_until(lambda: fresh(gw.url).json()["processes_up"] == 2, timeout=60)
    found = re.search(r"process (\d+) exited with code -9", "".join(gw.stderr))
    assert found is not None, "".join(gw.stderr)[-2000:]
    return int(found.group(1))


def test_a_restarted_child_copies_a_sleeping_worker_as_asleep(
    mock_factory: Any, spawn: Any, tmp_path: Path
) -> None:
    mock = mock_factory(name="s", sleep_mode=True, output_tokens=3, wake_ms=50)
    # No probes: nothing but its siblings can tell the new child the engine sleeps.
    cfg = _sleepy_config(tmp_path, mock.url, "probe = false")
    gw = spawn("serve", "--config", str(cfg), "--port", "0", "--processes", "2")
    assert wait_until(lambda: processes_seen(gw.url, 20) == {0, 1}, timeout=60)
    r = fresh(gw.url, "POST", "/workers/0/sleep")
    assert r.status_code == 200, r.text
    assert r.json()["processes"]["applied"] == 2
    index = _kill_a_child(gw)
    stats = mock.worker.stats
    with _client_of(gw.url, index) as c:
        (row,) = c.get(gw.url + "/workers").json()["workers"]
        assert row["state"] == "sleeping"  # the answering (restarted) child's own
        # Placed on a sleeping engine, it would get the engine's 503; asleep, it
        # is held while the engine is woken, once.
        r = c.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
    assert (stats.sleep_calls, stats.wake_calls) == (1, 1)
