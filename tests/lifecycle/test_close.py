"""Closing a Mesh ends its lifecycle thread, also when a wake-up of its tasks (a
fleet change, a kick) arrives in the same loop turn as the stop."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from harness import wait_until
from lifecycle.conftest import FAST
from meshkit import Mesh
from meshkit.mock import MockWorkerThread


def test_close_ends_the_thread_when_a_kick_races_the_stop(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    w = mock_factory(name="a")
    # Python 3.11's asyncio.wait_for returns the inner result and drops a cancel that
    # lands in the same turn, so a poked loop used to go on until close's join timed
    # out (10 s) and left the thread running.
    for _ in range(5):
        mesh = mesh_factory(workers=[w.worker.url], lifecycle=FAST)
        life = mesh.lifecycle
        life.start()
        thread = life._thread
        assert thread is not None and wait_until(
            cast(Callable[[], bool], lambda life=life: life.running)
        )
        life.kick()  # the probe loop's and the KV sync's events
        mesh.close()
        assert not thread.is_alive()
