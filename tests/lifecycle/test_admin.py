"""The admin ASGI app served by uvicorn: list, add, drain, remove, sleep, wake, auth."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx2
import pytest

from harness import UvicornThread, wait_until
from lifecycle.conftest import FAST, SLEEPY, state_of
from meshkit import Mesh, Worker
from meshkit.config import MeshConfig
from meshkit.core.lifecycle import State
from meshkit.errors import ConfigError
from meshkit.lifecycle.admin import AdminApp

SECRET = "sk-worker-very-secret"
ADMIN = "admin-key-123"
AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def admin(mock_factory: Any, mesh_factory: Any) -> Iterator[tuple[httpx2.Client, Mesh, Any]]:
    plain = mock_factory(name="plain", api_key=SECRET)
    sleepy = mock_factory(name="sleepy", sleep_mode=True, wake_ms=100)
    mesh = mesh_factory(
        workers=[Worker(plain.url, api_key=SECRET), Worker(sleepy.url, labels=SLEEPY)],
        lifecycle=FAST,
        admin_key=ADMIN,
    )
    mesh.start_lifecycle()
    server = UvicornThread(AdminApp(mesh))
    base = server.__enter__()
    client = httpx2.Client(base_url=base, headers=AUTH, timeout=30)
    try:
        yield client, mesh, sleepy
    finally:
        client.close()
        server.__exit__()


def _id(url: str) -> str:
    return quote(Worker(url).id, safe="")


def test_auth_is_required_when_a_key_is_configured(admin: Any) -> None:
    client, _, _ = admin
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": ADMIN}):
        r = httpx2.get(str(client.base_url) + "/workers", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx2.post(str(client.base_url) + "/workers", json={"url": "http://x:1"})
    assert r.status_code == 401
    assert client.get("/workers").status_code == 200


def test_list_shows_state_and_never_an_api_key(admin: Any) -> None:
    client, mesh, _ = admin
    machines = mesh.router.states.machines
    assert wait_until(lambda: all(m.state is State.READY for m in machines.values()))
    r = client.get("/workers")
    assert r.status_code == 200
    assert SECRET not in r.text and "api_key" not in r.text
    rows = r.json()["workers"]
    assert [w["state"] for w in rows] == ["ready", "ready"]
    assert rows[0]["id"] == _id(mesh.workers[0].url)
    assert {"load", "leases", "breaker", "activity", "healthy"} <= set(rows[0])
    assert rows[1]["sleep_mode"] == "vllm"


def test_add_drain_and_remove(admin: Any, mock_factory: Any) -> None:
    client, mesh, _ = admin
    extra = mock_factory(name="extra")
    r = client.post(
        "/workers", json={"url": extra.url, "api_key": SECRET, "labels": {"mesh.model": "m"}}
    )
    assert r.status_code == 201, r.text
    assert SECRET not in r.text
    wid = Worker(extra.url).id
    assert mesh.fleet.get(wid).api_key == SECRET
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)  # probed at once
    assert client.post("/workers", json={"url": extra.url}).status_code == 409
    r = client.post(f"/workers/{_id(extra.url)}/drain")
    assert r.status_code == 200
    assert r.json()["drained"] is True and r.json()["worker"]["state"] == "draining"
    r = client.delete(f"/workers/{_id(extra.url)}")
    assert r.status_code == 200 and r.json()["removed"] is True
    assert wid not in {w.id for w in mesh.workers}
    assert client.delete(f"/workers/{_id(extra.url)}").status_code == 404


def test_bad_input(admin: Any) -> None:
    client, _, _ = admin
    assert client.post("/workers", content=b"{nope").status_code == 400
    assert client.post("/workers", json={"url": "ftp://x"}).status_code == 400
    assert client.post("/workers", json={"url": "http://x:1", "extra": 1}).status_code == 400
    assert (
        client.post("/workers", json={"url": "http://x:1", "labels": {"a": [1]}}).status_code == 400
    )
    assert client.get("/workers/99").status_code == 404
    assert client.get("/nothing").status_code == 404
    assert client.put("/workers").status_code == 405
    assert client.get("/workers/0/drain").status_code == 405


def test_an_added_worker_is_checked_as_a_workers_table_is(admin: Any, tmp_path: Any) -> None:
    """One set of rules for a worker from the file and from ``POST /workers``: the
    same refusals, the same message, an integer label taken as written."""
    client, mesh, _ = admin
    bad = {"url": "http://x:1", "labels": {"mesh.apis": ["chat"]}}
    r = client.post("/workers", json=bad)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "workers.labels" in message and "must map names to strings" in message
    path = tmp_path / "m.toml"
    path.write_text('[[workers]]\nurl = "http://x:1"\nlabels = { "mesh.apis" = ["chat"] }\n')
    with pytest.raises(ConfigError, match="must map names to strings"):
        MeshConfig.from_file(path)
    # what an admin may not set: a variable of the gateway's environment as the key
    # (it would go to the caller's URL), TLS files on the gateway's disk, dns://
    for extra in ({"api_key_env": "HOME"}, {"tls_ca_file": "/etc/passwd"}):
        r = client.post("/workers", json={"url": "http://x:2", **extra})
        assert r.status_code == 400 and "unknown keys" in r.json()["error"]["message"]
    r = client.post("/workers", json={"url": "dns://vllm-headless:8000"})
    assert r.status_code == 400 and "dns://" in r.json()["error"]["message"]
    r = client.post("/workers", json={"url": "http://x:3", "labels": {"mesh.dp_size": 2}})
    assert r.status_code == 201, r.text
    added = next(w for w in mesh.workers if w.url.startswith("http://x:3"))
    assert added.labels["mesh.dp_size"] == "2"


def test_a_worker_added_with_its_kv_publisher_is_matched_on_its_events(
    admin: Any, mock_factory: Any
) -> None:
    pytest.importorskip("zmq")
    client, mesh, _ = admin
    engine = mock_factory(
        name="engine", cache_tokens=100_000, block_size=4, kv_events="tcp://127.0.0.1:0"
    )
    bad = {"url": engine.url, "kv_events": "udp://x"}
    r = client.post("/workers", json=bad)
    assert r.status_code == 400 and "workers.kv_events" in r.json()["error"]["message"]
    r = client.post("/workers", json={"url": engine.url, "kv_replay": "tcp://127.0.0.1:1"})
    assert r.status_code == 400 and "needs kv_events" in r.json()["error"]["message"]
    r = client.post("/workers", json={"url": engine.url, "kv_events": engine.kv_events_endpoint})
    assert r.status_code == 201, r.text
    wid = Worker(engine.url).id
    sent = iter(range(1000))

    def stored() -> bool:
        # A batch published before the subscription connects is not seen (no
        # replay endpoint here): new prompts until one is.
        prompt = f"prompt {next(sent)} " + "many words " * 20
        r = httpx2.post(engine.url + "/v1/completions", json={"prompt": prompt})
        return r.status_code == 200 and mesh.fleet.kv.blocks_of(wid) > 0

    assert wait_until(stored)  # its publisher is followed
    rows = client.get("/workers").json()["workers"]
    assert next(w["prefix_match"] for w in rows if w["url"] == engine.url) == "events"


def test_sleep_and_wake(admin: Any) -> None:
    client, mesh, sleepy = admin
    wid = mesh.workers[1].id
    assert wait_until(lambda: state_of(mesh, wid) is State.READY)
    r = client.post(f"/workers/{_id(wid)}/sleep?level=2")
    assert r.status_code == 200, r.text
    assert r.json()["worker"]["state"] == "sleeping"
    assert (sleepy.worker.stats.sleep_calls, sleepy.worker.stats.last_sleep_level) == (1, 2)
    assert sleepy.worker.stats.last_sleep_mode == "wait"
    assert client.post(f"/workers/{_id(wid)}/sleep").status_code == 409  # already asleep
    r = client.post("/workers/1/wake")  # by index
    assert r.status_code == 200
    assert r.json()["ready"] is True and r.json()["worker"]["state"] == "ready"
    assert sleepy.worker.stats.wake_calls == 1
    # A worker without sleep mode can be neither slept nor woken.
    assert client.post("/workers/0/sleep").status_code == 409
    assert client.post("/workers/0/wake").status_code == 409


def test_an_open_admin_app_when_no_key_is_configured(mock_factory: Any, mesh_factory: Any) -> None:
    a = mock_factory(name="a")
    mesh = mesh_factory(workers=[Worker(a.url)], lifecycle={"probe": False})
    with UvicornThread(AdminApp(mesh)) as base:
        assert httpx2.get(base + "/workers").status_code == 200
