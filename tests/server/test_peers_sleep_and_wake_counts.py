"""Admin verbs of many processes, edge cases (real
gateways talking over their Unix sockets, as in ``test_peers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import wait_until
from lifecycle.conftest import CHAT, FAST, PATH, SLEEPY
from meshkit import Worker
from server.test_peers import processes, run_dir, samples, wid  # noqa: F401  (fixtures)
from server.test_processes import _client_of, fresh, processes_seen

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


def test_one_engine_wake_is_counted_once_over_the_processes(
    mock_factory: Any, spawn: Any, tmp_path: Path
) -> None:
    # mesh_wakes_total is "wakes started", summed over the processes of the
    # merged /metrics; process 1 has process 0 wake the engine (the wake gate):
    # that is one call to the engine, and one wake.
    mock = mock_factory(name="sleepy", sleep_mode=True, wake_ms=50)
    config = tmp_path / "meshkit.toml"
    config.write_text(
        "[lifecycle]\nprobe = false\nwake_wait_s = 20.0\n"
        f'[[workers]]\nurl = "{mock.url}"\nlabels = {{ "mesh.sleep_mode" = "vllm" }}\n'
    )
    gw = spawn("serve", "--config", str(config), "--port", "0", "--processes", "2")
    assert wait_until(lambda: fresh(gw.url, path="/readiness").status_code == 200, timeout=60)
    assert wait_until(lambda: processes_seen(gw.url, 20) == {0, 1}, timeout=60)
    r = fresh(gw.url, "POST", f"/workers/{wid(mock.url)}/sleep")
    assert r.status_code == 200, r.text
    assert r.json()["processes"]["applied"] == 2
    assert mock.worker.stats.sleep_calls == 1
    with _client_of(gw.url, 1) as c:
        r = c.post(gw.url + PATH, json=CHAT)  # held while process 0 wakes it
        assert r.status_code == 200, r.text
    assert mock.worker.stats.wake_calls == 1
    text = fresh(gw.url, path="/metrics").text
    assert samples(text, "mesh_gateway_processes_up") == [({}, 2.0)]
    assert sum(v for _, v in samples(text, "mesh_sleeps_total")) == 1
    assert sum(v for _, v in samples(text, "mesh_wakes_total")) == 1
