"""Response headers a server mode writes: one ``Date`` whatever the source, and no
worker ``Content-Length`` on an answer that has no body."""

from __future__ import annotations

from typing import Any

import pytest

from harness import SERVER_MODES
from meshkit import Mesh
from upstreams import RawServer, scripted

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(params=SERVER_MODES)
def mode_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def fleet(mock_factory: Any, mesh_factory: Any) -> Mesh:
    return mesh_factory(workers=[mock_factory(name=f"w{i}").url for i in range(2)])  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        pytest.param("POST", "/v1/chat/completions", CHAT, id="relayed"),
        pytest.param("POST", "/v1/chat/completions", {**CHAT, "stream": True}, id="stream"),
        pytest.param("GET", "/v1/models", None, id="merged"),
        pytest.param("POST", "/v1/nope", {}, id="refused"),
    ],
)
def test_one_date_header(fleet: Mesh, run_mode: Any, method: str, path: str, body: Any) -> None:
    mode = run_mode(fleet)
    r = mode.client.request(method, path, json=body)
    assert r.status_code in (200, 404)
    assert len(r.headers.get_list("date")) == 1, r.headers.get_list("date")


@pytest.mark.parametrize("status", [204, 304])
def test_a_bodiless_answer_loses_the_workers_content_length(
    mesh_factory: Any, run_mode: Any, mode_name: str, status: int
) -> None:
    """A worker's 204 (or 304) that declares a length (RFC 9110 forbids it on a 204):
    the client gets the status without it, and the connection serves the next
    request (a host server that framed by it waited for a body, then failed)."""
    if mode_name == "extproc":
        pytest.skip("Envoy refuses the worker's 204 with a length itself (its own 502)")
    reply = b"HTTP/1.1 %d X\r\ncontent-length: 5\r\nx-kept: 1\r\n\r\n" % status
    with RawServer(scripted(reply, reply)) as worker:
        mesh = mesh_factory(workers=[worker.url], lifecycle={"probe": False})
        mode = run_mode(mesh)
        for _ in range(2):  # one client connection
            r = mode.client.request("POST", "/v1/chat/completions", json=CHAT)
            assert r.status_code == status
            assert r.headers["x-kept"] == "1"
            assert "content-length" not in r.headers or r.headers["content-length"] == "0"
            assert r.content == b""
