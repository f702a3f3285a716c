"""Every example runs with its documented command and exits 0."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx2
import pytest

from harness import reusable_port, wait_until
from meshkit import Mesh
from meshkit import config as config_module

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("client_sdk/sync_client.py", ["chat ", "-> w0", "messages stream", "-> w1"]),
        ("client_sdk/async_client.py", ["request 7 ->", "per worker:"]),
    ],
)
def test_client_sdk_examples(script: str, expected: list[str]) -> None:
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
        check=False,
    )
    assert p.returncode == 0, p.stderr
    for text in expected:
        assert text in p.stdout


def test_fastapi_example() -> None:
    port = reusable_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "fastapi_app" / "app.py"), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    try:
        client = httpx2.Client(base_url=base, trust_env=False, timeout=10)

        def up() -> bool:
            try:
                return client.get("/hello").status_code == 200
            except httpx2.TransportError:
                return proc.poll() is None and False

        assert wait_until(up, timeout=30), proc.poll()
        assert client.get("/hello").json() == {"hello": "from FastAPI"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200
        assert r.headers["x-mock-worker"] in {"w0", "w1"}
        assert r.json()["choices"][0]["message"]["content"]
        client.close()
        proc.send_signal(signal.SIGINT)  # Ctrl+C, as the README says
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert f"curl {base}/hello" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_example_config_loads_and_documents_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    path = EXAMPLES / "meshkit.toml"
    monkeypatch.setenv("W1_KEY", "sk-example")
    with Mesh.from_config(path) as mesh:
        assert len(mesh.workers) == 2
        assert mesh.workers[0].api_key == "sk-example"

    text = path.read_text()
    data = tomllib.loads(text)
    sections = {
        name: cls
        for name, cls in vars(config_module).items()
        if dataclasses.is_dataclass(cls) and name.endswith("Config") and name != "MeshConfig"
    }
    top = {f.name for f in dataclasses.fields(config_module.MeshConfig)}
    for key in top:
        # every top-level key and section appears, set or commented out
        assert key in data or f"# {key} =" in text or f"[{key}]" in text, key
    for name, cls in sections.items():
        for f in dataclasses.fields(cls):
            assert f"{f.name} =" in text, f"{name}.{f.name} is not documented"
