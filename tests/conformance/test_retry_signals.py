"""The SDKs retry what meshkit says may pass later, and only that.

The real openai and anthropic SDKs, with their default retries, in every mode: a
permanent refusal (501, 404) reaches meshkit once, a refusal a later attempt may
pass (502 here) reaches it 1 + ``max_retries`` times, and the Anthropic error keeps
meshkit's code.
"""

from __future__ import annotations

import socket
from typing import Any

import anthropic
import openai
import pytest

from harness import MODES
from meshkit import Mesh, Worker

MSG = [{"role": "user", "content": "say hello"}]


def rejections(mesh: Mesh, code: str) -> float:
    """How many times meshkit refused with ``code`` (its own counter)."""
    value = mesh.metrics.registry.get_sample_value("mesh_router_rejections_total", {"code": code})
    return value or 0.0


@pytest.fixture(params=[m for m in MODES if m != "async_transport"])
def mode_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def chat_only(mock_factory: Any, mesh_factory: Any) -> Mesh:
    """One worker that serves chat and nothing else."""
    mock = mock_factory(name="w0")
    return mesh_factory(workers=[Worker(mock.url, labels={"mesh.apis": "chat"})])  # type: ignore[no-any-return]


def test_a_permanent_refusal_is_sent_once(chat_only: Mesh, run_mode: Any) -> None:
    mode = run_mode(chat_only)
    with pytest.raises(anthropic.APIStatusError) as caught:
        mode.anthropic(max_retries=2).messages.create(model="m", max_tokens=8, messages=MSG)
    assert caught.value.status_code == 501
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert caught.value.body["error"]["code"] == "unsupported_api"  # type: ignore[index]
    assert rejections(chat_only, "unsupported_api") == 1

    with pytest.raises(openai.APIStatusError) as oc:
        mode.openai(max_retries=2).completions.create(model="m", prompt="once")
    assert (oc.value.status_code, oc.value.code) == (501, "unsupported_api")
    assert rejections(chat_only, "unsupported_api") == 2


def test_a_retryable_refusal_is_retried(mesh_factory: Any, run_mode: Any) -> None:
    """Nothing listens at the worker's port: 502 ``upstream_error``, which the SDK
    sends again (``x-should-retry: true``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    mesh = mesh_factory(workers=[dead], lifecycle={"probe": False, "breaker_failures": 100})
    mode = run_mode(mesh)
    with pytest.raises(openai.APIStatusError) as caught:
        mode.openai(max_retries=1).chat.completions.create(model="m", messages=MSG)
    assert (caught.value.status_code, caught.value.code) == (502, "upstream_error")
    assert caught.value.response.headers["x-should-retry"] == "true"
    assert rejections(mesh, "upstream_error") == 2
