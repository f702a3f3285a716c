"""The ext-proc mode (a real Envoy asking meshkit's picker) against the gateway
(``meshkit serve``'s server), request by request on one mesh.

Every check sends the same request through both and compares what the client
sees: the status, the headers it acts on (media type, retry hints, ``allow``) and
the body, byte for byte after the per-request ids; then the books both kept
(``mesh_router_requests_total``, tokens, the load back to 0). Where Envoy differs
by its design (it frames a full-duplex body chunked, it answers
``Expect: 100-continue`` itself), the test says so and compares the rest.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any, cast

import httpx2
import pytest

from conformance.test_parity import in_every_mode, seen
from extproc.scriptworker import Scripted, ScriptWorker
from harness import EXTPROC, MODES, Mode, wait_until
from meshkit import Mesh, Worker
from upstreams import RawServer, reset

if not EXTPROC:
    pytest.skip("needs grpcio and an envoy binary (the test extra)", allow_module_level=True)

COMPARED = ("gateway", "extproc")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
JSON = {"content-type": "application/json"}
PATH = "/v1/chat/completions"
PATH_B = PATH.encode()
#: what a client acts on, with ``allow`` (a 405's) beside test_parity's list
MATTER = ("allow",)


def in_both(mesh: Mesh, call: Callable[[Mode], Any]) -> dict[str, Any]:
    """``call(mode)`` through the gateway, then through Envoy, on the same mesh."""
    return in_every_mode(mesh, call, without=tuple(m for m in MODES if m not in COMPARED))


def agreed(results: dict[str, Any]) -> Any:
    """The one answer both gave (fails showing both)."""
    assert results["extproc"] == results["gateway"], (
        f"gateway: {results['gateway']!r}\nextproc: {results['extproc']!r}"
    )
    return results["gateway"]


def normal(body: bytes) -> bytes:
    """Without what a worker makes anew per request (ids, creation times)."""
    body = re.sub(rb"(chatcmpl|cmpl|resp|msg)[-_][\w-]+", rb"ID", body)
    return re.sub(rb'"created(_at)?":\s*\d+', b'"created":0', body)


def answer(mode: Mode, method: str, path: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
    reply = mode.request(method, path, **kw)
    status, headers, body = seen(reply)
    headers.update({k: reply.headers[k] for k in MATTER if k in reply.headers})
    return status, headers, normal(body)


def requests_total(mesh: Mesh) -> dict[tuple[str, str], float]:
    out = {}
    for metric in mesh.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "mesh_router_requests_total" and s.value:
                out[(s.labels["api"], s.labels["status"])] = s.value
    return out


def metric(mesh: Mesh, name: str, **labels: str) -> float:
    value = mesh.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
def script_factory() -> Iterator[Callable[[Callable[[str, str, bytes], Scripted]], ScriptWorker]]:
    started: list[ScriptWorker] = []

    def make(script: Callable[[str, str, bytes], Scripted]) -> ScriptWorker:
        w = ScriptWorker(script)
        started.append(w)
        return w

    yield make
    for w in started:
        w.close()


# -- refusals meshkit gives ------------------------------------------------------------------

HEAD_REFUSALS = [
    pytest.param("GET", "/v1/messages", None, id="405-messages"),
    pytest.param("OPTIONS", "/v1/messages", None, id="405-options-messages"),
    pytest.param("POST", "/v1/messages/nope", MESSAGES, id="404-under-messages"),
    pytest.param("GET", "/v1/chat/completions", None, id="405-chat"),
    pytest.param("POST", "/v1/chat/completionz", CHAT, id="404-chat"),
]


@pytest.mark.parametrize(("method", "path", "body"), HEAD_REFUSALS)
def test_a_refusal_before_the_endpoint_is_known_is_in_the_apis_shape(
    mock_factory: Any, mesh_factory: Any, method: str, path: str, body: Any
) -> None:
    """A 405 or 404 is decided from the head alone, before meshkit knows the
    endpoint: its body is still in the shape of the API the path belongs to
    (Anthropic's under /v1/messages). The picker answered OpenAI's shape."""
    mock = mock_factory(name="w")
    mesh = mesh_factory(workers=[Worker(mock.url)], lifecycle={"probe": False})
    kw: dict[str, Any] = {} if body is None else {"json": body}
    status, headers, raw = agreed(in_both(mesh, lambda m: answer(m, method, path, **kw)))
    assert status in (404, 405) and headers["content-type"] == "application/json"
    doc = json.loads(raw)
    if path.startswith("/v1/messages"):
        assert doc["type"] == "error" and doc["error"]["code"] in (
            "method_not_allowed",
            "unknown_endpoint",
        )
    else:
        assert "type" not in doc and doc["error"]["param"] is None
    assert mock.worker.stats.requests_total.get(path) is None


BAD_BODIES = [
    pytest.param("/v1/chat/completions", b"{nope", JSON, id="chat-bad-json"),
    pytest.param("/v1/messages", b"{nope", JSON, id="messages-bad-json"),
    pytest.param("/v1/messages", b"[]", JSON, id="messages-not-an-object"),
    pytest.param("/v1/responses", b'{"input": 3}', JSON, id="responses-wrong-type"),
    pytest.param("/v1/chat/completions", b"x" * 5000, JSON, id="chat-413"),
    pytest.param("/v1/messages", b"x" * 5000, JSON, id="messages-413"),
    pytest.param("/v1/messages", b"model=m", {"content-type": "text/plain"}, id="messages-415"),
]


@pytest.mark.parametrize(("path", "content", "headers"), BAD_BODIES)
def test_a_bad_body_is_refused_alike(
    mock_factory: Any, mesh_factory: Any, path: str, content: bytes, headers: dict[str, str]
) -> None:
    mock = mock_factory(name="w")
    mesh = mesh_factory(
        workers=[Worker(mock.url)], lifecycle={"probe": False}, bounds={"max_body_bytes": 4096}
    )
    send = lambda m: answer(m, "POST", path, content=content, headers=headers)  # noqa: E731
    status, _, raw = agreed(in_both(mesh, send))
    assert status in (400, 413, 415)
    doc = json.loads(raw)
    assert (doc.get("type") == "error") == path.startswith("/v1/messages")
    assert mock.worker.stats.requests_total.get(path) is None


def test_unknown_model_and_no_healthy_worker_alike(mock_factory: Any, mesh_factory: Any) -> None:
    a = mock_factory(name="a", model="alpha")
    b = mock_factory(name="b", model="beta")
    mesh = mesh_factory(
        workers=[
            Worker(a.url, labels={"mesh.model": "alpha"}),
            Worker(b.url, labels={"mesh.model": "beta"}),
        ],
        lifecycle={"probe": False},
    )
    unknown = agreed(
        in_both(mesh, lambda m: answer(m, "POST", "/v1/messages", json={**MESSAGES, "model": "g"}))
    )
    assert unknown[0] >= 400 and json.loads(unknown[2])["type"] == "error"
    models = agreed(in_both(mesh, lambda m: answer(m, "GET", "/v1/models")))
    assert models[0] == 200
    assert {c["id"] for c in json.loads(models[2])["data"]} == {"alpha", "beta"}
    picked = agreed(
        in_both(
            mesh,
            lambda m: m.request(
                "POST", "/v1/chat/completions", json={**CHAT, "model": "beta"}
            ).headers["x-mock-worker"],
        )
    )
    assert picked == "b"
    for w in mesh.workers:
        mesh.set_healthy(w, False)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES)):
        status, headers, raw = agreed(
            in_both(
                mesh,
                cast(
                    Callable[[Mode], Any],
                    lambda m, p=path, j=body: answer(m, "POST", p, json={**j, "model": "alpha"}),
                ),
            )
        )
        assert status == 503 and {"retry-after", "retry-after-ms"} <= set(headers)
        assert headers["x-should-retry"] == "true"
        assert b"no_available_workers" in raw
    assert mesh.total_load() == 0


# -- what the worker answers -----------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 429, 500, 503, 529])
def test_a_workers_error_passes_through_alike(
    script_factory: Any, mesh_factory: Any, status: int
) -> None:
    """The worker's own status, body and retry hints reach the client as it sent
    them, plain or streamed, OpenAI or Anthropic, and both books count it."""
    own = json.dumps({"error": {"message": f"the worker says {status}", "code": "own"}}).encode()
    hints = [("retry-after", "7"), ("retry-after-ms", "7000"), ("x-should-retry", "true")]
    worker = script_factory(
        lambda method, path, body: (status, [("content-type", "application/json"), *hints], own)
    )
    mesh = mesh_factory(
        workers=[Worker(worker.url)], lifecycle={"probe": False, "breaker_failures": 100}
    )
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/messages", MESSAGES),
    ):
        got = agreed(
            in_both(
                mesh,
                cast(Callable[[Mode], Any], lambda m, p=path, j=body: answer(m, "POST", p, json=j)),
            )
        )
        assert got == (
            status,
            {
                "content-type": "application/json",
                "retry-after": "7",
                "retry-after-ms": "7000",
                "x-should-retry": "true",
            },
            own,
        )
    assert wait_until(lambda: mesh.total_load() == 0)
    assert requests_total(mesh) == {("chat", str(status)): 4, ("messages", str(status)): 2}


@pytest.mark.parametrize("status", [204, 304])
def test_a_bodiless_answer_passes_through_alike(
    script_factory: Any, mesh_factory: Any, status: int
) -> None:
    worker = script_factory(lambda method, path, body: (status, [("x-own", "1")], b""))
    mesh = mesh_factory(workers=[Worker(worker.url)], lifecycle={"probe": False})

    def send(m: Mode) -> tuple[int, str | None, bytes]:
        r = m.request("POST", "/v1/chat/completions", json=CHAT)
        return r.status, r.headers.get("x-own"), r.body

    assert agreed(in_both(mesh, send)) == (status, "1", b"")
    assert wait_until(lambda: mesh.total_load() == 0)
    assert requests_total(mesh) == {("chat", str(status)): 2}


def test_answers_of_several_mib_alike(mock_factory: Any, mesh_factory: Any) -> None:
    mock = mock_factory(name="big", output_tokens=500_000)
    mesh = mesh_factory(workers=[Worker(mock.url)], lifecycle={"probe": False})

    def books(m: Mode) -> float:
        assert wait_until(lambda: mesh.total_load() == 0)
        return metric(mesh, "mesh_router_tokens_total", kind="output")

    def whole(m: Mode) -> tuple[int, int, Any, float]:
        before = books(m)
        r = m.request("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 500_000})
        usage = r.json()["usage"]["completion_tokens"]
        # a body over bounds.max_sse_line_bytes is relayed, not parsed: no usage
        return r.status, len(normal(r.body)), usage, books(m) - before

    status, size, tokens, counted = agreed(in_both(mesh, whole))
    assert status == 200 and size > 3 << 20 and tokens == 500_000 and counted == 0

    def streamed(m: Mode) -> tuple[int, bytes, float]:
        before = books(m)
        body = {**CHAT, "max_tokens": 20_000, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with m.stream("POST", "/v1/chat/completions", json=body) as chunks:
            data = b"".join(chunks)
        return len(normal(data)), normal(data)[-300:], books(m) - before

    size, tail, counted = agreed(in_both(mesh, streamed))
    assert size > 3 << 20 and tail.endswith(b"data: [DONE]\n\n") and counted == 20_000
    assert requests_total(mesh) == {("chat", "200"): 4}


def test_a_client_that_leaves_mid_stream_settles_alike(
    mock_factory: Any, mesh_factory: Any
) -> None:
    mock = mock_factory(name="slow", per_token_ms=50.0, output_tokens=100)
    mesh = mesh_factory(workers=[Worker(mock.url)], lifecycle={"probe": False})
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}

    def leave(m: Mode) -> tuple[int, bool, bool]:
        left = mock.worker.stats.disconnects
        with (
            httpx2.Client(trust_env=False) as c,
            c.stream("POST", m.base_url + PATH, json=body) as r,
        ):
            chunks = r.iter_raw()  # kept: a dropped iterator closes the response
            next(chunks)
            held = mesh.total_load()
        settled = wait_until(lambda: mesh.total_load() == 0)
        # the worker's connection closes too: it stops generating
        told = wait_until(lambda: mock.worker.stats.disconnects == left + 1)
        return held, settled, told

    assert agreed(in_both(mesh, leave)) == (1, True, True)
    assert requests_total(mesh) == {("chat", "cancelled"): 2}
    assert metric(mesh, "mesh_router_client_disconnects_total") == 2


def test_responses_follow_ups_alike(mock_factory: Any, mesh_factory: Any) -> None:
    """A follow-up goes to the worker that holds its response; one to an id no
    worker knows is the same answer (after the same questions to the workers)."""
    mocks = [mock_factory(name=f"r{i}") for i in range(3)]
    mesh = mesh_factory(workers=[Worker(m.url) for m in mocks], lifecycle={"probe": False})

    def follow(m: Mode) -> tuple[list[bool], Any]:
        first = m.request("POST", "/v1/responses", json={"model": "m", "input": "hi"})
        rid, owner = first.json()["id"], first.headers["x-mock-worker"]
        same = []
        for stream in (False, True, False):
            ask = {"model": "m", "input": "more", "previous_response_id": rid, "stream": stream}
            same.append(
                m.request("POST", "/v1/responses", json=ask).headers["x-mock-worker"] == owner
            )
        unknown = {"model": "m", "input": "more", "previous_response_id": "resp_nobody0001"}
        return same, answer(m, "POST", "/v1/responses", json=unknown)

    same, (status, _, raw) = agreed(in_both(mesh, follow))
    assert same == [True, True, True]
    assert status >= 400 and json.loads(raw)["error"]["code"]
    assert wait_until(lambda: mesh.total_load() == 0)


# -- request framing -------------------------------------------------------------------------


def _exchange(url: str, parts: list[bytes], *, interim: bool = False) -> bytes:
    """Send ``parts`` on one connection and read one response (``interim``: read the
    ``100 Continue`` after the first part before sending the rest)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        got = b""
        s.sendall(parts[0])
        if interim:
            while b"\r\n\r\n" not in got:
                data = s.recv(65536)
                assert data, got
                got += data
        for part in parts[1:]:
            s.sendall(part)
        while not _complete(got):
            data = s.recv(65536)
            if not data:
                break
            got += data
    return got


def _complete(got: bytes) -> bool:
    final = re.sub(rb"^HTTP/1\.1 100 Continue\r\n\r\n", b"", got)
    head, sep, body = final.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    if length is not None:
        return len(body) >= int(length.group(1))
    return body.endswith(b"0\r\n\r\n")


def _final(raw: bytes) -> tuple[bytes, bool, bytes]:
    """The final response's status line, whether a ``100 Continue`` came first, and
    its body (de-chunked: Envoy frames a full-duplex body chunked)."""
    interim = raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    final = raw.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    head, _, body = final.partition(b"\r\n\r\n")
    if re.search(rb"(?im)^transfer-encoding: *chunked", head):
        out, rest = b"", body
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    status = head.split(b"\r\n", 1)[0].split(b" ")[1]
    return status, interim, normal(body)


def test_a_chunked_request_body_is_routed_alike(mock_factory: Any, mesh_factory: Any) -> None:
    mock = mock_factory(name="w")
    mesh = mesh_factory(
        workers=[Worker(mock.url)], lifecycle={"probe": False}, bounds={"max_body_bytes": 4096}
    )
    body = json.dumps(CHAT).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: mesh\r\n"
        b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunks = [
        b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7)
    ]
    ok = agreed(
        in_both(mesh, lambda m: _final(_exchange(m.base_url, [head, *chunks, b"0\r\n\r\n"])))
    )
    assert ok[0] == b"200" and json.loads(ok[2])["choices"]
    assert json.loads(mock.worker.stats.last_body) == CHAT
    over = [
        head,
        b"1000\r\n" + b" " * 4096 + b"\r\n",
        b"10\r\n" + b" " * 16 + b"\r\n",
        b"0\r\n\r\n",
    ]
    status, _, raw = agreed(in_both(mesh, lambda m: _final(_exchange(m.base_url, over))))
    assert status == b"413" and json.loads(raw)["error"]["code"] == "request_too_large"
    assert wait_until(lambda: mesh.total_load() == 0)


