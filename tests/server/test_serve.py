"""``meshkit serve`` as a subprocess: flags, a TOML file, real SDK traffic, metrics, probes."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import wait_until

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "say hello"}]


def requests_total(base: str) -> dict[tuple[str, str], float]:
    r = httpx2.get(base + "/metrics", trust_env=False)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == "mesh_router_requests_total":
                out[(s.labels["api"], s.labels["status"])] = s.value
    return out


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base + "/v1",
        api_key="client-key",
        max_retries=0,
        http_client=httpx2.Client(trust_env=False),
    )


def test_serve_with_worker_flags(mock_factory: Any, spawn: Any) -> None:
    w0 = mock_factory(name="w0", output_tokens=5)
    w1 = mock_factory(name="w1", output_tokens=5)
    gw = spawn(
        "serve",
        "--worker",
        w0.url,
        "--worker",
        f"{w1.url}#mesh.apis=chat,completions;mesh.model=mock-model",
        "--policy",
        "round_robin",
        "--port",
        "0",
    )
    base = gw.url
    # ready once a probe has answered (it runs as the gateway starts)
    assert wait_until(lambda: httpx2.get(base + "/readiness", trust_env=False).status_code == 200)
    for path in ("/health", "/liveness", "/readiness"):
        r = httpx2.get(base + path, trust_env=False)
        assert r.status_code == 200, (path, r.text)
    assert httpx2.get(base + "/health", trust_env=False).json()["workers"] == 2

    with sdk(base) as client:
        raw = client.chat.completions.with_raw_response.create(model="mock-model", messages=MSG)
        assert raw.parse().choices[0].message.content
        first = raw.headers["x-mock-worker"]
        stream = client.chat.completions.create(
            model="mock-model",
            messages=MSG,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        # round_robin: the stream went to the other worker
        assert stream.response.headers["x-mock-worker"] == ({"w0", "w1"} - {first}).pop()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

    # Accounting ends when the body does, just after the client saw it: poll.
    assert wait_until(lambda: requests_total(base).get(("chat", "200")) == 2)
    assert sum(requests_total(base).values()) == 2
    workers = httpx2.get(base + "/workers", trust_env=False).json()["workers"]
    assert [w["url"] for w in workers] == [w0.url, w1.url]
    assert workers[1]["labels"]["mesh.apis"] == "chat,completions"

    gw.signal(signal.SIGINT)
    rc, err = gw.wait()
    assert rc == 0, err


def test_serve_with_a_toml_file(mock_factory: Any, spawn: Any, tmp_path: Path) -> None:
    w = mock_factory(name="keyed", api_key="sk-worker")
    conf = tmp_path / "meshkit.toml"
    conf.write_text(
        f"""
policy = "least_load"

[server]
port = 0
grace_s = 5.0

[[workers]]
url = "{w.url}"
api_key_env = "TEST_WORKER_KEY"
labels = {{ "mesh.apis" = "chat" }}
"""
    )
    gw = spawn("serve", "--config", str(conf), env={"TEST_WORKER_KEY": "sk-worker"})
    with sdk(gw.url) as client:
        chat = client.chat.completions.create(model="m", messages=MSG)
    assert chat.choices[0].message.content
    # the gateway replaced the client's key with the worker's own
    assert w.worker.stats.last_header("authorization") == "Bearer sk-worker"
    assert wait_until(lambda: requests_total(gw.url).get(("chat", "200")) == 1)


def test_env_workers_and_a_flag_port(mock_factory: Any, spawn: Any) -> None:
    w = mock_factory(name="from-env")
    gw = spawn("serve", "--port", "0", env={"MESHKIT_WORKERS": w.url})
    with sdk(gw.url) as client:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MSG)
    assert raw.headers["x-mock-worker"] == "from-env"


def test_probes_without_workers(spawn: Any) -> None:
    gw = spawn("serve", "--port", "0", "--log-level", "warning")
    get: Callable[[str], httpx2.Response] = lambda path: httpx2.get(gw.url + path, trust_env=False)  # noqa: E731
    assert get("/health").status_code == 503
    assert get("/health").json()["status"] == "unavailable"
    assert get("/readiness").status_code == 503
    assert get("/liveness").status_code == 200
    assert get("/metrics").status_code == 200
    assert get("/nothing-here").status_code == 404


def test_workers_are_probed_before_the_gateway_says_ready(mock_factory: Any, spawn: Any) -> None:
    """A worker that does not answer its health probe never makes the gateway ready,
    and is not where the first request goes; a healthy one makes it ready."""
    dead = mock_factory(name="dead")
    dead_url = dead.url
    dead.kill()
    live = mock_factory(name="live")
    gw = spawn("serve", "--port", "0", "--worker", dead_url, "--policy", "round_robin")
    get: Callable[[str], httpx2.Response] = lambda path: httpx2.get(gw.url + path, trust_env=False)  # noqa: E731

    def probed() -> bool:
        workers = get("/workers").json()["workers"]
        return bool(workers) and workers[0]["state"] != "unverified"

    assert wait_until(probed)
    assert get("/readiness").status_code == 503
    assert get("/health").json()["verified_workers"] == 0

    both = spawn(
        "serve", "--port", "0", "--worker", dead_url, "--worker", live.url,
        "--policy", "round_robin",
    )  # fmt: skip
    assert wait_until(
        lambda: httpx2.get(both.url + "/readiness", trust_env=False).status_code == 200
    )
    with sdk(both.url) as client:
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(model="m", messages=MSG)
            assert raw.headers["x-mock-worker"] == "live"


def test_unknown_paths_are_openai_shaped_404s(spawn: Any) -> None:
    gw = spawn("serve", "--port", "0")
    r = httpx2.get(gw.url + "/nothing-here", trust_env=False)
    assert r.status_code == 404
    assert r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "unknown_endpoint"
    r = httpx2.post(gw.url + "/readiness", trust_env=False)
    assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed")
    assert r.headers["allow"] == "GET, HEAD"


def test_mock_worker_subcommand(spawn: Any) -> None:
    mock = spawn("mock-worker", "--port", "0", "--name", "sub")
    r = httpx2.get(mock.url + "/health", trust_env=False)
    assert r.status_code == 200
    assert r.headers["x-mock-worker"] == "sub"
    mock.signal(signal.SIGTERM)
    assert mock.wait()[0] == 0


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("granian") is not None, reason="granian is installed"
)
def test_granian_missing_is_a_clear_error(meshkit_run: Any) -> None:
    p = meshkit_run("serve", "--server", "granian", "--worker", "http://127.0.0.1:9")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "meshkit: error: --server granian: granian is not installed "
        "(pip install 'meshkit[granian]')"
    ]
