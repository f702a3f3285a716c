"""Admin API edge cases: bad input gets a 4xx in the
API's error shape, never a 500; a sleep whose wait ran out is told as such."""

from __future__ import annotations

from typing import Any

import pytest

from harness import wait_until
from lifecycle.conftest import state_of
from lifecycle.test_admin import _id, admin  # noqa: F401  (the fixture)
from meshkit.core.lifecycle import State


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
