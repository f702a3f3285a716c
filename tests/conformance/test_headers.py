"""Response headers a server mode writes: one ``Date`` whatever the source."""

from __future__ import annotations

from typing import Any

import pytest

from harness import SERVER_MODES
from meshkit import Mesh

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
