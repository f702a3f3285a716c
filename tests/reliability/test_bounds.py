"""Every request bound, at the bound: exactly at the limit passes, one over fails
in the API's own error shape, in every mode, and each refusal is counted in
``mesh_router_rejections_total{code}``.

The limits come from ``mesh.config.bounds`` (``[bounds]``): ``max_header_bytes``,
``max_headers``, ``max_body_bytes``, ``max_sse_line_bytes``, ``max_json_depth``.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2
import pytest
from faultkit import assert_settled, metric_value, stream_terminal
from rawworker import RawWorker
from werkzeug.test import EnvironBuilder

import meshkit
from harness import Mode, wait_until
from meshkit import Mesh, MeshMiddleware, MeshTransport, MeshWSGIMiddleware, Worker
from meshkit.core.streams import StreamAccountant

PATH = "/v1/chat/completions"
HEADER_BYTES = 4096
HEADERS = 40  # below werkzeug's own limit (100 header lines)
BODY_BYTES = 8192
SSE_LINE = 4096


def _mesh(mesh_factory: Any, url: str, **bounds: int) -> Mesh:
    mesh: Mesh = mesh_factory(
        workers=[Worker(url)],
        bounds={
            "max_header_bytes": HEADER_BYTES,
            "max_headers": HEADERS,
            "max_body_bytes": BODY_BYTES,
            "max_sse_line_bytes": SSE_LINE,
            **bounds,
        },
        lifecycle={"probe": False},
    )
    return mesh


def _chat(content: str = "hi") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def _rejected(mesh: Mesh, code: str) -> float:
    return metric_value(mesh, "mesh_router_rejections_total", code=code)


def _number(pattern: str, message: str) -> int:
    found = re.search(pattern, message)
    assert found is not None, message
    return int(found.group(1))


# -- request heads --------------------------------------------------------------------------


def test_header_bytes_at_the_bound(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    mock = mock_factory(name="h")
    mesh = _mesh(mesh_factory, mock.url)
    mode: Mode = run_mode(mesh)

    def send(pad: int) -> Any:
        return mode.request("POST", PATH, json=_chat(), headers={"x-pad": "a" * pad})

    # What this mode's client and server add to the head is learnt from a refusal
    # (its message states the measured size), so the next two land exactly.
    probe = send(HEADER_BYTES)
    assert probe.status == 431
    err = probe.json()["error"]
    assert err["code"] == "request_header_fields_too_large"
    measured = _number(r"are (\d+) bytes", err["message"])
    base = measured - (len("x-pad") + HEADER_BYTES + 4)
    at_limit = HEADER_BYTES - base - len("x-pad") - 4
    assert send(at_limit).status == 200
    over = send(at_limit + 1)
    assert over.status == 431
    assert str(HEADER_BYTES + 1) in over.json()["error"]["message"]
    assert _rejected(mesh, "request_header_fields_too_large") == 2
    assert mock.worker.stats.requests_total.get(PATH) == 1
    assert_settled(mesh)


def test_header_count_at_the_bound(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    mock = mock_factory(name="h")
    mesh = _mesh(mesh_factory, mock.url)
    mode: Mode = run_mode(mesh)

    def send(n: int) -> Any:
        return mode.request("POST", PATH, json=_chat(), headers={f"x-h{i}": "v" for i in range(n)})

    probe = send(HEADERS)
    assert probe.status == 431
    counted = _number(r"has (\d+) header", probe.json()["error"]["message"])
    at_limit = HEADERS - (counted - HEADERS)
    assert send(at_limit).status == 200
    over = send(at_limit + 1)
    assert over.status == 431
    assert over.json()["error"]["code"] == "request_header_fields_too_large"
    assert _rejected(mesh, "request_header_fields_too_large") == 2
    assert mock.worker.stats.requests_total.get(PATH) == 1


def test_header_refusal_is_in_the_anthropic_shape(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="h")
    mesh = _mesh(mesh_factory, mock.url)
    mode: Mode = run_mode(mesh)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = mode.request("POST", "/v1/messages", json=body, headers={"x-pad": "a" * HEADER_BYTES})
    assert r.status == 431
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_asgi_enforces_the_head_bound_itself() -> None:
    """uvicorn with httptools has no header limit of its own (1 MiB heads pass; h11
    refuses past 16 KiB): the middleware checks ``scope["headers"]``."""
    mesh = Mesh(workers=["http://127.0.0.1:9"], bounds={"max_header_bytes": 100, "max_headers": 3})
    try:
        app = MeshMiddleware(_no_app, mesh=mesh)
        for headers in (
            [(b"x-a", b"v" * 200)],
            [(b"x-a", b"1"), (b"x-b", b"2"), (b"x-c", b"3"), (b"x-d", b"4")],
        ):
            status, body, consumed = asyncio.run(_asgi_call(app, headers, _chunks(b"{}", 1)))
            assert status == 431
            assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
            assert consumed == 0  # refused before any body was read
        assert _rejected(mesh, "request_header_fields_too_large") == 2
    finally:
        mesh.close()


# -- request bodies -------------------------------------------------------------------------


def _body_of_size(n: int) -> bytes:
    base = json.dumps(_chat("")).encode()
    pad = n - len(base)
    assert pad >= 0
    out = json.dumps(_chat("a" * pad)).encode()
    assert len(out) == n
    return out


def test_body_bytes_at_the_bound(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    mock = mock_factory(name="b")
    mesh = _mesh(mesh_factory, mock.url)
    mode: Mode = run_mode(mesh)
    hdrs = {"content-type": "application/json"}
    assert mode.request("POST", PATH, content=_body_of_size(BODY_BYTES), headers=hdrs).status == 200
    over = mode.request("POST", PATH, content=_body_of_size(BODY_BYTES + 1), headers=hdrs)
    assert over.status == 413
    assert over.json()["error"]["code"] == "request_too_large"
    assert _rejected(mesh, "request_too_large") == 1
    assert mock.worker.stats.requests_total.get(PATH) == 1
    assert_settled(mesh)


def test_streamed_body_at_the_bound(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    """A chunked upload (no Content-Length): the bound holds while it streams in."""
    mock = mock_factory(name="b")
    mesh = _mesh(mesh_factory, mock.url)
    mode: Mode = run_mode(mesh)

    def chunked(body: bytes) -> Any:
        def gen() -> Iterator[bytes]:
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        if mode.name == "async_transport":

            async def agen() -> AsyncIterator[bytes]:
                for piece in gen():
                    yield piece

            async def go() -> Any:
                return await mode.client.post(  # type: ignore[attr-defined]
                    PATH, content=agen(), headers={"content-type": "application/json"}
                )

            return mode.portal.call(go)  # type: ignore[attr-defined]
        return mode.client.post(  # type: ignore[attr-defined]
            PATH, content=gen(), headers={"content-type": "application/json"}
        )

    assert chunked(_body_of_size(BODY_BYTES)).status_code == 200
    over = chunked(_body_of_size(BODY_BYTES + 1))
    assert over.status_code == 413
    assert over.json()["error"]["code"] == "request_too_large"
    assert mock.worker.stats.requests_total.get(PATH) == 1


async def _no_app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
    raise AssertionError("inference paths never reach the wrapped app")


def _chunks(piece: bytes, n: int | None) -> Iterator[bytes]:
    i = 0
    while n is None or i < n:
        yield piece
        i += 1


async def _asgi_call(
    app: Any, headers: list[tuple[bytes, bytes]], body: Iterator[bytes]
) -> tuple[int, bytes, int]:
    """Call an ASGI app in-process; returns status, body and body messages consumed."""
    consumed = 0
    pieces = iter(body)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal consumed
        piece = next(pieces, None)
        if piece is None:
            await asyncio.Event().wait()  # the client is idle: only a disconnect could come
        consumed += 1
        return {"type": "http.request", "body": piece, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 30)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, out, consumed


def test_asgi_refuses_a_large_chunked_body_without_reading_the_rest() -> None:
    """An endless chunked body: 413 once the bound is passed, nothing more is read."""
    mesh = Mesh(workers=["http://127.0.0.1:9"], bounds={"max_body_bytes": BODY_BYTES})
    try:
        app = MeshMiddleware(_no_app, mesh=mesh)
        piece = b" " * 1024
        status, body, consumed = asyncio.run(_asgi_call(app, [], _chunks(piece, None)))
        assert status == 413
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert consumed == BODY_BYTES // len(piece) + 1  # the piece that crossed the bound
        # A declared length over the bound is refused before reading anything.
        declared = [(b"content-length", str(BODY_BYTES + 1).encode())]
        status, _, consumed = asyncio.run(_asgi_call(app, declared, _chunks(piece, None)))
        assert status == 413
        assert consumed == 0
        assert _rejected(mesh, "request_too_large") == 2
    finally:
        mesh.close()


class _CountingStream(io.RawIOBase):
    """An endless request body that counts what was read from it."""

    def __init__(self) -> None:
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = len(b)
        b[:n] = b" " * n
        self.read_bytes += n
        return n


def test_wsgi_refuses_a_large_chunked_body_without_reading_the_rest() -> None:
    mesh = Mesh(workers=["http://127.0.0.1:9"], bounds={"max_body_bytes": BODY_BYTES})
    try:
        app = MeshWSGIMiddleware(lambda e, s: [], mesh=mesh)
        stream = _CountingStream()
        env = EnvironBuilder(
            path=PATH, method="POST", headers=[("content-type", "application/json")]
        ).get_environ()
        env["wsgi.input"] = stream
        env["wsgi.input_terminated"] = True  # chunked: the server ends the stream
        env.pop("CONTENT_LENGTH", None)
        got: list[str] = []
        # (ignore: a bare start_response, ill-typed on purpose: it returns no write())
        body = b"".join(app(env, lambda status, headers, exc=None: got.append(status)))  # type: ignore[arg-type]
        assert got[0].startswith("413")
        assert json.loads(body)["error"]["code"] == "request_too_large"
        # read in bounded pieces: at most one piece past the bound
        assert stream.read_bytes <= BODY_BYTES + 64 * 1024
        app.close()
    finally:
        mesh.close()


def test_transport_refuses_a_large_streamed_body_without_reading_the_rest() -> None:
    mesh = Mesh(workers=["http://127.0.0.1:9"], bounds={"max_body_bytes": BODY_BYTES})
    pulled = [0]

    def endless() -> Iterator[bytes]:
        while True:
            pulled[0] += 1
            yield b" " * 1024

    try:
        with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
            r = client.post(PATH, content=endless(), headers={"content-type": "application/json"})
            assert r.status_code == 413
            assert pulled[0] == BODY_BYTES // 1024 + 1
            # a declared length over the bound: refused before any read
            pulled[0] = 0
            r = client.post(
                PATH,
                content=endless(),
                headers={"content-type": "application/json", "content-length": "99999"},
            )
            assert r.status_code == 413
            assert pulled[0] == 0
        assert _rejected(mesh, "request_too_large") == 2
    finally:
        mesh.close()


@pytest.mark.parametrize("value", [b"8193", b" 08193 ", b"1" * 5000], ids=["plain", "ows", "huge"])
def test_a_declared_length_is_read_alike_by_every_adapter(value: bytes) -> None:
    """The ASGI middleware, the client transport and the ext-proc picker read a
    declared ``Content-Length`` with one function (``core.requests.declared_over``):
    over the bound it is a 413 before any body byte is read, however many digits it
    has (5,000 made ``int()`` raise a ValueError in the transport and the picker).
    The built-in server reads it the same way, after llhttp (which refuses the
    huge one itself)."""
    mesh = Mesh(workers=["http://127.0.0.1:9"], bounds={"max_body_bytes": BODY_BYTES})
    piece = b" " * 1024
    pulled = [0]

    def endless() -> Iterator[bytes]:
        while True:
            pulled[0] += 1
            yield piece

    try:
        app = MeshMiddleware(_no_app, mesh=mesh)
        declared = [(b"content-length", value)]
        status, body, consumed = asyncio.run(_asgi_call(app, declared, _chunks(piece, None)))
        assert (status, consumed) == (413, 0)
        assert json.loads(body)["error"]["code"] == "request_too_large"

        with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
            r = client.post(
                PATH,
                content=endless(),
                headers={"content-type": "application/json", "content-length": value.decode()},
            )
        assert (r.status_code, pulled[0]) == (413, 0)
        assert r.json()["error"]["code"] == "request_too_large"

        picker = pytest.importorskip("meshkit.frontends.extproc.picker")

        async def never(*_: Any) -> Any:  # pragma: no cover - refused before placement
            raise AssertionError("a refused request is not placed")

        head = [
            (b":method", b"POST"),
            (b":path", PATH.encode()),
            (b":authority", b"mesh"),
            (b"content-type", b"application/json"),
            (b"content-length", value),
        ]
        answer = picker.Picker(mesh, never, never).request_headers(head)
        assert answer is not None and answer.status == 413
        assert json.loads(answer.body)["error"]["code"] == "request_too_large"
        assert _rejected(mesh, "request_too_large") == 3
    finally:
        mesh.close()


# -- JSON nesting ---------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    """A chat body whose deepest nesting is ``depth`` (the top object is 1)."""
    inner = "1"
    for _ in range(depth - 1):
        inner = "[" + inner + "]"
    return ('{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + inner + "}").encode()


def test_json_depth_at_the_bound(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    mock = mock_factory(name="d")
    mesh = _mesh(mesh_factory, mock.url)
    mode: Mode = run_mode(mesh)
    limit = mesh.config.bounds.max_json_depth
    hdrs = {"content-type": "application/json"}
    assert mode.request("POST", PATH, content=_nested(limit), headers=hdrs).status == 200
    over = mode.request("POST", PATH, content=_nested(limit + 1), headers=hdrs)
    assert over.status == 400
    assert over.json()["error"]["code"] == "invalid_request"
    assert "deeper than" in over.json()["error"]["message"]
    # far deeper than any decoder's recursion: still a clean 400
    deep = b'{"x":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    assert mode.request("POST", PATH, content=deep, headers=hdrs).status in (400, 413)
    assert _rejected(mesh, "invalid_request") >= 1
    assert mock.worker.stats.requests_total.get(PATH) == 1


def test_json_depth_follows_the_config(mock_factory: Any, mesh_factory: Any) -> None:
    mock = mock_factory(name="d")
    mesh = _mesh(mesh_factory, mock.url, max_json_depth=8)
    with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        hdrs = {"content-type": "application/json"}
        assert client.post(PATH, content=_nested(8), headers=hdrs).status_code == 200
        assert client.post(PATH, content=_nested(9), headers=hdrs).status_code == 400


# -- SSE lines from workers -----------------------------------------------------------------


def _overlong_stream() -> list[bytes]:
    head = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    # one event ten times over the bound, in network-sized pieces
    big = (
        b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * (10 * SSE_LINE) + b'"}}]}\n\n'
    )
    pieces = [big[i : i + 1500] for i in range(0, len(big), 1500)]
    tail = [
        b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    return [head, *pieces, *tail]


def test_an_overlong_sse_event_neither_breaks_the_relay_nor_grows_memory(
    mesh_factory: Any, run_mode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunks = _overlong_stream()
    raw = RawWorker(lambda: chunks)
    peak = [0]
    accountants: list[StreamAccountant] = []
    feed = StreamAccountant.feed

    def spy(self: StreamAccountant, data: bytes, now: float) -> None:
        if self not in accountants:
            accountants.append(self)
        feed(self, data, now)
        peak[0] = max(peak[0], len(self._buf))

    # A compiled build calls the compiled method directly: the spy cannot see it
    # there (.ci/run runs this file interpreted too, where it can).
    spying = not meshkit.compiled()
    if spying:
        monkeypatch.setattr(StreamAccountant, "feed", spy)
    try:
        mesh = _mesh(mesh_factory, raw.url)
        mode: Mode = run_mode(mesh)
        body = {**_chat(), "stream": True}
        with mode.stream("POST", PATH, json=body) as got:
            relayed = b"".join(got)
        assert relayed == b"".join(chunks)  # relayed byte for byte
        assert stream_terminal("chat", relayed) == "complete"
        assert wait_until(lambda: mesh.total_load() == 0)
        assert accountants or not spying
        assert all(a.overflow for a in accountants)
        # the overflow is visible in metrics (one stream, counted once)
        assert metric_value(mesh, "mesh_router_stream_overflows_total", api="chat") == 1
        # the accountant's buffer never held much more than one event's bound
        assert peak[0] <= SSE_LINE + 1500 + 1
        assert_settled(mesh)
    finally:
        raw.close()


def test_a_stream_within_the_bound_counts_no_overflow(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="n", output_tokens=4)
    mesh = _mesh(mesh_factory, mock.url)
    mode: Mode = run_mode(mesh)
    with mode.stream("POST", PATH, json={**_chat(), "stream": True}) as got:
        relayed = b"".join(got)
    assert stream_terminal("chat", relayed) == "complete"
    assert wait_until(lambda: mesh.total_load() == 0)
    assert metric_value(mesh, "mesh_router_stream_overflows_total", api="chat") == 0
