"""Overload at ten times the configured capacity (CI size; ``benchmarks/overload.py``
runs the full size).

Prepare pool: one thread and a queue of four, with a slow preparation (held on a
gate, like a tokenizer that takes its time). Ten times that capacity arrives at
once: the excess is refused at once with 503 ``prepare_queue_full`` and retry
hints while the admitted requests are still held — nobody waits for them; then
the admitted requests complete, the process's memory did not balloon and a
normal request succeeds.

Upstream: requests in flight to workers are bounded by admission control
(``upstream.max_in_flight_per_worker``, default ``pool_limit_per_worker``, and
``upstream.max_in_flight``, default ``pool_limit``): past the limit, a request is
refused at once with 503 ``overloaded`` and retry hints, before any byte goes
upstream, the worker is not blamed (no breaker opens) and the next request after
the burst succeeds. A pool-acquire timeout in the upstream adapters (when the pool
is smaller than the admission limit) is ``Failure.POOL``: 503, never a breaker
failure. In every mode, and for prefill/decode pairs.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx2
import pytest
from faultkit import assert_settled, count_submits, metric_value, report, stream_head

from harness import Mode, wait_until
from meshkit import Mesh, Worker
from meshkit.prepare.pool import current_worker_index

PATH = "/v1/chat/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
QUEUE = 4
CAPACITY = QUEUE + 1  # one preparing, four waiting
RSS_BOUND = 200 * 1024 * 1024


def rss_bytes() -> int:
    """VmRSS of this process (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _done(futures: list[Any]) -> list[Any]:
    """What the requests already ended with (for a failure's message)."""
    return [(f.result().status, f.result().body[:120]) if f.done() else None for f in futures]


def _gate_preparation(mesh: Mesh) -> threading.Event:
    """Make every preparation wait on a gate: a slow path meshkit cannot skip."""
    gate = threading.Event()
    pool = mesh.pool
    inner = pool.submit

    def submit(fn: Any, within_s: float | None = None) -> Any:
        def slow() -> Any:
            if current_worker_index() is not None:  # only in the pool's threads
                gate.wait(60)
            return fn()

        return inner(slow, within_s)

    pool.submit = submit  # type: ignore[method-assign]
    return gate


def test_prepare_overload_is_refused_at_once_and_recovers(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, mode_name: str
) -> None:
    mock = mock_factory(name="o")
    mesh: Mesh = mesh_factory(
        workers=[Worker(mock.url)],
        # A queue wait long enough for the slowest machine: the admitted requests
        # wait on the gate for as long as the excess takes to be refused.
        prepare={
            "workers": 1,
            "queue_capacity": QUEUE,
            "inline_threshold_bytes": 0,
            "queue_timeout_ms": 120_000,
            "timeout_ms": 120_000,
        },
        lifecycle={"probe": False},
    )
    gate = _gate_preparation(mesh)
    submitted = count_submits(mesh)
    mode: Mode = run_mode(mesh)
    assert mode.request("GET", "/v1/models").status == 200  # warm the client and pools
    rss_before = rss_bytes()
    total = 10 * CAPACITY
    with ThreadPoolExecutor(total) as pool:
        admitted = []
        for i in range(CAPACITY):
            # One at a time, each seen by the pool before the next: on a busy
            # machine requests sent together can reach it in any order and time.
            admitted.append(pool.submit(mode.request, "POST", PATH, json=CHAT))
            seen = wait_until(
                cast(Callable[[], bool], lambda n=i + 1: mesh.pool.running + mesh.pool.queued == n),
                60,
            )
            assert seen, (i, mesh.pool.running, mesh.pool.queued, _done(admitted))
        assert (mesh.pool.running, mesh.pool.queued) == (1, QUEUE)
        excess = [
            pool.submit(mode.request, "POST", PATH, json=CHAT) for _ in range(total - CAPACITY)
        ]
        refused = [f.result(timeout=60) for f in excess]
        # every refusal came back while the admitted requests were still held
        assert not gate.is_set()
        assert not any(f.done() for f in admitted)
        gate.set()
        served = [f.result(timeout=60) for f in admitted]
    rss_after = rss_bytes()

    assert [r.status for r in served] == [200] * CAPACITY
    for r in refused:
        assert r.status == (429 if mode_name == "extproc" else 503), r.body  # GIE: shed is 429
        assert r.json()["error"]["code"] == "prepare_queue_full"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert int(r.headers["retry-after-ms"]) > 0
        assert "x-mock-worker" not in r.headers
    assert metric_value(mesh, "mesh_router_rejections_total", code="prepare_queue_full") == len(
        refused
    )
    assert mock.worker.stats.requests_total.get(PATH) == CAPACITY
    growth = rss_after - rss_before
    assert growth < RSS_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB"
    # it recovers: the next request goes through at once
    after = mode.request("POST", PATH, json=CHAT)
    assert after.status == 200
    state = assert_settled(mesh, submitted=submitted)
    report(
        f"overload-prepare-{mode_name}",
        {
            "capacity": CAPACITY,
            "offered": total,
            "served": len(served),
            "refused_503": len(refused),
            "rss_growth_mib": round(growth / 2**20, 2),
            "settled": state,
        },
    )


def _assert_overloaded(status: int, headers: Any, body: bytes, mode: str = "") -> None:
    # ext-proc answers shed load 429, the GIE picker protocol's status for it
    assert status == (429 if mode == "extproc" else 503), body
    assert 1 <= int(headers["retry-after"]) <= 60
    assert int(headers["retry-after-ms"]) > 0
    assert "x-mock-worker" not in headers  # meshkit's own answer
    error = json.loads(body)["error"]
    assert error["code"] == "overloaded" and error["type"] == "server_error"


def test_upstream_overload_is_refused_with_503(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, mode_name: str
) -> None:
    slow = mock_factory(name="s", per_token_ms=50, output_tokens=400)  # ~20 s streams
    mesh: Mesh = mesh_factory(
        workers=[Worker(slow.url)],
        upstream={"pool_limit_per_worker": 2, "pool_limit": 2, "connect_timeout_s": 1.0},
        lifecycle={"probe": False},
    )
    mode: Mode = run_mode(mesh)
    body = {**CHAT, "stream": True}
    held: list[tuple[Any, Any]] = []
    with ThreadPoolExecutor(2) as pool:
        try:
            for _ in range(2):  # the two upstream requests allowed, busy
                cm = mode.stream("POST", PATH, json=body)
                chunks = iter(cm.__enter__())
                next(chunks)
                held.append((cm, chunks))
            assert mesh.total_load() == 2
            # a stream and a plain request over the limit: refused at once
            streamed = pool.submit(stream_head, mode, PATH, body)
            status, headers, first = streamed.result(timeout=5)  # a hang fails here
            # the error body is one small piece
            _assert_overloaded(status, headers, first, mode_name)
            plain = pool.submit(mode.request, "POST", PATH, json=CHAT).result(timeout=5)
            _assert_overloaded(plain.status, plain.headers, plain.body, mode_name)
            # nothing went upstream for them
            assert slow.worker.stats.requests_total.get(PATH) == 2
            assert mesh.total_load() == 2
        finally:
            for cm, _chunks in held:
                cm.__exit__(None, None, None)
    assert metric_value(mesh, "mesh_router_rejections_total", code="overloaded") == 2
    assert wait_until(lambda: mesh.total_load() == 0)
    # no breaker opened against the healthy worker: the next request is served
    after = mode.request("POST", PATH, json={**CHAT, "max_tokens": 2})
    assert after.status == 200, after.body
    assert_settled(mesh)


def test_the_limit_is_per_worker_and_global(mock_factory: Any, mesh_factory: Any) -> None:
    """Two workers with one slot each, a global limit of 3, then of 1: the Mesh
    lease path refuses exactly past each bound (sync transport, held streams)."""
    from meshkit import MeshTransport

    mocks = [mock_factory(name=f"w{i}", per_token_ms=50, output_tokens=400) for i in range(3)]
    mesh: Mesh = mesh_factory(
        workers=[Worker(m.url) for m in mocks],
        upstream={"max_in_flight_per_worker": 1, "max_in_flight": 2},
        lifecycle={"probe": False},
    )
    body = {**CHAT, "stream": True}
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        opened = []
        try:
            for _ in range(2):  # two workers busy: the global cap is reached
                r = client.send(client.build_request("POST", PATH, json=body), stream=True)
                assert r.status_code == 200
                opened.append(r)
            assert sorted(mesh.load_of(w) for w in mesh.workers) == [0, 1, 1]
            r = client.post(PATH, json=CHAT)  # the third worker is free, the fleet is not
            assert r.status_code == 503
            assert "2 requests in flight" in r.json()["error"]["message"]
            opened.pop().close()
            assert wait_until(lambda: mesh.total_load() == 1)
            r = client.post(PATH, json={**CHAT, "max_tokens": 1})
            assert r.status_code == 200  # cap - 1: admitted
        finally:
            for r in opened:
                r.close()
    assert wait_until(lambda: mesh.total_load() == 0)


def test_a_pd_pair_is_admitted_as_a_pair(mock_factory: Any, mesh_factory: Any) -> None:
    from meshkit import MeshTransport

    prefill = mock_factory(name="p", pd_role="prefill")
    decode = mock_factory(name="d", pd_role="decode", output_tokens=400, per_token_ms=50)
    mesh: Mesh = mesh_factory(
        workers=[
            Worker(prefill.url, labels={"mesh.role": "prefill"}),
            Worker(decode.url, labels={"mesh.role": "decode"}),
        ],
        upstream={"max_in_flight_per_worker": 1},
        lifecycle={"probe": False},
    )
    body = {**CHAT, "stream": True}
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        r = client.send(client.build_request("POST", PATH, json=body), stream=True)
        try:
            assert r.status_code == 200
            chunks = r.iter_raw()
            next(chunks)
            # a pair holds both legs' slots for the whole response: both at their limit
            assert mesh.total_load() == 2
            refused = client.post(PATH, json=CHAT)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "overloaded"
        finally:
            r.close()
    assert wait_until(lambda: mesh.total_load() == 0)
    assert decode.worker.stats.requests_total.get(PATH) == 1


# -- pool-acquire timeouts in the upstream adapters: Failure.POOL ---------------------------


def _attempt(url: str, stream: bool = True) -> Any:
    from upstreams import attempt

    body = json.dumps({**CHAT, "stream": stream}).encode()
    return attempt(url + PATH, body, headers=[(b"content-type", b"application/json")])


@pytest.mark.parametrize("lib_name", ["httpx", "httpx2"])
def test_httpx_pool_timeout_is_a_pool_failure(mock_factory: Any, lib_name: str) -> None:
    import importlib

    from meshkit.config import UpstreamConfig
    from meshkit.core.forward import Failure
    from meshkit.upstream.base import UpstreamFailure
    from meshkit.upstream.inner import InnerUpstream

    lib = importlib.import_module(lib_name)
    slow = mock_factory(name="s", per_token_ms=50, output_tokens=400)
    cfg = UpstreamConfig(connect_timeout_s=0.2, pool_limit=1)
    up = InnerUpstream(lib.HTTPTransport(limits=lib.Limits(max_connections=1)), cfg)
    try:
        busy = up.send(_attempt(slow.url))
        try:
            with pytest.raises(UpstreamFailure) as ei:
                up.send(_attempt(slow.url))
            assert ei.value.failure is Failure.POOL
        finally:
            busy.close()
    finally:
        up.close()


def test_fastrelay_pool_wait_timeout_is_a_pool_failure(mock_factory: Any) -> None:
    from meshkit.config import UpstreamConfig
    from meshkit.core.forward import Failure
    from meshkit.upstream.base import UpstreamFailure
    from meshkit.upstream.fast import FastUpstream

    slow = mock_factory(name="s", per_token_ms=50, output_tokens=400)

    async def go() -> Failure:
        up = FastUpstream(UpstreamConfig(connect_timeout_s=0.2, pool_limit_per_worker=1))
        try:
            busy = await up.asend(_attempt(slow.url))
            try:
                with pytest.raises(UpstreamFailure) as full:
                    await up.asend(_attempt(slow.url))
            finally:
                await busy.aclose()
            return full.value.failure
        finally:
            await up.aclose()

    assert asyncio.run(go()) is Failure.POOL


def test_a_pool_timeout_answers_503_and_opens_no_breaker(
    mock_factory: Any, mesh_factory: Any
) -> None:
    """The pool smaller than the admission limit (both configurable): the excess
    waits ``connect_timeout_s`` for a connection, then 503, not 502, and the
    worker's breaker hears nothing of it."""
    from meshkit import MeshTransport

    slow = mock_factory(name="s", per_token_ms=50, output_tokens=400)
    mesh: Mesh = mesh_factory(
        workers=[Worker(slow.url)],
        upstream={
            "pool_limit": 1,
            "max_in_flight": 10,
            "max_in_flight_per_worker": 10,
            "connect_timeout_s": 0.2,
            "max_attempts": 1,
        },
        lifecycle={"probe": False, "breaker_failures": 1},
    )
    body = {**CHAT, "stream": True}
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        r = client.send(client.build_request("POST", PATH, json=body), stream=True)
        try:
            assert r.status_code == 200
            refused = client.post(PATH, json=CHAT)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "overloaded"
        finally:
            r.close()
    assert wait_until(lambda: mesh.total_load() == 0)
    assert mesh.router.states.trips.get(slow.url, 0) == 0  # breaker_failures = 1: one would trip
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        assert client.post(PATH, json={**CHAT, "max_tokens": 1}).status_code == 200


def test_a_burst_on_a_fresh_transport_builds_one_pool(
    mock_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads sharing a new client at once: one connection pool, so the configured
    connection limits hold (each racing request used to build its own). Counted at
    the upstream the transport makes for httpx2 (meshkit.upstream.select's)."""
    import httpx2

    import meshkit.upstream.select
    from meshkit import MeshTransport
    from meshkit.upstream.blocking import BlockingUpstream

    mock = mock_factory(name="b")
    built: list[object] = []

    def counting(*args: Any, **kw: Any) -> BlockingUpstream:
        # a factory, not a subclass: a compiled BlockingUpstream has no interpreted ones
        up = BlockingUpstream(*args, **kw)
        built.append(up)
        return up

    monkeypatch.setattr(meshkit.upstream.select, "BlockingUpstream", counting)
    mesh = Mesh(workers=[Worker(mock.url)], lifecycle={"probe": False})
    try:
        client = httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh")
        barrier = threading.Barrier(32)

        def one(_: int) -> int:
            barrier.wait()
            return client.post(PATH, json=CHAT).status_code

        with ThreadPoolExecutor(32) as pool:
            assert list(pool.map(one, range(32))) == [200] * 32
        assert len(built) == 1
        client.close()
    finally:
        mesh.close()
