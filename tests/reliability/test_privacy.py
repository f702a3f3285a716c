"""Credentials and privacy: planted secrets never show where they must not.

Planted: a worker key, a client key, a prompt, and a completion marker (the mock's
name, which it writes into every answer's ids). After driving every kind of
request and failure through each mode, every captured output is grepped:

- worker keys never reach clients: bodies, headers (errors included), metrics,
  logs, reprs, health and admin output;
- client keys never reach keyed workers: every request a worker saw, including
  resource operations, the /v1/models fan-out and health probes;
- no prompt or completion text in logs or metrics.

The standalone gateway (``meshkit serve``) is checked the same way through its
stdout and stderr at ``--log-level debug`` with the access log on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from faultkit import Recorder

from harness import Mode, free_port, wait_until
from meshkit import Mesh, Worker

WORKER_KEY = "sk-worker-PLANTED-123"
CLIENT_KEY = "sk-client-PLANTED-456"
PROMPT = "PLANTED-PROMPT-789"
COMPLETION = "PLANTEDCOMPLETION"  # the mock's name: in every id it writes
ADMIN_KEY = "sk-admin-PLANTED-000"

_LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "werkzeug", "meshkit", "aiohttp")


class _All(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += " " + logging.Formatter().formatException(record.exc_info)
        self.lines.append(f"{record.name}: {text}")


@pytest.fixture
def logs() -> Iterator[list[str]]:
    """Every log line at DEBUG, from meshkit, the servers and libraries."""
    handler = _All()
    saved = []
    for name in _LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level))
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    try:
        yield handler.lines
    finally:
        for lg, level in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)


def _client_headers(api: str = "openai") -> dict[str, str]:
    h = {"authorization": f"Bearer {CLIENT_KEY}", "x-api-key": CLIENT_KEY}
    if api == "anthropic":
        h["anthropic-version"] = "2023-06-01"
    return h


def _chat(stream: bool = False) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"tell me about {PROMPT}"}],
        "stream": stream,
    }


def _drive(mode: Mode, outputs: list[str]) -> None:
    """Every request kind and failure; what the client got goes to ``outputs``."""

    def keep(status: int, headers: Any, body: bytes) -> None:
        outputs.append(f"{status} {dict(headers)!r} {body.decode('latin-1')}")

    def req(method: str, path: str, **kw: Any) -> Any:
        r = mode.request(method, path, **kw)
        keep(r.status, r.headers, r.body)
        return r

    h = _client_headers()
    assert req("POST", "/v1/chat/completions", json=_chat(), headers=h).status == 200
    with mode.stream("POST", "/v1/chat/completions", json=_chat(True), headers=h) as chunks:
        outputs.append(b"".join(chunks).decode("latin-1"))
    msg = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}]}
    assert req("POST", "/v1/messages", json=msg, headers=_client_headers("anthropic")).status == 200
    created = req("POST", "/v1/responses", json={"model": "m", "input": PROMPT}, headers=h)
    assert created.status == 200, created.body
    rid = created.json()["id"]
    # ext-proc refuses resource operations (501): the refusal must not leak either
    ok = 501 if mode.name == "extproc" else 200
    assert req("GET", f"/v1/responses/{rid}", headers=h).status == ok
    assert req("GET", f"/v1/responses/{rid}/input_items", headers=h).status == ok
    req("POST", f"/v1/responses/{rid}/cancel", headers=h)
    assert req("DELETE", f"/v1/responses/{rid}", headers=h).status == ok
    assert req("GET", "/v1/models", headers=h).status == 200
    # refusals that could echo what they saw
    bad = b'{"model": "m", "messages": [{"role": "user", "content": "' + PROMPT.encode() + b'"'
    r = req(
        "POST",
        "/v1/chat/completions",
        content=bad,
        headers={**h, "content-type": "application/json"},
    )
    assert r.status == 400
    r = req(
        "POST",
        "/v1/chat/completions",
        json={"model": 7, "messages": [{"role": "user", "content": PROMPT}]},
        headers=h,
    )
    assert r.status == 400
    r = req("POST", "/v1/chat/completions", json=_chat(), headers={**h, "x-pad": PROMPT * 400})
    assert r.status == 431
    r = req("POST", "/v1/chat/completions", json=_chat(), headers={**h, "content-encoding": "gzip"})
    assert r.status == 415
    # a worker failure (the "crashy" worker resets every stream) and a closed port
    crash = {**_chat(True), "model": "crashy"}
    got: list[bytes] = []
    try:
        with mode.stream("POST", "/v1/chat/completions", json=crash, headers=h) as chunks:
            got.extend(chunks)
    except httpx2.TransportError:
        # ext-proc: Envoy resets the client's stream when the worker's breaks after
        # the head was relayed (docs/extproc.md); what did arrive is still checked
        if mode.name != "extproc":
            raise
    outputs.append(b"".join(got).decode("latin-1"))
    r = req("POST", "/v1/chat/completions", json={**_chat(), "model": "gone"}, headers=h)
    assert r.status in (502, 503)
    r = req("POST", "/v1/chat/completions", json={**_chat(), "model": "failing"}, headers=h)
    assert r.status == 500  # the worker's own error, relayed
    req("GET", "/health", headers=h)  # pass-through


def test_planted_secrets_stay_where_they_belong(
    mock_factory: Any, mesh_factory: Any, run_mode: Any, logs: list[str], mode_name: str
) -> None:
    keyed = mock_factory(name=COMPLETION, api_key=WORKER_KEY)
    crashy = mock_factory(name=COMPLETION + "-crashy", api_key=WORKER_KEY, crash_after_chunks=2)
    failing = mock_factory(
        name=COMPLETION + "-failing", api_key=WORKER_KEY, error_rate=1.0, fail_status=500
    )
    recorder = Recorder()
    recorder.attach(keyed, crashy, failing)
    mesh: Mesh = mesh_factory(
        workers=[
            Worker(keyed.url, api_key=WORKER_KEY, labels={"mesh.model": "m"}),
            Worker(crashy.url, api_key=WORKER_KEY, labels={"mesh.model": "crashy"}),
            Worker(failing.url, api_key=WORKER_KEY, labels={"mesh.model": "failing"}),
            Worker(
                f"http://127.0.0.1:{free_port()}", api_key=WORKER_KEY, labels={"mesh.model": "gone"}
            ),
        ],
        upstream={"max_attempts": 1},
        bounds={"max_header_bytes": 4096},
        admin_key=ADMIN_KEY,
    )
    mode: Mode = run_mode(mesh)
    outputs: list[str] = []
    _drive(mode, outputs)
    assert wait_until(lambda: mesh.total_load() == 0)

    # worker keys never reach clients
    for out in outputs:
        assert WORKER_KEY not in out, out[:300]
    # client keys never reach keyed workers (every request each worker saw)
    seen = recorder.snapshot()
    assert len(seen) >= 10
    paths = {p for _, _, p, _, _ in seen}
    assert "/v1/models" in paths
    # (ext-proc refuses resource operations: none reaches a worker)
    assert mode.name == "extproc" or any(p.startswith("/v1/responses/") for p in paths)
    for worker, method, path, _query, headers in seen:
        text = repr(headers)
        assert CLIENT_KEY not in text, (worker, method, path, headers)
        if path != "/health":
            assert ("authorization", f"Bearer {WORKER_KEY}") in headers, (method, path)
    # nothing planted in metrics, logs or reprs
    metrics = mesh.metrics.render().decode()
    describe = json.dumps(mesh.router.describe())
    # httpcore's own DEBUG trace prints worker *response* headers (x-mock-worker
    # carries the completion marker): header values, not text; request headers,
    # where the keys are, are never in it (checked below with every other line).
    body_free = [ln for ln in logs if "receive_response_headers.complete" not in ln]
    for secret in (WORKER_KEY, CLIENT_KEY, PROMPT, ADMIN_KEY):
        assert all(secret not in ln for ln in logs), secret
    texts = {
        "metrics": metrics,
        "logs": "\n".join(body_free),
        "reprs": " ".join(
            [repr(mesh), repr(mesh.config), str(mesh.config), *(repr(w) for w in mesh.workers)]
        ),
        "health": json.dumps(mesh.health()),
        "lifecycle": describe,
    }
    assert "mesh_router_requests_total" in metrics
    for where, text in texts.items():
        for secret in (WORKER_KEY, CLIENT_KEY, PROMPT, COMPLETION, ADMIN_KEY):
            assert secret not in text, f"{secret} found in {where}: " + _around(text, secret)


def _around(text: str, secret: str) -> str:
    i = text.find(secret)
    return text[max(0, i - 200) : i + 200]


# -- the standalone gateway -----------------------------------------------------------------


class _Gateway:
    def __init__(self, config: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshkit",
                "serve",
                "--config",
                str(config),
                "--port",
                "0",
                "--log-level",
                "debug",
                "--access-log",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True).start()
        if not self._ready.wait(30):
            self.stop()
            raise RuntimeError("the gateway did not start: " + "".join(self.err)[-2000:])

    def _pump(self, stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                self.url = found.group(1)
                self._ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def test_the_gateway_logs_no_secret(mock_factory: Any, tmp_path: Path) -> None:
    keyed = mock_factory(name=COMPLETION, api_key=WORKER_KEY)
    recorder = Recorder()
    recorder.attach(keyed)
    config = tmp_path / "meshkit.toml"
    config.write_text(
        f'admin_key = "{ADMIN_KEY}"\n'
        "[[workers]]\n"
        f'url = "{keyed.url}"\n'
        f'api_key = "{WORKER_KEY}"\n'
        f"[[workers]]\n"
        f'url = "http://127.0.0.1:{free_port()}"\n'
        f'api_key = "{WORKER_KEY}"\n'
    )
    gw = _Gateway(config)
    outputs: list[str] = []
    try:
        assert gw.url is not None
        with httpx2.Client(base_url=gw.url, timeout=30) as c:
            h = _client_headers()
            call: Callable[[], httpx2.Response]
            for call in (
                lambda: c.post("/v1/chat/completions", json=_chat(), headers=h),
                lambda: c.post("/v1/chat/completions", json=_chat(True), headers=h),
                lambda: c.post(
                    "/v1/chat/completions",
                    content=b'{"model":"m","messages":"' + PROMPT.encode(),
                    headers={**h, "content-type": "application/json"},
                ),
                lambda: c.get("/v1/models", headers=h),
                lambda: c.get("/metrics"),
                lambda: c.get("/workers", headers={"authorization": f"Bearer {ADMIN_KEY}"}),
                lambda: c.get("/workers"),
                lambda: c.get("/health"),
            ):
                r = call()
                outputs.append(f"{r.status_code} {dict(r.headers)!r} {r.text}")
            assert outputs[0].startswith("200"), outputs[0][:300]
            assert outputs[5].startswith("200"), outputs[5][:300]
    finally:
        gw.stop()
    for out in outputs:
        assert WORKER_KEY not in out, out[:300]
    for _worker, _m, path, _q, headers in recorder.snapshot():
        assert CLIENT_KEY not in repr(headers), (path, headers)
    printed = "".join(gw.out) + "".join(gw.err)
    assert "listening on" in printed
    for secret in (WORKER_KEY, CLIENT_KEY, PROMPT, COMPLETION, ADMIN_KEY):
        assert secret not in printed, f"{secret} in the gateway's output: " + _around(
            printed, secret
        )
