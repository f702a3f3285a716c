"""The real-engine workload's replay (:mod:`meshkit.testing.workload`) through K
routers that are ``meshkit serve`` processes, as ``benchmarks/real_engine.py`` runs
them, and the engine's own prefill time read off a llama.cpp stream."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx

from meshkit.mock import MockWorkerThread
from meshkit.testing.commands import start_gateway
from meshkit.testing.workload import make_conversations, make_tenants, replay, stream_chat

# The last chunk of a streamed chat completion from llama.cpp's server (xllamacpp
# 2026.10.11549, SmolLM2-135M), captured: its usage and its own timings.
LLAMA_CPP_LAST = (
    b'data: {"choices":[],"created":1796503842,"id":"chatcmpl-VuYD","model":"engine-0",'
    b'"object":"chat.completion.chunk","usage":{"completion_tokens":8,"prompt_tokens":37,'
    b'"total_tokens":45,"prompt_tokens_details":{"cached_tokens":0}},"timings":{"cache_n":0,'
    b'"prompt_n":37,"prompt_ms":383.603,"prompt_per_token_ms":10.367648648648649,'
    b'"prompt_per_second":96.4538859185147,"predicted_n":8,"predicted_ms":47.862,'
    b'"predicted_per_token_ms":6.837428571428572,"predicted_per_second":146.2538130458401}}'
)


def answered(requests: str) -> int:
    """Requests a gateway answered, from its ``/metrics`` text."""
    return int(
        sum(
            float(n)
            for n in re.findall(r"^mesh_router_requests_total\{[^}]*\} (\S+)$", requests, re.M)
        )
    )


def test_each_turn_goes_through_the_gateway_process_its_route_names(
    mock_factory: Callable[..., MockWorkerThread], tmp_path: Path
) -> None:
    workers = [mock_factory(name=f"w{i}", output_tokens=3) for i in range(2)]
    config = tmp_path / "router.toml"
    config.write_text(
        'policy = "cache_aware"\n' + "".join(f'[[workers]]\nurl = "{w.url}"\n' for w in workers)
    )
    gateways = [start_gateway(["--config", str(config), "--port", "0"]) for _ in range(2)]
    try:
        convs = make_conversations(make_tenants(3, target_tokens=50), users=1, turns=2)
        routes = [[0, 1, 1], [1, 0, 0]]  # routes[turn][conversation]
        out = replay([g.url for g in gateways], convs, turns=2, max_tokens=3, routes=routes)
        assert len(out) == 6 and all(o.ok for o in out), [o.error for o in out if not o.ok]
        assert all(o.prefill is None for o in out)  # the mock reports no timings
        counts = [answered(httpx.get(g.url + "/metrics", trust_env=False).text) for g in gateways]
        assert counts == [3, 3]
        assert (
            sum(w.worker.stats.requests_total.get("/v1/chat/completions", 0) for w in workers) == 6
        )
    finally:
        for g in gateways:
            g.proc.terminate()
            g.proc.wait(timeout=15)


def test_the_engines_own_prefill_time_is_read_from_llama_cpps_last_chunk() -> None:
    first = b'data: {"choices":[{"delta":{"content":"Hi"}}],"model":"engine-0"}'
    body = first + b"\n\n" + LLAMA_CPP_LAST + b"\n\ndata: [DONE]\n\n"
    transport = httpx.MockTransport(
        lambda request: httpx.Response(
            200, content=body, headers={"content-type": "text/event-stream"}
        )
    )
    with httpx.Client(transport=transport, base_url="http://engine") as client:
        out, text = stream_chat(client, [{"role": "user", "content": "x"}], max_tokens=8)
    assert text == "Hi" and out.engine == "engine-0"
    assert (out.prompt_tokens, out.completion_tokens) == (37, 8)
    assert out.prefill is not None and abs(out.prefill - 0.383603) < 1e-9
