"""A worker's ``x-should-retry: false`` (PROTOCOLS.md section 5: the server override
both SDKs obey before their status rules; "send x-should-retry: false on errors
that must not be replayed") is a worker saying: do not send this again. meshkit's
own failover does not send it to another worker either, in any mode: the worker's
answer is relayed as it is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from harness import MODE_CLASSES, MODES
from reliability.rawworker import QuietHandler, Served

BODY = (
    b'{"error":{"message":"accepted, then failed: do not replay","type":"server_error",'
    b'"param":null,"code":"no_replay"}}'
)


class NoReplayWorker(Served):
    """Answers every POST 503 with ``x-should-retry: false``."""

    def __init__(self) -> None:
        self.posts = 0
        outer = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.posts += 1
                self.send_response(503)
                self.send_header("content-type", "application/json")
                self.send_header("x-should-retry", "false")
                self.send_header("content-length", str(len(BODY)))
                self.end_headers()
                self.wfile.write(BODY)

        super().__init__(Handler)


@pytest.fixture
def workers() -> Iterator[list[NoReplayWorker]]:
    ws = [NoReplayWorker() for _ in range(3)]
    yield ws
    for w in ws:
        w.close()


@pytest.mark.parametrize("mode_name", MODES)
def test_a_worker_that_says_do_not_retry_is_not_replayed(
    mode_name: str, workers: list[NoReplayWorker], mesh_factory: Any
) -> None:
    mesh = mesh_factory(
        workers=[w.url for w in workers],
        lifecycle={"probe": False, "breaker_failures": 100},
    )
    mode = MODE_CLASSES[mode_name](mesh)
    try:
        r = mode.request(
            "POST", "/v1/chat/completions", json={"model": "m", "messages": [], "max_tokens": 1}
        )
        assert r.status == 503 and r.body == BODY
        assert r.headers["x-should-retry"] == "false"
        assert sum(w.posts for w in workers) == 1  # relayed, not tried on the others
    finally:
        mode.close()


def test_the_sdk_and_meshkit_both_send_it_once(
    workers: list[NoReplayWorker], mesh_factory: Any
) -> None:
    from harness import TransportMode

    mesh = mesh_factory(
        workers=[w.url for w in workers],
        lifecycle={"probe": False, "breaker_failures": 100},
    )
    mode = TransportMode(mesh)
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            mode.openai(max_retries=2).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "once"}]
            )
        assert caught.value.status_code == 503
        assert caught.value.response.headers["x-should-retry"] == "false"
        # The SDK obeyed the worker (one attempt); meshkit does too.
        assert sum(w.posts for w in workers) == 1
    finally:
        mode.close()
