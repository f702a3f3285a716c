"""Fuzzing the three adapter kinds in process (ASGI, WSGI, sync transport).

For any method, path, query, headers and body: meshkit answers a 4xx in the
called API's error shape (counted in ``mesh_router_rejections_total``), or
forwards to a path of the endpoint registry (a template, or a resource path with
a valid id), or hands the request to the wrapped app / passes it through when
the path is not an inference path. Never a 5xx of its own (a worker's own 5xx,
marked by the mock's ``x-mock-worker``, is relayed as is), never an exception
into the host, never load left behind.

Examples per property: 300 (CI), 10,000 with ``MESHKIT_PROFILE=full``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fuzzkit import (
    MODEL_PATH,
    STATIC,
    AsgiDriver,
    Got,
    Req,
    Seen,
    TransportDriver,
    Unsendable,
    WsgiDriver,
    anthropic_path,
    fuzz_settings,
    in_registry,
    requests,
    under_prefix,
)
from hypothesis import given

from meshkit import Mesh
from meshkit.mock import MockConfig, MockWorkerThread

DRIVERS: dict[str, type[AsgiDriver | WsgiDriver | TransportDriver]] = {
    "asgi": AsgiDriver,
    "wsgi": WsgiDriver,
    "transport": TransportDriver,
}
FIGURES: dict[str, dict[str, int]] = {}


class Env:
    def __init__(self) -> None:
        self.mock = MockWorkerThread(MockConfig(name="fz"))
        self.mock.start()
        self.seen = Seen(self.mock)
        self.mesh = Mesh(
            workers=[self.mock.url],
            routing={"seed": 1},
            lifecycle={"probe": False},
            bounds={"max_body_bytes": 65_536, "max_header_bytes": 8_192, "max_headers": 64},
        )

    def rejections(self) -> float:
        total = 0.0
        for metric in self.mesh.metrics.registry.collect():
            for sample in metric.samples:
                if sample.name == "mesh_router_rejections_total":
                    total += sample.value
        return total

    def close(self) -> None:
        self.mesh.close()
        self.mock.stop()


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    e = Env()
    yield e
    e.close()


def _error_shape_ok(body: bytes, anthropic: bool) -> bool:
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return False
    err = obj["error"]
    if anthropic:
        return obj.get("type") == "error" and {"type", "message"} <= err.keys()
    return {"message", "type", "param", "code"} <= err.keys() and isinstance(err["code"], str)


def check(name: str, env: Env, req: Req, got: Got, new_paths: list[str], rejected: float) -> str:
    """The invariants for one example; returns its outcome class."""
    seen_path = got.extra.get("sent_path", req.raw_path.decode("latin-1"))
    for p in new_paths:
        passed_through = name == "transport" and p == seen_path and not under_prefix(seen_path)
        assert in_registry(p) or passed_through, f"forwarded to {p!r} (sent {seen_path!r})"
    if got.host_app:
        assert name in ("asgi", "wsgi")
        assert not new_paths
        assert not under_prefix(seen_path) and seen_path not in STATIC, seen_path
        return "host_app"
    if got.from_worker:
        # no request reached the worker's app: its HTTP parser refused the bytes
        assert new_paths or got.status == 400, "a worker answer without a forwarded request"
        return f"worker_{got.status // 100}xx"
    if name == "transport" and not under_prefix(seen_path) and new_paths:
        return "passed_through"
    if got.status < 400:
        # only meshkit's own answers: the merged model list, or one model of it
        listing = seen_path == "/v1/models" or seen_path.startswith(MODEL_PATH)
        assert listing and req.method == "GET", (got.status, seen_path)
        return "mesh_2xx"
    # (When every worker refuses the listing, their own 4xx is relayed: from_worker.)
    assert got.status < 500, f"meshkit answered {got.status}: {got.body[:300]!r}"
    assert _error_shape_ok(got.body, anthropic_path(seen_path)), got.body[:300]
    assert rejected == 1, f"{rejected} rejections counted for one refusal"
    return f"mesh_{got.status}"


@pytest.mark.parametrize("name", list(DRIVERS))
def test_adapter_answers_4xx_or_forwards(env: Env, name: str) -> None:
    driver = DRIVERS[name](env.mesh)
    figures: dict[str, int] = {}

    @fuzz_settings()
    @given(req=requests())
    def prop(req: Req) -> None:
        before = len(env.seen.paths)
        rejections = env.rejections()
        try:
            got = driver(req)  # an exception escaping the adapter fails here
        except Unsendable:
            figures["client_refused"] = figures.get("client_refused", 0) + 1
            return
        outcome = check(name, env, req, got, env.seen.paths[before:], env.rejections() - rejections)
        assert env.mesh.total_load() == 0
        figures[outcome] = figures.get(outcome, 0) + 1

    try:
        prop()
    finally:
        driver.close()
    FIGURES[name] = figures
    _report(name, figures)


def _report(name: str, figures: dict[str, int]) -> None:
    import os
    from pathlib import Path

    where = os.environ.get("MESHKIT_REPORT_DIR")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        out = {"driver": name, "examples": sum(figures.values()), "outcomes": figures}
        (Path(where) / f"fuzz-{name}.json").write_text(json.dumps(out, indent=2, sort_keys=True))
