"""The SDKs retry meshkit's 503s, waiting what meshkit says (PROTOCOLS.md section 5,
docs/errors.md "What to retry"): with ``max_retries=2`` a 503
``no_available_workers`` reaches meshkit three times, in each API's error shape,
with ``x-should-retry: true`` and a ``Retry-After`` within what every SDK honours."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from harness import MODES
from meshkit import Mesh, Worker

MSG = [{"role": "user", "content": "say hello"}]


@pytest.fixture(params=[m for m in MODES if m != "async_transport"])
def mode_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def rejections(mesh: Mesh, code: str) -> float:
    value = mesh.metrics.registry.get_sample_value("mesh_router_rejections_total", {"code": code})
    return value or 0.0


def _hints(headers: Any) -> None:
    assert headers["x-should-retry"] == "true"
    assert 1 <= int(headers["retry-after"]) <= 60
    assert 0 < int(headers["retry-after-ms"]) <= 60_000


def test_no_available_worker_is_retried_by_both_sdks(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="w0")
    mesh = mesh_factory(workers=[Worker(mock.url)], lifecycle={"probe": False})
    mesh.set_healthy(mesh.workers[0], False)
    mode = run_mode(mesh)

    with pytest.raises(openai.APIStatusError) as oc:
        mode.openai(max_retries=2).chat.completions.create(model="m", messages=MSG)
    assert (oc.value.status_code, oc.value.code) == (503, "no_available_workers")
    _hints(oc.value.response.headers)
    assert rejections(mesh, "no_available_workers") == 3

    with pytest.raises(anthropic.APIStatusError) as ac:
        mode.anthropic(max_retries=2).messages.create(model="m", max_tokens=8, messages=MSG)
    assert ac.value.status_code == 503
    assert ac.value.body == {  # the Anthropic shape, meshkit's code riding along
        "type": "error",
        "error": {
            "type": "overloaded_error",
            "message": ac.value.body["error"]["message"],  # type: ignore[index]
            "code": "no_available_workers",
        },
    }
    _hints(ac.value.response.headers)
    assert rejections(mesh, "no_available_workers") == 6
    assert mock.worker.stats.requests_total.get("/v1/chat/completions", 0) == 0
