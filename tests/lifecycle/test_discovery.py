"""Discovery and reconfigure on a Mesh (any mode): dns:// entries resolved by the
lifecycle thread, the workers file read at start, reloads that change nothing when
they fail, leases kept across a label change, admin-added workers left alone."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest

from harness import wait_until
from lifecycle.conftest import CHAT, FAST, PATH
from meshkit import Mesh, Worker
from meshkit.config import MeshConfig
from meshkit.errors import ConfigError
from meshkit.frontends.transport import MeshTransport
from meshkit.mock import MockWorkerThread


def _urls(mesh: Mesh) -> list[str]:
    return [w.url for w in mesh.workers]


def test_a_client_side_mesh_follows_a_dns_entry(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    w = mock_factory(name="local")
    port = w.worker.port
    mesh = mesh_factory(workers=[f"dns://localhost:{port}"], lifecycle=FAST)
    assert mesh.workers == ()  # looked up by the lifecycle thread, not the constructor
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        r = client.post(PATH, json=CHAT)  # the first request starts the lifecycle
        assert r.status_code in (200, 501)  # 501: the lookup had not answered yet
        assert wait_until(lambda: f"http://127.0.0.1:{port}" in _urls(mesh))
        r = client.post(PATH, json=CHAT)
        assert r.status_code == 200 and r.headers["x-mock-worker"] == "local"


def test_a_failed_lookup_is_counted_and_logged_once(
    mesh_factory: Callable[..., Mesh], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "meshkit.discovery")
    mesh = mesh_factory(workers=["dns://no-such-host.invalid:80"], lifecycle=FAST)
    mesh.start_lifecycle()
    failures = mesh.metrics.discovery_failures.labels("dns")
    assert wait_until(lambda: failures._value.get() >= 3)
    lines = [r.getMessage() for r in caplog.records if "lookup failed" in r.getMessage()]
    assert len(lines) == 1 and "no-such-host.invalid" in lines[0]
    assert mesh.workers == ()


def test_the_addresses_of_one_entry_are_bounded(mesh_factory: Callable[..., Mesh]) -> None:
    mesh = mesh_factory(workers=["dns://svc:80"], discovery={"max_addresses": 2})
    sources = mesh.lifecycle.discovery.sources  # type: ignore[union-attr]
    sources.set_addresses("svc", ["10.0.0.3", "10.0.0.1", "10.0.0.2"])
    assert [w.url for w in sources.desired()] == ["http://10.0.0.1:80", "http://10.0.0.2:80"]


def test_addresses_past_the_bound_are_said_once(
    mesh_factory: Callable[..., Mesh],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A headless Service with more pods than ``discovery.max_addresses``: the
    pods past the bound get no traffic from any router, and the log says so."""
    real = socket.getaddrinfo
    asked: list[str] = []

    def lookup(host: Any, *args: Any, **kw: Any) -> Any:
        if host != "svc.test":
            return real(host, *args, **kw)
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.0.0.{i}", 0)) for i in (3, 1, 2)]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    caplog.set_level(logging.WARNING, "meshkit.discovery")
    mesh = mesh_factory(
        workers=["dns://svc.test:80"], discovery={"max_addresses": 2}, lifecycle=FAST
    )
    mesh.start_lifecycle()
    assert wait_until(lambda: len(asked) >= 3)  # several rounds
    assert _urls(mesh) == ["http://10.0.0.1:80", "http://10.0.0.2:80"]
    lines = [r.getMessage() for r in caplog.records if "max_addresses" in r.getMessage()]
    assert lines == [
        "dns://svc.test resolves to 3 addresses; discovery.max_addresses "
        "makes workers of the first 2"
    ]


def test_a_missing_workers_file_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="workers_file") as info:
        Mesh(workers_file=str(tmp_path / "fleet.toml"))
    assert "cannot read" in str(info.value)


def test_workers_file_workers_are_there_before_the_first_request(
    tmp_path: Path, mesh_factory: Callable[..., Mesh]
) -> None:
    f = tmp_path / "fleet.toml"
    f.write_text('[[workers]]\nurl = "http://10.0.0.1:80"\n')
    mesh = mesh_factory(workers=["http://10.0.0.9:80"], workers_file=str(f))
    assert _urls(mesh) == ["http://10.0.0.9:80", "http://10.0.0.1:80"]


