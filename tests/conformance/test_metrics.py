"""Response accounting feeds the same metrics in every mode."""

from __future__ import annotations

from typing import Any

from harness import wait_until
from meshkit import Worker

CHAT = {"model": "m", "messages": [{"role": "user", "content": "count me"}]}


def test_requests_ttft_tokens_and_active_load_are_counted(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="m", output_tokens=7)
    mesh = mesh_factory(workers=[Worker(mock.url)])
    mode = run_mode(mesh)
    sample = mesh.metrics.registry.get_sample_value
    assert mode.request("POST", "/v1/chat/completions", json=CHAT).status == 200
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with mode.stream("POST", "/v1/chat/completions", json=stream) as chunks:
        b"".join(chunks)
    labels = {"api": "chat", "status": "200"}
    assert wait_until(lambda: sample("mesh_router_requests_total", labels) == 2.0)
    assert sample("mesh_router_ttft_seconds_count", {"api": "chat"}) == 2.0
    assert sample("mesh_router_tokens_total", {"kind": "output"}) == 14.0
    assert sample("mesh_router_tokens_total", {"kind": "input"}) > 0
    assert sample("mesh_worker_requests_active", {"worker": mesh.workers[0].id}) == 0.0
    assert mode.request("POST", "/v1/chat/completionz", json=CHAT).status == 404
    assert sample("mesh_router_rejections_total", {"code": "unknown_endpoint"}) == 1.0


def test_a_stream_without_usage_is_counted(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    """Its tokens cannot be counted; the counter says how many such streams there were."""
    mesh = mesh_factory(workers=[Worker(mock_factory(name="m").url)])
    mode = run_mode(mesh)
    sample = mesh.metrics.registry.get_sample_value
    with mode.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as chunks:
        b"".join(chunks)
    asked = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with mode.stream("POST", "/v1/chat/completions", json=asked) as chunks:
        b"".join(chunks)
    labels = {"api": "chat", "status": "200"}
    assert wait_until(lambda: sample("mesh_router_requests_total", labels) == 2.0)
    assert sample("mesh_router_streams_without_usage_total", {"api": "chat"}) == 1.0
