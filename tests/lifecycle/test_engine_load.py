"""Load every router sees: the probes read each engine's own gauges (the mock serves
vLLM's ``vllm:num_requests_running``), so a router places around requests that
another router put on a worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx2

from meshkit import Mesh, MeshTransport
from meshkit.mock.thread import MockWorkerThread

STREAM = {"model": "m", "prompt": "a b c", "stream": True, "max_tokens": 400}


def test_a_router_sees_the_requests_another_router_holds(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    a = mock_factory(name="a", output_tokens=400, per_token_ms=20)
    b = mock_factory(name="b", output_tokens=400, per_token_ms=20)
    other = mesh_factory(workers=[a.url], lifecycle={"probe": False})
    mine = mesh_factory(
        workers=[a.url, b.url], policy="least_load", lifecycle={"health_interval_s": 0.05}
    )
    mine.lifecycle.start()
    release = threading.Event()
    started = threading.Barrier(4)

    def hold() -> None:  # the other router's long streams on a
        client = httpx2.Client(transport=MeshTransport(other), base_url="http://mesh")
        with client, client.stream("POST", "/v1/completions", json=STREAM) as r:
            it = r.iter_raw()
            next(it)
            started.wait(10)
            release.wait(30)

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        started.wait(10)

        def others_on_a() -> int:
            row = mine.router.describe(a.url)[0]
            return int(row.get("engine_load", {}).get("other_routers", 0))

        deadline = time.monotonic() + 20
        while others_on_a() < 3:
            assert time.monotonic() < deadline, "the probes never reported a's load"
            time.sleep(0.02)
        with httpx2.Client(transport=MeshTransport(mine), base_url="http://mesh") as c:
            got = [
                c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
                for _ in range(3)
            ]
        assert [r.headers["x-mock-worker"] for r in got] == ["b", "b", "b"]
    finally:
        release.set()
        for t in threads:
            t.join(30)
    deadline = time.monotonic() + 20
    while others_on_a():  # the streams ended: the next report says so
        assert time.monotonic() < deadline, "a's load never came down"
        time.sleep(0.02)


def test_metrics_over_their_bound_are_not_read_cut(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh], caplog: Any
) -> None:
    """``lifecycle.max_metrics_bytes``: a text over it is not parsed (a cut one may
    end inside a gauge's value), and the log says so once; one within it is."""
    worker = mock_factory(name="a")
    # The text grows a little as the mock counts requests: a margin either side.
    size = len(httpx2.get(worker.url + "/metrics").content)
    big, small = size + 200, size // 2
    caplog.set_level("WARNING", logger="meshkit.lifecycle")
    meshes = {
        limit: mesh_factory(
            workers=[worker.url],
            lifecycle={"health_interval_s": 0.05, "max_metrics_bytes": limit},
        )
        for limit in (big, small)
    }
    for mesh in meshes.values():
        mesh.lifecycle.start()
    probes: Callable[[], int] = lambda: worker.worker.stats.requests_total.get("/metrics", 0)  # noqa: E731
    deadline = time.monotonic() + 20
    while "engine_load" not in meshes[big].router.describe(worker.url)[0] or probes() < 10:
        assert time.monotonic() < deadline, "the metrics were never read"
        time.sleep(0.02)
    assert "engine_load" not in meshes[small].router.describe(worker.url)[0]
    warned = [r.getMessage() for r in caplog.records if "max_metrics_bytes" in r.getMessage()]
    assert warned == [
        f"the metrics of {worker.url} are over lifecycle.max_metrics_bytes ({small} bytes); "
        "its engine load is not read"
    ]
