"""Sleeps of many processes: the engine is put to sleep only after every sibling
agreed, by the idle sleep (process 0) and the admin's alike (real gateways talking
over their Unix sockets, as in ``test_peers``, wired as ``serve --processes`` wires
them)."""

from __future__ import annotations

from typing import Any

from harness import wait_until
from lifecycle.conftest import CHAT, PATH, SLEEPY
from meshkit import Worker
from reliability.rawworker import QuietHandler, Served
from server.test_peers import LONG, processes, run_dir, wid  # noqa: F401  (fixtures)

#: no probes: what a process believes comes from the sleeps and their rollbacks alone
IDLE = {"probe": False, "idle_sleep_s": 0.1}


class SleepRefuser(Served):
    """A sleep-mode engine whose ``POST /sleep`` fails (500): ``sleep_calls``."""

    def __init__(self) -> None:
        self.sleep_calls = 0
        outer = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path.startswith("/sleep"):
                    outer.sleep_calls += 1
                self.send_response(500)
                self.send_header("content-length", "0")
                self.end_headers()

        super().__init__(Handler)


def _states(procs: list[Any]) -> list[str]:
    return [p.local_rows()[0]["state"] for p in procs]


def test_an_idle_sleep_that_went_ahead_leaves_nothing_in_the_gate(
    processes: Any,  # noqa: F811
    mock_factory: Any,
) -> None:
    mock = mock_factory(name="sleepy", sleep_mode=True)
    procs = processes(2, [Worker(mock.url, labels=SLEEPY)], gates=True, lifecycle=IDLE)
    wid = procs[0].mesh.workers[0].id
    assert wait_until(lambda: mock.worker.stats.sleep_calls == 1)
    assert wait_until(lambda: _states(procs) == ["sleeping"] * 2)
    # Workers come and go (discovery, autoscaling): what the gate kept for one
    # sleep must end with it, not stay keyed by the worker's id for good.
    gate = procs[0].mesh.lifecycle.sleep_gate
    assert wid not in repr(vars(gate))


def test_an_engine_that_did_not_go_to_sleep_wakes_every_sibling_again(
    processes: Any,  # noqa: F811
) -> None:
    engine = SleepRefuser()
    try:
        procs = processes(2, [Worker(engine.url, labels=SLEEPY)], gates=True, lifecycle=IDLE)
        # Process 1 agreed (asleep, state only), then the engine refused: it is
        # rolled back, or it would hold requests for a wake nobody needs.
        assert wait_until(lambda: engine.sleep_calls >= 2)
        assert wait_until(lambda: _states(procs) == ["ready"] * 2)
        gate = procs[0].mesh.lifecycle.sleep_gate
        wid = procs[0].mesh.workers[0].id
        assert wait_until(lambda: wid not in repr(vars(gate)))
    finally:
        engine.close()


def test_an_admin_sleep_does_not_go_ahead_past_a_sibling_that_cannot_be_asked(
    processes: Any,  # noqa: F811
    mock_factory: Any,
) -> None:
    mock = mock_factory(name="sleepy", sleep_mode=True, **LONG)
    procs = processes(3, [Worker(mock.url, labels=SLEEPY)])
    with procs[2].client.stream("POST", PATH, json={**CHAT, "stream": True}) as s:
        chunks = s.iter_raw()  # kept: dropped, it would close the response
        next(chunks)
        # Process 2 holds a lease and does not answer its siblings (restarting,
        # stuck): nobody can tell that it holds none, so the engine must stay up.
        procs[2].down()
        r = procs[0].client.post(f"/workers/{wid(mock.url)}/sleep")
        assert r.status_code == 503, (r.status_code, r.text[:300])
        assert r.json()["error"]["code"] == "process_unavailable"
        assert r.json()["processes"] == {"applied": 0, "failed": [2]}
        assert mock.worker.stats.sleep_calls == 0
        # Process 1 had agreed (state only) and was rolled back.
        assert _states(procs[:2]) == ["ready"] * 2
    assert wait_until(lambda: procs[2].mesh.total_load() == 0)


def test_a_sibling_that_does_not_know_the_worker_does_not_block_a_sleep(
    processes: Any,  # noqa: F811
    mock_factory: Any,
) -> None:
    mock = mock_factory(name="sleepy", sleep_mode=True)
    procs = processes(3, [Worker(mock.url, labels=SLEEPY)])
    # Process 2 missed the worker's admin add (it was down): it holds no lease on
    # it and places nothing there, so its 404 is not a "no".
    procs[2].mesh.remove_worker(procs[2].mesh.workers[0])
    r = procs[0].client.post(f"/workers/{wid(mock.url)}/sleep")
    assert r.status_code == 200, (r.status_code, r.text[:300])
    assert mock.worker.stats.sleep_calls == 1
    assert _states(procs[:2]) == ["sleeping"] * 2
    # A sibling that cannot be asked at all still stops it (the test above).


def test_an_idle_sleep_goes_ahead_past_a_sibling_that_does_not_know_the_worker(
    processes: Any,  # noqa: F811
    mock_factory: Any,
) -> None:
    mock = mock_factory(name="sleepy", sleep_mode=True)
    worker = Worker(mock.url, labels=SLEEPY)
    procs = processes(2, [worker], gates=True, lifecycle={**IDLE, "idle_sleep_s": 0.5})
    procs[1].mesh.remove_worker(procs[1].mesh.workers[0])
    assert wait_until(lambda: mock.worker.stats.sleep_calls == 1)
    assert wait_until(lambda: _states(procs[:1]) == ["sleeping"])
