"""Admin API edge cases: bad input gets a 4xx in the
API's error shape, never a 500; a sleep whose wait ran out is told as such."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest

from harness import UvicornThread, wait_until
from lifecycle.conftest import FAST, SLEEPY, state_of
from lifecycle.test_admin import _id, admin  # noqa: F401  (the fixture)
from meshkit import Worker
from meshkit.core.lifecycle import State
from meshkit.lifecycle.admin import AdminApp


@pytest.mark.parametrize("ident", ["%C2%B2", "9" * 5000])
def test_a_worker_index_that_is_not_a_number_is_a_404(admin: Any, ident: str) -> None:  # noqa: F811
    # "²".isdigit() is True but int("²") raises; so does a 5000-digit index
    client, _, _ = admin
    for method, path in (("POST", "/drain"), ("POST", "/wake"), ("DELETE", "")):
        r = client.request(method, f"/workers/{ident}{path}")
        assert r.status_code == 404, (method, path, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "unknown_worker"


def test_a_sleep_whose_wait_runs_out_answers_504_json(admin: Any) -> None:  # noqa: F811
    client, mesh, sleepy = admin
    wid = mesh.workers[1].id
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    r = client.post(f"/workers/{_id(wid)}/sleep?timeout_s=0")
    assert r.status_code == 504, (r.status_code, r.text[:200])
    assert r.json()["error"]["code"] == "sleep_timeout"
    # the sleep itself was not abandoned: the engine and the state agree
    assert wait_until(lambda: state_of(mesh, wid) is State.SLEEPING)
    assert wait_until(lambda: sleepy.worker.stats.sleep_calls == 1)


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "soon"])
def test_a_wait_that_is_not_a_finite_number_is_refused(admin: Any, value: str) -> None:  # noqa: F811
    # every wait is bounded: timeout_s=inf would drain (or wake) forever
    client, mesh, _ = admin
    wid = _id(mesh.workers[0].id)
    for verb in ("drain", "wake", "sleep"):
        r = client.post(f"/workers/{wid}/{verb}?timeout_s={value}")
        assert r.status_code == 400, (verb, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "invalid_query"
    assert state_of(mesh, mesh.workers[0].id) is State.READY  # nothing was started


def test_an_admin_body_over_its_bound_is_a_413_naming_the_key(
    mock_factory: Any, mesh_factory: Any
) -> None:
    worker = mock_factory(name="plain")
    mesh = mesh_factory(
        workers=[worker.url], lifecycle={"probe": False}, bounds={"max_admin_body_bytes": 200}
    )
    with UvicornThread(AdminApp(mesh)) as base, httpx2.Client(base_url=base, timeout=30) as c:
        labels = {"note": "x" * 200}
        r = c.post("/workers", json={"url": "http://127.0.0.1:9/", "labels": labels})
        assert r.status_code == 413, r.text[:200]
        assert r.json()["error"]["code"] == "too_large"
        assert "bounds.max_admin_body_bytes (200 bytes)" in r.json()["error"]["message"]
        assert len(mesh.workers) == 1
        r = c.post("/workers", json={"url": "http://127.0.0.1:9/"})
        assert r.status_code == 201, r.text[:200]
        assert len(mesh.workers) == 2


@pytest.mark.parametrize("limit", [8, None])
def test_a_probe_reads_no_more_of_an_answer_than_max_probe_bytes(
    limit: int | None, mock_factory: Any, mesh_factory: Any
) -> None:
    """An engine put to sleep behind meshkit's back is learned from ``/is_sleeping``
    (``{"is_sleeping":true}``, 20 bytes): read whole by default, and cut to 8 bytes,
    so not understood, at ``lifecycle.max_probe_bytes = 8``."""
    engine = mock_factory(name="sleepy", sleep_mode=True)
    bound = {} if limit is None else {"max_probe_bytes": limit}
    mesh = mesh_factory(workers=[Worker(engine.url, labels=SLEEPY)], lifecycle={**FAST, **bound})
    mesh.start_lifecycle()
    wid = mesh.workers[0].id
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    assert httpx2.post(engine.url + "/sleep?level=1", timeout=10).status_code == 200
    asked = engine.worker.stats.requests_total.get("/is_sleeping", 0)
    # Three probes after the sleep, each reading /is_sleeping.
    assert wait_until(lambda: engine.worker.stats.requests_total["/is_sleeping"] >= asked + 3)
    expected = State.READY if limit else State.SLEEPING
    assert wait_until(lambda: state_of(mesh, wid) is expected)
    assert state_of(mesh, wid) is expected


@pytest.mark.parametrize("bound", [2, None])
def test_the_controllers_tables_start_over_past_max_tracked_workers(
    bound: int | None, mock_factory: Any, mesh_factory: Any
) -> None:
    """Three unlabelled workers, their model lists due once an hour: each read once,
    unless the table of when each was read holds only two (then it starts over,
    and the lists are read again at every probe)."""
    engines = [mock_factory(name=f"w{i}") for i in range(3)]
    tracked = {} if bound is None else {"max_tracked_workers": bound}
    mesh = mesh_factory(
        workers=[e.url for e in engines],
        lifecycle={**FAST, "models_interval_s": 3600, **tracked},
    )
    mesh.start_lifecycle()

    def count(path: str) -> list[int]:
        return [e.worker.stats.requests_total.get(path, 0) for e in engines]

    assert wait_until(lambda: min(count("/health")) >= 6)
    reads = count("/v1/models")
    if bound is None:
        assert reads == [1, 1, 1]
    else:
        assert sum(reads) >= 6, reads
