"""meshkit's picker behind a real Envoy, in both body modes: what only ext-proc does.

The conformance suites run the ext-proc mode too (``harness.ExtProcMode``, full
duplex); these tests add BUFFERED, the answers meshkit gives itself (501s, the
model list, Envoy's own failures in the API's shape), the gRPC health service and
the bound on concurrent streams.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import anthropic
import httpx2
import openai
import pytest

from harness import EXTPROC, free_port, wait_until
from meshkit import Mesh, Worker
from meshkit.mock import MockWorkerThread
from upstreams import RawServer, stall

if not EXTPROC:
    pytest.skip("needs grpcio and an envoy binary (the test extra)", allow_module_level=True)
grpc = pytest.importorskip("grpc")
health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
ExtProcThread = pytest.importorskip("meshkit.frontends.extproc.thread").ExtProcThread
EnvoyProcess = pytest.importorskip("meshkit.testing.envoy").EnvoyProcess

FD, BUFFERED = "FULL_DUPLEX_STREAMED", "BUFFERED"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PATH = "/v1/chat/completions"


@contextmanager
def through_envoy(mesh: Mesh, mode: str = FD, **picker: Any) -> Iterator[str]:
    """Envoy's URL, its ext_proc filter asking a picker over ``mesh``."""
    with (
        ExtProcThread(mesh, grace_s=1.0, **picker) as port,
        EnvoyProcess(port, request_body_mode=mode) as envoy,
    ):
        yield envoy.url


def metric(mesh: Mesh, name: str, **labels: str) -> float:
    value = mesh.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.mark.parametrize("mode", [FD, BUFFERED])
def test_the_sdks_through_envoy_in_both_body_modes(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh], mode: str
) -> None:
    workers = [mock_factory(name=f"w{i}") for i in range(2)]
    mesh = mesh_factory(workers=[w.url for w in workers], lifecycle={"probe": False})
    with through_envoy(mesh, mode) as url, httpx2.Client(trust_env=False) as http:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", http_client=http)
        seen = set()
        for _ in range(4):
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
            seen.add(raw.headers["x-mock-worker"])
            assert raw.parse().choices[0].message.content
        assert seen == {"w0", "w1"}  # round robin, placed by meshkit
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            if c.choices
        )
        assert text.startswith("tok0")
        claude = anthropic.Anthropic(base_url=url, api_key="k", http_client=http)
        with claude.messages.stream(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            assert stream.get_final_message().usage.output_tokens == 8
    assert wait_until(lambda: mesh.total_load() == 0)
    assert metric(mesh, "mesh_router_requests_total", api="chat", status="200") == 5
    assert metric(mesh, "mesh_router_requests_total", api="messages", status="200") == 1
    # the books came from the response side: the usage of every answer that had one
    # (4 chats, 1 message; the chat stream asked for none)
    assert metric(mesh, "mesh_router_tokens_total", kind="output") == 5 * 8
    assert metric(mesh, "mesh_router_streams_without_usage_total", api="chat") == 1


@pytest.mark.parametrize("mode", [FD, BUFFERED])
def test_worker_key_and_dp_rank_replace_what_the_client_sent(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh], mode: str
) -> None:
    w = mock_factory(name="dp", api_key="worker-key", dp_size=2)
    mesh = mesh_factory(
        workers=[Worker(w.url, api_key="worker-key", labels={"mesh.dp_size": "2"})],
        lifecycle={"probe": False},
    )
    with through_envoy(mesh, mode) as url:
        ranks = set()
        for _ in range(4):
            r = httpx2.post(
                url + PATH,
                json=CHAT,
                headers={"authorization": "Bearer client-key", "x-data-parallel-rank": "7"},
                trust_env=False,
            )
            # the mock answers 401 unless it sees its own key, 400 for a rank >= 2
            assert r.status_code == 200, r.text
            ranks.add(r.headers["x-mock-dp-rank"])
        # BUFFERED: the rank append changed the body, and Envoy checked its length
        assert ranks == {"0", "1"}
        assert w.worker.stats.last_dp_rank in (0, 1)