def test_a_refused_reload_changes_nothing(
    tmp_path: Path, mesh_factory: Callable[..., Mesh]
) -> None:
    mesh = mesh_factory(workers=["http://10.0.0.1:80"], policy="round_robin")
    policy = mesh.policy
    bad_policy = MeshConfig.build(workers=["http://10.0.0.2:80"], policy="no_such_policy")
    with pytest.raises(ConfigError, match="policy"):
        mesh.reconfigure(bad_policy)
    bad_file = MeshConfig.build(
        workers=["http://10.0.0.2:80"], workers_file=str(tmp_path / "none.toml")
    )
    with pytest.raises(ConfigError, match="workers_file"):
        mesh.reconfigure(bad_file)
    assert _urls(mesh) == ["http://10.0.0.1:80"]
    assert mesh.policy is policy and mesh.config.policy == "round_robin"


def test_a_reload_keeps_admin_workers_and_reports_restart_keys(
    mesh_factory: Callable[..., Mesh],
) -> None:
    mesh = mesh_factory(workers=["http://10.0.0.1:80"], lifecycle={"probe": False})
    mesh.add_worker("http://10.0.0.5:80")  # the admin API's way
    report = mesh.reconfigure(
        MeshConfig.build(
            workers=["http://10.0.0.2:80"],
            lifecycle={"probe": False},
            upstream={"max_attempts": 5},
            routing={"seed": 7},
            policy="power_of_two",
        )
    )
    assert report.restart == ("upstream",)
    assert report.policy and mesh.policy.name == "power_of_two"
    assert mesh.config.upstream.max_attempts == 3  # not applied: said so
    assert wait_until(lambda: _urls(mesh) == ["http://10.0.0.5:80", "http://10.0.0.2:80"])


def test_a_label_change_keeps_the_lease_of_a_request_in_flight(
    mesh_factory: Callable[..., Mesh],
) -> None:
    mesh = mesh_factory(workers=["http://10.0.0.1:80"], lifecycle={"probe": False})
    worker = mesh.workers[0]
    cand = mesh.fleet.candidates_of(worker)[0]
    match = mesh.resolve("POST", PATH)
    assert match is not None
    view: Any = mesh.prepare(match, b'{"model":"m","messages":[]}', [])
    lease = mesh.router.lease(cand, view)
    report = mesh.reconfigure(
        MeshConfig.build(
            workers=[Worker("http://10.0.0.1:80", labels={"zone": "b"})],
            lifecycle={"probe": False},
            routing={"seed": 7},
        )
    )
    assert report.fleet.summary() == "0 added, 1 updated, 0 removed"
    assert mesh.workers[0].labels == {"zone": "b"}
    assert mesh.load_of(mesh.workers[0]) == 1
    lease.release(ok=True, status=200)
    assert mesh.load_of(mesh.workers[0]) == 0 and mesh.total_load() == 0


def test_a_lease_on_a_worker_with_kv_events_weighs_only_the_uncached_prompt(
    mesh_factory: Callable[..., Mesh],
) -> None:
    from meshkit.core.kv_events import Batch, BlockStored

    mesh = mesh_factory(
        workers=["http://10.0.0.1:80", "http://10.0.0.2:80"], lifecycle={"probe": False}
    )
    held, cold = (mesh.fleet.candidates_of(w)[0] for w in mesh.workers)
    match = mesh.resolve("POST", PATH)
    assert match is not None
    view: Any = mesh.prepare(match, b'{"model":"m","messages":[]}', [])
    view.prompt_ids, view.prompt_weight = list(range(32)), 1000
    mesh.fleet.kv.apply(
        held.worker.id, Batch(0.0, (BlockStored((5,), None, tuple(range(16)), 16),))
    )
    leases = [mesh.router.lease(held, view), mesh.router.lease(cold, view)]
    assert (mesh.fleet.weight[held.key], mesh.fleet.weight[cold.key]) == (500, 1000)
    for lease in leases:
        lease.release(ok=True, status=200)
    assert mesh.fleet.weight.get(held.key, 0) == mesh.fleet.weight.get(cold.key, 0) == 0
