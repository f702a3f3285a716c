"""TLS to ``https://`` workers, per worker: the CA to trust, no verification, mTLS.

A real TLS mock worker (a trustme CA, the mock's asyncio server with an SSL
context) in every mode; probes use the same settings as requests.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from harness import wait_until
from meshkit import Mesh, Worker
from meshkit.config import MeshConfig
from meshkit.mock import MockConfig, MockWorkerThread

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

pytestmark = pytest.mark.not_in_extproc(
    "TLS to workers is the Envoy cluster's transport socket, not meshkit's"
)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def tls_worker(ca: trustme.CA, *, client_auth: bool = False) -> MockWorkerThread:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    if client_auth:
        ca.configure_trust(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
        # In TLS 1.3 the server checks the client's certificate after the client's
        # handshake is done, and an asyncio server then just closes: the client sees
        # a disconnect, not an alert. TLS 1.2 refuses inside the handshake.
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    worker = MockWorkerThread(MockConfig(name="tls"), ssl=ctx)
    worker.start()
    return worker


@pytest.fixture
def served(ca: trustme.CA) -> Iterator[MockWorkerThread]:
    w = tls_worker(ca)
    yield w
    w.stop()


def status(mesh: Mesh, run_mode: Any) -> tuple[int, str | None]:
    r = run_mode(mesh).request("POST", "/v1/chat/completions", json=CHAT)
    code = r.json()["error"]["code"] if r.status != 200 else None
    return r.status, code


def test_a_worker_checked_against_its_ca(
    served: MockWorkerThread, ca_file: str, mesh_factory: Any, run_mode: Any
) -> None:
    assert served.url.startswith("https://")
    mesh = mesh_factory(
        workers=[Worker(served.url, tls_ca_file=ca_file)],
        lifecycle={"health_interval_s": 0.05},
    )
    assert status(mesh, run_mode) == (200, None)
    mesh.start_lifecycle()  # the probes go over the same TLS settings
    assert wait_until(lambda: mesh.health()["verified_workers"] == 1)


def test_an_unknown_ca_is_a_tls_error_not_unreachable(
    served: MockWorkerThread, mesh_factory: Any, run_mode: Any
) -> None:
    mesh = mesh_factory(workers=[served.url], lifecycle={"probe": False})
    r = run_mode(mesh).request("POST", "/v1/chat/completions", json=CHAT)
    assert (r.status, r.json()["error"]["code"]) == (502, "upstream_tls_error")
    assert "TLS" in r.json()["error"]["message"]


def test_verification_can_be_turned_off(
    served: MockWorkerThread, mesh_factory: Any, run_mode: Any
) -> None:
    mesh = mesh_factory(workers=[Worker(served.url, tls_verify=False)], lifecycle={"probe": False})
    assert status(mesh, run_mode) == (200, None)


def test_mutual_tls(
    ca: trustme.CA, ca_file: str, tmp_path: Path, mesh_factory: Any, run_mode: Any
) -> None:
    worker = tls_worker(ca, client_auth=True)
    try:
        both = tmp_path / "client.pem"
        ca.issue_cert("client.example").private_key_and_cert_chain_pem.write_to_path(str(both))
        keyed = Worker(worker.url, tls_ca_file=ca_file, tls_client_cert=str(both))
        mesh = mesh_factory(workers=[keyed], lifecycle={"probe": False})
        assert status(mesh, run_mode) == (200, None)
        anonymous = mesh_factory(
            workers=[Worker(worker.url, tls_ca_file=ca_file)], lifecycle={"probe": False}
        )
        assert status(anonymous, run_mode) == (502, "upstream_tls_error")
    finally:
        worker.stop()


def test_the_tls_keys_of_a_workers_table(tmp_path: Path, ca_file: str) -> None:
    conf = tmp_path / "m.toml"
    conf.write_text(
        f"""
[[workers]]
url = "https://10.0.0.1:8443"
tls_ca_file = "{ca_file}"
tls_client_cert = "/etc/meshkit/client.pem"
tls_client_key = "/etc/meshkit/client.key"

[[workers]]
url = "https://10.0.0.2:8443"
tls_verify = false
"""
    )
    a, b = MeshConfig.from_file(conf).workers
    assert a.tls is not None and a.tls.ca_file == ca_file
    assert a.tls.client_cert == "/etc/meshkit/client.pem"
    assert a.tls.client_key == "/etc/meshkit/client.key"
    assert b.tls is not None and b.tls.verify is False
    assert Worker("https://10.0.0.3").tls is None  # the defaults
