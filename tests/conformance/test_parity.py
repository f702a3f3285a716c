"""Every mode answers a refusal, or ends a failed stream, with the same bytes.

The other conformance tests compare (status, code) per mode; these run every mode
on one mesh and compare what a client sees whole: the status, the headers that
matter to it (the media type and the retry hints) and the body, byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from conformance.test_routing import REJECTIONS
from harness import MODE_CLASSES, MODES, Mode, Reply, free_port, wait_until
from meshkit import Mesh, Worker

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
#: the headers a client acts on (every mode adds its own date, server, length ...)
MATTER = ("content-type", "retry-after", "retry-after-ms", "x-should-retry")


def seen(reply: Reply) -> tuple[int, dict[str, str], bytes]:
    headers = {k: reply.headers[k] for k in MATTER if k in reply.headers}
    return reply.status, headers, reply.body


def in_every_mode(
    mesh: Mesh, call: Callable[[Mode], Any], *, without: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``call(mode)`` in each mode in turn, on the same mesh (``without``: modes
    that cannot make this check, each with its reason where it is called)."""
    out = {}
    for name in MODES:
        if name in without:
            continue
        mode = MODE_CLASSES[name](mesh)
        try:
            out[name] = call(mode)
        finally:
            mode.close()
    return out


def the_same(results: dict[str, Any]) -> Any:
    """The one answer every mode gave (fails naming the modes that differ)."""
    first = results[MODES[0]]
    differ = {name: r for name, r in results.items() if r != first}
    assert not differ, f"{MODES[0]} gave {first!r}; these differ: {differ!r}"
    return first


def _send(method: str, path: str, body: Any, headers: dict[str, str]) -> Callable[[Mode], Any]:
    kw: dict[str, Any] = {"headers": dict(headers)}
    if isinstance(body, bytes):
        kw["content"] = body
        kw["headers"] = {"content-type": "application/json", **headers}
    elif body is not None:
        kw["content"] = json.dumps(body).encode()
        kw["headers"] = {"content-type": "application/json", **headers}
    return lambda mode: seen(mode.request(method, path, **kw))


@pytest.mark.parametrize(("method", "path", "body", "headers", "expected"), REJECTIONS)
def test_refusals_are_byte_identical(
    mock_factory: Any,
    mesh_factory: Any,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    expected: tuple[int, str],
) -> None:
    mocks = [mock_factory(name=f"w{i}", apis=frozenset({"chat", "completions"})) for i in (0, 1)]
    labels = {"mesh.apis": "chat,completions,responses"}
    mesh = mesh_factory(
        workers=[Worker(m.url, labels=labels) for m in mocks], bounds={"max_body_bytes": 4096}
    )
    status, got, raw = the_same(in_every_mode(mesh, _send(method, path, body, headers)))
    assert status == expected[0]
    assert got["content-type"] == "application/json"
    assert json.loads(raw)  # one JSON error document, the same bytes everywhere


def test_a_head_over_the_bound_is_byte_identical(mock_factory: Any, mesh_factory: Any) -> None:
    mock = mock_factory(name="w")
    mesh = mesh_factory(workers=[Worker(mock.url)], bounds={"max_headers": 8})
    many = {f"x-h{i}": "v" for i in range(12)}
    # ext-proc: Envoy drops hop-by-hop headers (connection) before the picker sees
    # the head, so the count in the message differs by them (tests/reliability/
    # test_bounds.py holds ext-proc to the bound)
    send = _send("POST", "/v1/chat/completions", CHAT, many)
    status, _, raw = the_same(in_every_mode(mesh, send, without=("extproc",)))
    assert status == 431
    assert json.loads(raw)["error"]["code"] == "request_header_fields_too_large"


def test_no_available_worker_is_byte_identical_with_its_retry_hints(
    mock_factory: Any, mesh_factory: Any
) -> None:
    mocks = [mock_factory(name=f"w{i}") for i in (0, 1)]
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks])
    for w in mesh.workers:
        mesh.set_healthy(w, False)
    status, headers, raw = the_same(
        in_every_mode(mesh, _send("POST", "/v1/chat/completions", CHAT, {}))
    )
    assert status == 503 and {"retry-after", "retry-after-ms"} <= set(headers)
    assert json.loads(raw)["error"]["code"] == "no_available_workers"


def test_an_unreachable_worker_is_byte_identical(mesh_factory: Any) -> None:
    mesh = mesh_factory(
        workers=[Worker(f"http://127.0.0.1:{free_port()}")],
        # one failure per mode: the breaker must not open before the last mode
        lifecycle={"probe": False, "breaker_failures": 100},
        upstream={"max_attempts": 1},
    )
    status, _, raw = the_same(in_every_mode(mesh, _send("POST", "/v1/chat/completions", CHAT, {})))
    assert status == 502
    assert json.loads(raw)["error"]["code"] == "upstream_error"
    assert wait_until(lambda: mesh.total_load() == 0)


def test_a_stalled_worker_is_byte_identical(mock_factory: Any, mesh_factory: Any) -> None:
    mock = mock_factory(name="slow", first_token_ms=3000)
    mesh = mesh_factory(
        workers=[Worker(mock.url)],
        lifecycle={"probe": False, "breaker_failures": 100},
        upstream={"read_timeout_s": 0.3, "max_attempts": 1},
    )
    # ext-proc: Envoy's route timeout bounds the wait, not upstream.read_timeout_s;
    # the client transports raise their library's ReadTimeout, as a direct connection
    send = _send("POST", "/v1/chat/completions", CHAT, {})
    servers = in_every_mode(mesh, send, without=("extproc", "transport", "async_transport"))
    status, _, raw = the_same(servers)
    assert status == 504
    assert json.loads(raw)["error"]["code"] == "upstream_timeout"


STREAMS = [
    pytest.param("/v1/chat/completions", {**CHAT, "stream": True}, id="chat"),
    pytest.param("/v1/messages", {**MESSAGES, "stream": True}, id="messages"),
    pytest.param("/v1/responses", {"model": "m", "input": "hi", "stream": True}, id="responses"),
]


@pytest.mark.parametrize(("path", "body"), STREAMS)
def test_a_stream_the_worker_cut_ends_with_the_same_bytes(
    mock_factory: Any, mesh_factory: Any, path: str, body: dict[str, Any]
) -> None:
    """The events the worker sent, then one error event: the same event in every mode."""
    crashy = mock_factory(name="crashy", crash_after_chunks=3, output_tokens=8)
    mesh = mesh_factory(
        workers=[Worker(crashy.url)], lifecycle={"probe": False, "breaker_failures": 100}
    )

    def stream(mode: Mode) -> tuple[int, bytes]:
        with mode.stream("POST", path, json=body) as chunks:
            events = b"".join(chunks).split(b"\n\n")
        assert events[-1] == b""  # it ends on an event boundary
        return len(events), events[-2]

    # ext-proc: Envoy resets the client's stream when the worker's breaks mid-body;
    # the picker is not asked for the rest (tests/extproc checks the books)
    results = in_every_mode(mesh, stream, without=("extproc",))
    count, tail = the_same(results)
    assert count == 3 + 2  # three worker events, the error event, and the end
    assert b"the worker failed while streaming the response" in tail
    assert b"error" in tail.split(b"\n", 1)[0]
    assert crashy.worker.stats.crashes == len(results)
    assert wait_until(lambda: mesh.total_load() == 0)