def test_expect_100_continue_is_answered_alike(mock_factory: Any, mesh_factory: Any) -> None:
    """The final answers agree. Envoy answers ``Expect: 100-continue`` itself, at
    once (the HTTP connection manager's default), before the picker has seen the
    head, so a refused request gets its ``100 Continue`` first; the gateway
    answers the refusal instead."""
    mock = mock_factory(name="w")
    mesh = mesh_factory(
        workers=[Worker(mock.url)], lifecycle={"probe": False}, bounds={"max_body_bytes": 4096}
    )
    body = json.dumps(CHAT).encode()

    def head(path: bytes, length: int) -> bytes:
        return (
            b"POST %s HTTP/1.1\r\nhost: mesh\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nexpect: 100-continue\r\n\r\n" % (path, length)
        )

    ok = in_both(
        mesh, lambda m: _final(_exchange(m.base_url, [head(PATH_B, len(body)), body], interim=True))
    )
    assert ok["gateway"] == ok["extproc"]
    assert ok["gateway"][:2] == (b"200", True)
    for path, length, status in ((PATH_B, 5000, b"413"), (b"/v1/chat/completionz", 10, b"404")):
        refused = in_both(
            mesh,
            cast(
                Callable[[Mode], Any],
                lambda m, p=path, n=length: _final(_exchange(m.base_url, [head(p, n)])),
            ),
        )
        assert refused["gateway"] == (status, False, refused["extproc"][2])
        assert refused["extproc"][0] == status  # Envoy sent its 100 first (interim True)
    assert wait_until(lambda: mesh.total_load() == 0)


