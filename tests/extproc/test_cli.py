"""``meshkit extproc`` as an operator runs it: a real process behind a real Envoy,
real signals (SIGTERM's grace, SIGHUP's reload) and the metrics port."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx2
import pytest

from harness import EXTPROC, free_port, wait_until

if not EXTPROC:
    pytest.skip("needs grpcio and an envoy binary (the test extra)", allow_module_level=True)
EnvoyProcess = pytest.importorskip("meshkit.testing.envoy").EnvoyProcess

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PATH = "/v1/chat/completions"


def _port(proc: Any) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def test_sigterm_lets_a_stream_through_envoy_finish(mock_factory: Any, spawn: Any) -> None:
    w = mock_factory(name="slow", per_token_ms=100.0, output_tokens=12)
    picker = spawn("extproc", "--worker", w.url, "--port", "0", "--metrics-port", "0")
    with (
        EnvoyProcess(_port(picker)) as envoy,
        httpx2.Client(trust_env=False, timeout=30) as client,
        client.stream("POST", envoy.url + PATH, json={**CHAT, "stream": True}) as r,
    ):
        assert r.status_code == 200
        chunks = r.iter_bytes()
        body = next(chunks)
        picker.signal(signal.SIGTERM)
        body += b"".join(chunks)
    events = [x for x in body.decode().splitlines() if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and sum("tok" in e for e in events) == 12
    rc, err = picker.wait()
    assert rc == 0, err
    assert "Traceback" not in err


def test_metrics_port_and_sighup(mock_factory: Any, spawn: Any, tmp_path: Path) -> None:
    a = mock_factory(name="a")
    b = mock_factory(name="b")
    conf = tmp_path / "meshkit.toml"
    conf.write_text(f'[[workers]]\nurl = "{a.url}"\n')
    metrics_port = free_port()
    picker = spawn(
        "extproc", "--config", str(conf), "--port", "0", "--metrics-port", str(metrics_port)
    )
    admin = f"http://127.0.0.1:{metrics_port}"
    with EnvoyProcess(_port(picker)) as envoy, httpx2.Client(trust_env=False) as c:
        assert c.post(envoy.url + PATH, json=CHAT).headers["x-mock-worker"] == "a"
        text = c.get(admin + "/metrics").text
        assert 'mesh_router_requests_total{api="chat",status="200"} 1.0' in text
        assert wait_until(lambda: c.get(admin + "/readiness").status_code == 200)

        conf.write_text(f'[[workers]]\nurl = "{b.url}"\n')
        picker.signal(signal.SIGHUP)
        assert wait_until(
            lambda: [w["url"] for w in c.get(admin + "/workers").json()["workers"]] == [b.url]
        )
        assert c.post(envoy.url + PATH, json=CHAT).headers["x-mock-worker"] == "b"
    picker.signal(signal.SIGTERM)
    rc, err = picker.wait()
    assert rc == 0, err
    assert "reloaded: workers: 1 added, 0 updated, 1 removed" in err


def test_a_bad_flag_or_config_is_one_line_and_exit_2(tmp_path: Path, spawn: Any) -> None:
    import subprocess
    import sys

    conf = tmp_path / "m.toml"
    conf.write_text("[extproc]\nmax_streams = 0\n")
    r = subprocess.run(
        [sys.executable, "-m", "meshkit", "extproc", "--config", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "extproc.max_streams" in line