@pytest.mark.parametrize("mode", [FD, BUFFERED])
def test_what_meshkit_answers_itself(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh], mode: str
) -> None:
    a = mock_factory(name="a", model="alpha")
    b = mock_factory(name="b", model="beta")
    mesh = mesh_factory(workers=[a.url, b.url], lifecycle={"probe": False})
    with through_envoy(mesh, mode) as url, httpx2.Client(base_url=url, trust_env=False) as c:
        models = c.get("/v1/models")
        assert models.status_code == 200
        assert {m["id"] for m in models.json()["data"]} == {"alpha", "beta"}  # the union

        resources = [
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/r"),
            ("GET", "/v1/conversations/conv_1"),
            ("DELETE", "/v1/conversations/conv_1/items/msg_1"),
        ]
        for method, path in resources:
            r = c.request(method, path)
            assert r.status_code == 501
            assert r.headers["content-type"] == "application/json"
            assert r.headers["x-should-retry"] == "false"
            assert r.json()["error"]["code"] == "unsupported_in_ext_proc"

        bad = c.post(PATH, content=b"{nope", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        msg = c.post("/v1/messages", content=b"[]", headers={"content-type": "application/json"})
        assert msg.status_code == 400 and msg.json()["type"] == "error"  # Anthropic's shape

        other = c.get("/health")  # not inference: a healthy worker answers it
        assert other.status_code == 200 and other.headers["x-mock-worker"] in ("a", "b")
    assert metric(mesh, "mesh_router_rejections_total", code="unsupported_in_ext_proc") == 4
    assert not any(
        p.startswith("/v1/conversations") for w in (a, b) for p in w.worker.stats.requests_total
    )
    assert wait_until(lambda: mesh.total_load() == 0)


def test_a_prefill_decode_fleet_is_refused(mesh_factory: Callable[..., Mesh]) -> None:
    port = free_port()
    mesh = mesh_factory(
        workers=[
            Worker(f"http://127.0.0.1:{port}", labels={"mesh.role": "prefill"}),
            Worker(f"http://127.0.0.1:{port + 1}", labels={"mesh.role": "decode"}),
        ],
        lifecycle={"probe": False},
    )
    with through_envoy(mesh) as url:
        r = httpx2.post(url + PATH, json=CHAT, trust_env=False)
    assert r.status_code == 501 and r.json()["error"]["code"] == "unsupported_in_ext_proc"
    assert mesh.total_load() == 0


def test_no_worker_and_an_unreachable_one_are_meshkits_errors(
    mesh_factory: Callable[..., Mesh],
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    mesh = mesh_factory(workers=[dead], lifecycle={"probe": False, "breaker_failures": 2})
    with through_envoy(mesh) as url:
        # Envoy's own "upstream connect error" (text/plain) becomes meshkit's 502
        first = httpx2.post(url + PATH, json=CHAT, trust_env=False)
        assert first.status_code == 502
        assert first.json()["error"]["code"] == "upstream_error"
        assert first.headers["x-should-retry"] == "true"
        httpx2.post(url + PATH, json=CHAT, trust_env=False)
        # the breaker heard both failures: now nobody is available, with retry hints
        none = httpx2.post(url + PATH, json=CHAT, trust_env=False)
    assert none.status_code == 503
    assert none.json()["error"]["code"] == "no_available_workers"
    assert "retry-after" in none.headers
    assert mesh.router.states.trips.get(mesh.workers[0].id, 0) == 1
    assert mesh.total_load() == 0


def test_a_body_over_the_bound_is_413_in_both_modes(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    w = mock_factory(name="w")
    mesh = mesh_factory(
        workers=[w.url], lifecycle={"probe": False}, bounds={"max_body_bytes": 2048}
    )
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}
    for mode in (FD, BUFFERED):
        with through_envoy(mesh, mode) as url:
            r = httpx2.post(url + PATH, json=big, trust_env=False)
            assert r.status_code == 413, mode
            assert r.json()["error"]["code"] == "request_too_large"
            # without a declared length, the streamed body is counted as it comes
            chunked = httpx2.post(
                url + PATH,
                content=iter([b'{"model":"m","messages":[', b" " * 4096, b"]}"]),
                headers={"content-type": "application/json"},
                trust_env=False,
            )
            assert chunked.status_code == 413, mode
    assert w.worker.stats.requests_total.get(PATH) is None


def test_bodies_past_grpcs_default_message_size_pass_and_past_the_bound_are_413(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    """A BUFFERED body is one gRPC message, gRPC refuses 4 MiB by default: the picker
    takes up to ``extproc.max_message_bytes`` (twice ``bounds.max_body_bytes`` plus
    1 MiB), so a 5 MiB chat passes in both modes and one over the body bound is
    meshkit's 413, not Envoy's empty 500."""
    w = mock_factory(name="w")
    mesh = mesh_factory(
        workers=[w.url], lifecycle={"probe": False}, bounds={"max_body_bytes": 6 << 20}
    )
    assert mesh.config.extproc.message_limit(6 << 20) == 13 << 20

    def chat_of(mib: int) -> bytes:
        text = "word " * ((mib << 20) // 5)
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()

    five, seven = chat_of(5), chat_of(7)
    assert 5 << 20 <= len(five) < 6 << 20 < 7 << 20 <= len(seven)
    for mode in (FD, BUFFERED):
        with through_envoy(mesh, mode) as url, httpx2.Client(trust_env=False) as http:
            headers = {"content-type": "application/json"}
            ok = http.post(url + PATH, content=five, headers=headers, timeout=60)
            assert ok.status_code == 200, (mode, ok.status_code, ok.text[:200])
            assert ok.headers["x-mock-worker"] == "w"
            over = http.post(url + PATH, content=seven, headers=headers, timeout=60)
            assert over.status_code == 413, (mode, over.status_code, over.text[:200])
            assert over.json()["error"]["code"] == "request_too_large"
    assert w.worker.stats.requests_total.get(PATH) == 2


def test_a_reset_while_the_picker_asks_who_owns_a_response_releases_the_question(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    """A follow-up whose ``previous_response_id`` this process does not know: the
    picker asks the workers itself, each question holding a lease. The client
    leaves while one worker never answers (Envoy resets the stream): that
    question's lease goes back and its connection closes."""
    with RawServer(stall) as hung:
        w = mock_factory(name="w")
        mesh = mesh_factory(workers=[hung.url, w.url], lifecycle={"probe": False})
        body = {"model": "m", "input": "hi", "previous_response_id": "resp_nobody0001"}
        with through_envoy(mesh, FD) as url:
            with pytest.raises(httpx2.TimeoutException):
                httpx2.post(url + "/v1/responses", json=body, timeout=0.5, trust_env=False)
            assert len(hung.requests) == 1  # the question reached it
            assert wait_until(lambda: mesh.total_load() == 0)
            assert wait_until(lambda: hung.eofs == 1)


def test_a_client_that_leaves_mid_stream_releases_everything(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    w = mock_factory(name="slow", per_token_ms=100.0, output_tokens=50)
    mesh = mesh_factory(workers=[w.url], lifecycle={"probe": False})
    with through_envoy(mesh) as url:
        with (
            httpx2.Client(trust_env=False) as c,
            c.stream("POST", url + PATH, json={**CHAT, "stream": True}) as r,
        ):
            chunks = r.iter_raw()
            next(chunks)
            assert mesh.total_load() == 1
        # only the gRPC stream closing tells the picker: the lease goes at once
        assert wait_until(lambda: mesh.total_load() == 0)
        assert wait_until(lambda: metric(mesh, "mesh_router_client_disconnects_total") == 1)
        assert mesh.router.states.leases.count(mesh.workers[0].id) == 0


def test_health_service_says_live_and_ready_once_a_worker_is_verified(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    w = mock_factory(name="w")
    mesh = mesh_factory(
        workers=[Worker(f"http://127.0.0.1:{free_port()}")],
        lifecycle={"health_interval_s": 0.05},
    )
    with ExtProcThread(mesh) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def status(service: str) -> int:
            req = health_pb2.HealthCheckRequest(service=service)
            return int(stub.Check(req, timeout=5).status)

        serving = health_pb2.HealthCheckResponse.SERVING
        assert status("liveness") == serving
        # the only worker is down: not ready (the first round has set it by now)
        assert status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        mesh.add_worker(w.url)  # probed at once
        for name in ("readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert wait_until(cast(Callable[[], bool], lambda n=name: status(n) == serving)), name


def test_streams_are_bounded(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    w = mock_factory(name="slow", per_token_ms=100.0, output_tokens=30)
    mesh = mesh_factory(workers=[w.url], lifecycle={"probe": False})
    with through_envoy(mesh, max_streams=1) as url, httpx2.Client(trust_env=False) as c:
        with c.stream("POST", url + PATH, json={**CHAT, "stream": True}) as held:
            chunks = held.iter_raw()  # kept: a dropped iterator closes the response
            next(chunks)  # the one stream the picker may hold
            refused = c.post(url + PATH, json=CHAT)
            # grpc refuses the second stream (RESOURCE_EXHAUSTED); Envoy answers it
            assert refused.status_code >= 500
        # the slot comes back once Envoy has closed the first stream
        assert wait_until(lambda: c.post(url + PATH, json=CHAT).status_code == 200)


def test_the_subset_hint_restricts_the_candidates(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    workers = [mock_factory(name=f"w{i}") for i in range(3)]
    mesh = mesh_factory(workers=[w.url for w in workers], lifecycle={"probe": False})
    allowed = [w.url.removeprefix("http://") for w in workers[1:]]
    with (
        ExtProcThread(mesh) as port,
        EnvoyProcess(port, subset_hint=allowed) as envoy,
        httpx2.Client(trust_env=False) as c,
    ):
        seen = [c.post(envoy.url + PATH, json=CHAT).headers["x-mock-worker"] for _ in range(6)]
    assert sorted(set(seen)) == ["w1", "w2"]  # w0 is out of the hint
    # an empty hint, or one naming no worker of this fleet: 503, as the GIE defines
    for hint in ([], ["10.9.9.9:1"]):
        with (
            ExtProcThread(mesh) as port,
            EnvoyProcess(port, subset_hint=hint) as envoy,
        ):
            r = httpx2.post(envoy.url + PATH, json=CHAT, trust_env=False)
        assert r.status_code == 503, hint
        assert r.json()["error"]["code"] == "no_available_workers"
    assert mesh.total_load() == 0


def test_shed_load_is_429_with_the_retry_hint(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    w = mock_factory(name="slow", per_token_ms=100.0, output_tokens=30)
    mesh = mesh_factory(
        workers=[w.url], lifecycle={"probe": False}, upstream={"max_in_flight_per_worker": 1}
    )
    with through_envoy(mesh) as url, httpx2.Client(trust_env=False) as c:
        with c.stream("POST", url + PATH, json={**CHAT, "stream": True}) as held:
            chunks = held.iter_raw()  # kept: a dropped iterator closes the response
            next(chunks)  # the worker's one slot is taken
            shed = c.post(url + PATH, json=CHAT)
        assert shed.status_code == 429
        assert shed.json()["error"]["code"] == "overloaded"
        assert shed.headers["x-should-retry"] == "true" and "retry-after" in shed.headers
        assert c.post(url + PATH, json=CHAT).status_code == 200
    assert metric(mesh, "mesh_router_rejections_total", code="overloaded") == 1
