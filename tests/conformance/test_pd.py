"""Prefill/decode disaggregation in every mode, against mock PD workers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from harness import AsyncTransportMode, TransportMode, wait_until
from meshkit import Worker
from meshkit.core.policies import RoundRobin

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "disaggregate me"}]}

pytestmark = pytest.mark.not_in_extproc(
    "prefill/decode needs two legs; ext-proc answers 501 unsupported_in_ext_proc (tests/extproc)"
)


def _pd(mock_factory: Any, protocol: str, **kw: Any) -> tuple[Any, Any]:
    prefill = mock_factory(name="p", pd_role="prefill", pd_protocol=protocol, api_key="pk", **kw)
    decode = mock_factory(name="d", pd_role="decode", pd_protocol=protocol, api_key="dk", **kw)
    return prefill, decode


def _chats(mock: Any) -> int:
    return int(mock.worker.stats.requests_total.get("/v1/chat/completions", 0))


def _workers(prefill: Any, decode: Any) -> list[Worker]:
    return [
        Worker(
            prefill.url,
            api_key="pk",
            labels={"mesh.role": "prefill", "mesh.bootstrap_port": "9123"},
        ),
        Worker(decode.url, api_key="dk", labels={"mesh.role": "decode"}),
    ]


def test_sglang_pd_shares_one_room_and_streams_the_decode(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    prefill, decode = _pd(mock_factory, "sglang", output_tokens=5)
    mesh = mesh_factory(workers=_workers(prefill, decode), pd={"protocol": "sglang"})
    mode = run_mode(mesh)
    r = mode.request(
        "POST",
        "/v1/chat/completions",
        json=CHAT,
        headers={"authorization": "Bearer client-key"},
    )
    assert r.status == 200, r.body
    assert r.headers["x-mock-worker"] == "d"
    p_boot, d_boot = prefill.worker.stats.last_bootstrap, decode.worker.stats.last_bootstrap
    assert p_boot == d_boot
    host, port, room = d_boot
    assert host == "127.0.0.1"
    assert port == 9123
    assert 0 <= room < 2**63
    # each leg got its own worker's key, never the client's
    assert prefill.worker.stats.last_header("authorization") == "Bearer pk"
    assert decode.worker.stats.last_header("authorization") == "Bearer dk"
    # the client's bytes, with the bootstrap members appended
    assert decode.worker.stats.last_body.startswith(
        json.dumps(CHAT, separators=(",", ":")).encode()[:-1]
    )

    with mode.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as chunks:
        text = b"".join(chunks)
    assert text.rstrip().endswith(b"data: [DONE]")
    assert wait_until(lambda: mesh.total_load() == 0)


def test_sglang_batched_generate_gets_lists_and_merged_logprobs(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    prefill, decode = _pd(mock_factory, "sglang")
    mesh = mesh_factory(workers=_workers(prefill, decode), pd={"protocol": "sglang"})
    mode = run_mode(mesh)
    r = mode.request(
        "POST",
        "/generate",
        json={
            "text": ["a b", "c d"],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert r.status == 200, r.body
    hosts, ports, rooms = decode.worker.stats.last_bootstrap
    assert ports == [9123, 9123]
    assert hosts == ["127.0.0.1", "127.0.0.1"]
    assert len(set(rooms)) == 2
    assert prefill.worker.stats.last_bootstrap == decode.worker.stats.last_bootstrap
    for item in r.json():
        values = [lp[0] for lp in item["meta_info"]["input_token_logprobs"]]
        assert values == [-1.0, -1.0, -2.0]  # the prefill's first, then the decode's
    assert wait_until(lambda: mesh.total_load() == 0)  # both legs' leases released


def test_sglang_logprobs_over_the_capture_bound_are_a_502_not_a_cut_answer(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    """The merged answer is read whole: past bounds.max_captured_body_bytes it is
    refused as the worker's (502, the bound named), never relayed cut short or
    blamed on the client, and both legs' leases are released."""
    prefill, decode = _pd(mock_factory, "sglang")
    body = {"text": "a b", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    whole = mesh_factory(workers=_workers(prefill, decode), pd={"protocol": "sglang"})
    size = len(run_mode(whole).request("POST", "/generate", json=body).body)
    mesh = mesh_factory(
        workers=_workers(prefill, decode),
        pd={"protocol": "sglang"},
        bounds={"max_captured_body_bytes": size // 2},
    )
    r = run_mode(mesh).request("POST", "/generate", json=body)
    assert r.status == 502, r.body
    error = r.json()["error"]
    assert error["code"] == "upstream_error"
    assert f"bounds.max_captured_body_bytes ({size // 2} bytes)" in error["message"]
    assert wait_until(lambda: mesh.total_load() == 0)


def test_vllm_pd_is_sequential_with_kv_transfer_params(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    prefill, decode = _pd(mock_factory, "vllm", output_tokens=4)
    mesh = mesh_factory(workers=_workers(prefill, decode), pd={"protocol": "vllm"})
    mode = run_mode(mesh)
    r = mode.request(
        "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}
    )
    assert r.status == 200, r.body
    assert r.headers["x-mock-worker"] == "d"
    sent_to_prefill = json.loads(prefill.worker.stats.last_body)
    assert sent_to_prefill["max_tokens"] == 1
    assert sent_to_prefill["stream"] is False
    assert decode.worker.stats.last_kv_params is not None
    assert decode.worker.stats.last_kv_params["remote_block_ids"] == [1, 2, 3]
    assert wait_until(lambda: mesh.total_load() == 0)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_messages_and_responses_are_refused_on_a_pd_fleet(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, path: str
) -> None:
    prefill, decode = _pd(mock_factory, "sglang")
    mesh = mesh_factory(workers=_workers(prefill, decode))
    mode = run_mode(mesh)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    if path == "/v1/responses":
        body = {"model": "m", "input": "x"}
    r = mode.request("POST", path, json=body)
    assert r.status == 501
    err = r.json()["error"]
    assert err.get("code", err.get("type")) in ("unsupported_api_topology", "invalid_request_error")


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_failing_leg_ends_cleanly_and_releases_both(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, protocol: str
) -> None:
    prefill = mock_factory(
        name="p", pd_role="prefill", pd_protocol=protocol, error_rate=1.0, fail_status=500
    )
    decode = mock_factory(name="d", pd_role="decode", pd_protocol=protocol)
    mesh = mesh_factory(
        workers=[
            Worker(prefill.url, labels={"mesh.role": "prefill"}),
            Worker(decode.url, labels={"mesh.role": "decode"}),
        ],
        pd={"protocol": protocol},
    )
    mode = run_mode(mesh)
    r = mode.request("POST", "/v1/chat/completions", json=CHAT)
    assert r.status == 500
    assert r.headers["x-mock-worker"] == "p"  # the prefill worker's own answer
    assert wait_until(lambda: mesh.total_load() == 0)
    failures = mesh.metrics.registry.get_sample_value("mesh_pd_bootstrap_failures_total")
    assert failures == 1.0
    # counted as any relayed error, and blamed on the worker that failed
    sample = {"api": "chat", "status": "500"}
    assert mesh.metrics.registry.get_sample_value("mesh_router_requests_total", sample) == 1.0


def test_disconnect_mid_stream_releases_both_leases(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    prefill = mock_factory(name="p", pd_role="prefill")
    decode = mock_factory(name="d", pd_role="decode", output_tokens=400, per_token_ms=20)
    mesh = mesh_factory(
        workers=[
            Worker(prefill.url, labels={"mesh.role": "prefill"}),
            Worker(decode.url, labels={"mesh.role": "decode"}),
        ]
    )
    mode = run_mode(mesh)
    with mode.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as chunks:
        next(iter(chunks))
        assert mesh.total_load() == 2
    assert wait_until(lambda: mesh.total_load() == 0)
    assert wait_until(lambda: decode.worker.stats.active_streams == 0)


def test_a_failing_decode_leg_ends_cleanly_and_releases_both(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    prefill = mock_factory(name="p", pd_role="prefill")
    decode = mock_factory(name="d", pd_role="decode", error_rate=1.0, fail_status=503)
    # No probes: one that ran after the kill would mark the decode worker failed,
    # and the request would be refused (503) instead of failing its leg (502).
    mesh = mesh_factory(
        workers=[
            Worker(prefill.url, labels={"mesh.role": "prefill"}),
            Worker(decode.url, labels={"mesh.role": "decode"}),
        ],
        lifecycle={"probe": False},
    )
    mode = run_mode(mesh)
    r = mode.request("POST", "/v1/chat/completions", json=CHAT)
    assert r.status == 503  # the decode worker's own answer, relayed
    assert r.headers["x-mock-worker"] == "d"
    assert wait_until(lambda: mesh.total_load() == 0)
    decode.kill()
    r = mode.request("POST", "/v1/chat/completions", json=CHAT)
    assert r.status == 502
    assert r.json()["error"]["code"] == "upstream_error"
    assert wait_until(lambda: mesh.total_load() == 0)


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_client_that_leaves_before_the_decode_answers_releases_both(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, protocol: str
) -> None:
    """The client gives up while the decode leg waits for its head (the prefill leg
    is done, for vLLM, and its lease held for the pair): both leases go back."""
    prefill, decode = _pd(mock_factory, protocol)
    decode.stop()
    decode = mock_factory(
        name="d", pd_role="decode", pd_protocol=protocol, api_key="dk", first_token_ms=1500
    )
    mesh = mesh_factory(workers=_workers(prefill, decode), pd={"protocol": protocol})
    mode = run_mode(mesh)
    if isinstance(mode, TransportMode):
        pytest.skip("a blocking transport call cannot be left before its answer")
    if isinstance(mode, AsyncTransportMode):
        # The transport follows the [upstream] timeouts, not the SDK's: cancel.
        client = mode.async_openai(max_retries=0)

        async def go() -> None:
            task = asyncio.ensure_future(client.chat.completions.create(**CHAT))
            while not decode.worker.stats.requests_total.get("/v1/chat/completions"):
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        mode.run(go)
    else:
        with pytest.raises(openai.APITimeoutError):
            mode.openai(max_retries=0, timeout=0.4).chat.completions.create(**CHAT)
    assert decode.worker.stats.requests_total.get("/v1/chat/completions") == 1
    assert wait_until(lambda: mesh.total_load() == 0)


@pytest.mark.parametrize("mode_name", ["transport", "wsgi"])
def test_sync_callers_run_at_most_sync_leg_threads_prefill_legs(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    """``pd.sync_leg_threads`` bounds the SGLang prefill legs a sync caller runs at
    once; the others wait for a thread, and every request is answered."""
    import threading

    prefill = mock_factory(name="p", pd_role="prefill", first_token_ms=200)
    decode = mock_factory(name="d", pd_role="decode")
    mesh = mesh_factory(
        workers=[
            Worker(prefill.url, labels={"mesh.role": "prefill"}),
            Worker(decode.url, labels={"mesh.role": "decode"}),
        ],
        pd={"sync_leg_threads": 2},
    )
    mode = run_mode(mesh)
    statuses: list[int] = []
    most = 0
    threads = [
        threading.Thread(
            target=lambda: statuses.append(
                mode.request("POST", "/v1/chat/completions", json=CHAT).status
            )
        )
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        most = max(most, prefill.worker.stats.in_flight)
        threading.Event().wait(0.005)
    assert statuses == [200] * 6
    assert most == 2
    assert prefill.worker.stats.requests_total.get("/v1/chat/completions") == 6


def test_the_prefill_policy_reads_what_it_needs_whatever_the_main_policy(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    """The main policy (round robin) reads no text; the prefill policy
    (``cache_aware``, the default) does: it gets the text, so each conversation's
    next turn goes to the prefill worker that holds its prefix, and new ones spread."""
    prefills = [
        mock_factory(name=f"p{i}", pd_role="prefill", pd_protocol="sglang") for i in range(2)
    ]
    decode = mock_factory(name="d", pd_role="decode", pd_protocol="sglang")
    workers = [
        Worker(p.url, labels={"mesh.role": "prefill", "mesh.bootstrap_port": "9123"})
        for p in prefills
    ] + [Worker(decode.url, labels={"mesh.role": "decode"})]
    mesh = mesh_factory(workers=workers, pd={"protocol": "sglang"})
    assert mesh.router.policy.name == "round_robin"
    mode = run_mode(mesh)

    def turn(messages: list[dict[str, str]]) -> str:
        before = [_chats(p) for p in prefills]
        r = mode.request("POST", "/v1/chat/completions", json={"model": "m", "messages": messages})
        assert r.status == 200, r.body
        after = [_chats(p) for p in prefills]
        (took,) = [f"p{i}" for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
        return took

    firsts, moved = [], 0
    for c in range(8):
        msgs = [
            {"role": "system", "content": f"Tenant {c}: " + "a long shared policy. " * 30},
            {"role": "user", "content": f"question {c}"},
        ]
        first = turn(msgs)
        msgs += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}]
        moved += turn(msgs) != first
        firsts.append(first)
    assert moved == 0
    assert set(firsts) == {"p0", "p1"}
    tree = mesh.router.prefill_policy.tree("m")
    assert tree is not None and tree.node_count > 0
    # /workers says how each side matches: a prefill policy on the ring, its workers
    assert mesh.router.needs().text
    mesh.router.set_policy(None, prefill=_OnTheRing())
    assert not mesh.router.needs().text  # no policy of the three reads text now
    kinds = {row["url"]: row["prefix_match"] for row in mesh.router.describe()}
    assert [kinds[p.url] for p in prefills] == ["ring", "ring"]
    assert kinds[decode.url] == "approximate"


class _OnTheRing(RoundRobin):
    """A policy that says it places chats by the ring (as ``cache_aware`` does
    when other routers place its conversations' turns)."""

    ring_placement = True
