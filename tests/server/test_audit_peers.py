"""Admin verbs of many processes, edge cases found by the lifecycle audit (real
gateways talking over their Unix sockets, as in ``test_peers``)."""

from __future__ import annotations

from typing import Any

from harness import wait_until
from lifecycle.conftest import FAST, SLEEPY
from meshkit import Worker
from server.test_peers import processes, run_dir, wid  # noqa: F401  (fixtures)

#: no probes: what a process believes comes from the admin verbs alone (a probe
#: would hide, a moment later, a state the verb left wrong)
QUIET = {**FAST, "probe": False}


def test_a_sleep_whose_wait_ran_out_leaves_every_process_asleep(
    processes: Any,  # noqa: F811
    mock_factory: Any,
) -> None:
    mock = mock_factory(name="sleepy", sleep_mode=True)
    procs = processes(2, [Worker(mock.url, labels=SLEEPY)], lifecycle=QUIET)
    r = procs[0].client.post(f"/workers/{wid(mock.url)}/sleep", params={"timeout_s": 0})
    assert r.status_code == 504, (r.status_code, r.text[:300])
    assert r.json()["error"]["code"] == "sleep_timeout"
    # The sleep was not abandoned: the engine sleeps, and no process may keep
    # placing requests on it as if it were awake.
    assert wait_until(lambda: mock.worker.stats.sleep_calls == 1)
    assert wait_until(lambda: procs[0].local_rows()[0]["state"] == "sleeping")
    assert [p.local_rows()[0]["state"] for p in procs] == ["sleeping"] * 2