# -- a worker that fails -----------------------------------------------------------------------


def _head_then_reset(srv: RawServer, s: socket.socket, n: int, head: bytes, body: bytes) -> bool:
    """A worker that sends its response head and dies at once (an RST)."""
    s.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    reset(s)
    return False


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [("/v1/chat/completions", CHAT, "openai"), ("/v1/messages", MESSAGES, "anthropic")],
)
def test_a_worker_that_dies_after_its_head_is_answered_in_the_apis_shape(
    mesh_factory: Any, path: str, body: dict[str, Any], shape: str
) -> None:
    """What the client gets is the API's own: a 200 whose stream ends in meshkit's
    error event, or a reset (a worker that broke mid-stream, documented), or a 502
    ``upstream_error`` in the API's JSON (meshkit's, or Envoy's own reply through the
    bootstrap's ``local_reply_config``); never Envoy's text/plain reply."""
    with RawServer(_head_then_reset) as worker:
        mesh = mesh_factory(
            workers=[Worker(worker.url)],
            lifecycle={"probe": False, "breaker_failures": 1000},
            upstream={"max_attempts": 1},
        )

        def answers(m: Mode) -> list[tuple[int, str, bytes]]:
            out = []
            for _ in range(10):  # Envoy sees the head, or not, by the RST's timing
                try:
                    r = m.request("POST", path, json={**body, "stream": True})
                except httpx2.TransportError:
                    continue  # Envoy reset the client's stream: documented
                out.append((r.status, r.headers.get("content-type", ""), r.body))
            return out

        refused: dict[str, int] = {}
        for mode, replies in in_both(mesh, answers).items():
            refused[mode] = 0
            for status, ctype, got in replies:
                if status == 200:
                    assert ctype == "text/event-stream", (mode, got)
                    assert b"upstream_error" in got.rsplit(b"data: ", 1)[-1], (mode, got)
                    continue
                assert (status, ctype) == (502, "application/json"), (mode, status, got)
                error = json.loads(got)
                assert error["error"]["code"] == "upstream_error", (mode, got)
                assert ("type" in error) == (shape == "anthropic"), (mode, got)
                refused[mode] += 1
        assert refused["extproc"] > 0  # Envoy's own 502 was among the replies
        assert wait_until(lambda: mesh.total_load() == 0)
