"""``GET /v1/responses/{id}?stream=true`` is a stream (PROTOCOLS.md §2, "Resource
operations"): the SDK's ``responses.retrieve(id, stream=True)`` follows a background
response as it is generated. meshkit relays its events as they come (not one chunk
behind, as a whole body is relayed) and parses them as a Responses stream.

A read, streamed or not, is no generation: it observes no time to first token, and
the usage of the response it reads was counted at its create, except for a
response generated in the background (its create answers ``queued``, without
usage): the first read that finds it ended counts its tokens, once per process
(``docs/metrics.md``, "Reads of stored responses").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness import AsyncTransportMode, Mode, TransportMode, wait_until
from meshkit import Mesh
from meshkit.config import MeshConfig
from meshkit.errors import ConfigError
from reliability.rawworker import QuietHandler, Served

RID = "resp_bg1"
HEAD = (
    b'event: response.created\ndata: {"type":"response.created","response":'
    b'{"id":"resp_bg1","status":"in_progress","background":true,"usage":null},'
    b'"sequence_number":0}\n\n'
)
REST = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Hi","sequence_number":1}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","response":'
    b'{"id":"resp_bg1","status":"completed","background":true,"usage":{"input_tokens":5,'
    b'"output_tokens":1,"total_tokens":6}},"sequence_number":2}\n\n'
)


class StreamingRetrieveWorker(Served):
    """Answers ``GET /v1/responses/{id}?stream=true`` with ``HEAD``, then waits for
    ``more`` before it sends ``REST`` (a background response still generating)."""

    def __init__(self) -> None:
        self.more = threading.Event()
        self.paths: list[str] = []
        outer = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if not self.path.startswith("/v1/responses/"):
                    self.send_response(200)  # health probes
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                outer.paths.append(self.path)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for chunk in (HEAD, None, REST):
                    if chunk is None:
                        outer.more.wait(30)
                        continue
                    self.wfile.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        super().__init__(Handler)

    def close(self) -> None:
        self.more.set()
        super().close()


@pytest.fixture
def worker() -> Iterator[StreamingRetrieveWorker]:
    w = StreamingRetrieveWorker()
    yield w
    w.close()


@pytest.mark.not_in_extproc("Responses resources are refused there (501 unsupported_in_ext_proc)")
def test_a_streamed_retrieve_is_relayed_as_it_comes_and_accounted_as_a_read(
    worker: StreamingRetrieveWorker, mesh_factory: Any, run_mode: Any
) -> None:
    mesh = mesh_factory(workers=[worker.url], lifecycle={"probe": False})
    mode = run_mode(mesh)
    got: list[bytes] = []
    ended = threading.Event()

    def read() -> None:
        try:
            with mode.stream("GET", f"/v1/responses/{RID}?stream=true") as chunks:
                for c in chunks:
                    got.append(c)
        finally:
            ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # The worker has sent its first event and waits: the client must have it.
        assert wait_until(lambda: b"".join(got) == HEAD, timeout=10), b"".join(got)
    finally:
        worker.more.set()
    assert ended.wait(30)
    assert b"".join(got) == HEAD + REST
    assert worker.paths == [f"/v1/responses/{RID}?stream=true"]
    sample = mesh.metrics.registry.get_sample_value
    labels = {"api": "responses", "status": "200"}
    assert wait_until(lambda: sample("mesh_router_requests_total", labels) == 1.0)
    # A read: its first delta is no first token of a generation.
    assert not sample("mesh_router_ttft_seconds_count", {"api": "responses"})
    assert sample("mesh_router_request_duration_seconds_count", {"api": "responses"}) == 1.0
    # Parsed as the stream it is: its terminal event ends a background response
    # whose create (queued, no usage) this router never counted: its usage counts.
    assert sample("mesh_router_tokens_total", {"kind": "input"}) == 5.0
    assert sample("mesh_router_tokens_total", {"kind": "output"}) == 1.0
    assert not sample("mesh_router_stream_overflows_total", {"api": "responses"})


@pytest.mark.parametrize(
    ("path", "query", "streams"),
    [
        ("/v1/responses/resp_1", "stream=true", True),
        ("/v1/responses/resp_1", "include%5B%5D=x&stream=true&starting_after=3", True),
        ("/v1/responses/resp_1", "stream=false", False),
        ("/v1/responses/resp_1", "stream=true&stream=false", False),
        ("/v1/responses/resp_1", "streams=true", False),
        ("/v1/responses/resp_1", "", False),
        ("/v1/responses/resp_1/input_items", "stream=true", False),
        ("/v1/conversations/conv_1", "stream=true", False),
    ],
)
def test_which_reads_stream(path: str, query: str, streams: bool) -> None:
    from meshkit.core.endpoints import resolve
    from meshkit.core.requests import query_streams

    match = resolve("GET", path)
    assert match is not None
    assert query_streams(match, query) is streams


class Sdk:
    """The OpenAI SDK's Responses calls through ``mode``: the sync client, or the
    async one on the async transport's own loop. A stream is read to its end."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        if isinstance(mode, AsyncTransportMode):
            self.aclient: Any = mode.async_openai(max_retries=0)
        else:
            self.client: Any = mode.openai(max_retries=0)

    def create(self, **kw: Any) -> Any:
        return self._call("create", **kw)

    def retrieve(self, rid: str, **kw: Any) -> Any:
        return self._call("retrieve", rid, **kw)

    def cancel(self, rid: str) -> Any:
        return self._call("cancel", rid)

    def _call(self, op: str, *args: Any, **kw: Any) -> Any:
        streamed = kw.get("stream") is True
        if not isinstance(self.mode, AsyncTransportMode):
            out = getattr(self.client.responses, op)(*args, **kw)
            return list(out) if streamed else out

        async def go() -> Any:
            out = await getattr(self.aclient.responses, op)(*args, **kw)
            return [e async for e in out] if streamed else out

        return self.mode.run(go)


def _metrics(mesh: Mesh) -> Callable[..., float]:
    """A sample of the mesh's metrics (0 for a series never observed)."""
    get = mesh.metrics.registry.get_sample_value

    def sample(name: str, **labels: str) -> float:
        return get(name, labels) or 0.0

    return sample


def _answered(mesh: Mesh, n: int) -> bool:
    """The books of ``n`` Responses calls have closed (a condition, not a timing)."""
    sample = _metrics(mesh)
    return sample("mesh_router_requests_total", api="responses", status="200") == n


@pytest.mark.not_in_extproc("Responses resources are refused there (501 unsupported_in_ext_proc)")
def test_reading_a_stored_response_does_not_count_its_tokens_again(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="w0", output_tokens=5)
    mesh = mesh_factory(workers=[mock.url])
    sdk = Sdk(run_mode(mesh))
    sample = _metrics(mesh)
    created = sdk.create(model="m", input="hello there")
    assert created.background is False
    assert wait_until(lambda: _answered(mesh, 1))
    assert sample("mesh_router_tokens_total", kind="output") == 5.0
    input_tokens = sample("mesh_router_tokens_total", kind="input")
    assert input_tokens == created.usage.input_tokens > 0
    assert sample("mesh_router_ttft_seconds_count", api="responses") == 1.0
    got = sdk.retrieve(created.id)
    assert got.usage.output_tokens == 5  # the read carries the usage: not counted again
    events = sdk.retrieve(created.id, stream=True)
    assert events[-1].type == "response.completed"
    assert wait_until(lambda: _answered(mesh, 3))
    assert sample("mesh_router_tokens_total", kind="output") == 5.0
    assert sample("mesh_router_tokens_total", kind="input") == input_tokens
    # Neither read, streamed or not, is a generation: the create's TTFT alone.
    assert sample("mesh_router_ttft_seconds_count", api="responses") == 1.0
    assert sample("mesh_router_request_duration_seconds_count", api="responses") == 3.0
    assert not sample("mesh_router_streams_without_usage_total", api="responses")


@pytest.mark.not_in_extproc("Responses resources are refused there (501 unsupported_in_ext_proc)")
def test_a_background_response_is_counted_once_however_often_it_is_read(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    # The mock generates it for a while after its create answered "queued".
    mock = mock_factory(name="w0", output_tokens=5, first_token_ms=100)
    mesh = mesh_factory(workers=[mock.url])
    sdk = Sdk(run_mode(mesh))
    sample = _metrics(mesh)
    created = sdk.create(model="m", input="hello there", background=True)
    assert (created.status, created.usage) == ("queued", None)
    polls: list[Any] = []

    def ended() -> bool:
        polls.append(sdk.retrieve(created.id))
        return bool(polls[-1].status == "completed")

    assert wait_until(ended, timeout=30)
    usage = polls[-1].usage
    assert usage.output_tokens == 5
    for _ in range(3):  # later reads of the ended response
        assert sdk.retrieve(created.id).usage.output_tokens == 5
    events = sdk.retrieve(created.id, stream=True)  # a streamed one
    assert events[-1].type == "response.completed"
    assert sdk.cancel(created.id).status == "completed"  # it has ended: answered as it is
    calls = 1 + len(polls) + 3 + 1 + 1
    assert wait_until(lambda: _answered(mesh, calls))
    assert sample("mesh_router_tokens_total", kind="output") == 5.0
    assert sample("mesh_router_tokens_total", kind="input") == usage.input_tokens
    assert (
        sample("mesh_router_tokens_total", kind="cached")
        == usage.input_tokens_details.cached_tokens
    )
    # The create answered without output, and no read is a generation.
    assert not sample("mesh_router_ttft_seconds_count", api="responses")
    assert sample("mesh_router_request_duration_seconds_count", api="responses") == calls


@pytest.mark.not_in_extproc("Responses resources are refused there (501 unsupported_in_ext_proc)")
def test_a_streamed_background_create_is_counted_at_its_end_and_not_by_a_read(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="w0", output_tokens=5)
    mesh = mesh_factory(workers=[mock.url])
    sdk = Sdk(run_mode(mesh))
    sample = _metrics(mesh)
    events = sdk.create(model="m", input="hello there", background=True, stream=True)
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.background is True
    assert wait_until(lambda: _answered(mesh, 1))
    assert sample("mesh_router_tokens_total", kind="output") == 5.0
    assert sample("mesh_router_ttft_seconds_count", api="responses") == 1.0
    assert sdk.retrieve(done.response.id).usage.output_tokens == 5
    assert sdk.retrieve(done.response.id, stream=True)[-1].type == "response.completed"
    assert wait_until(lambda: _answered(mesh, 3))
    assert sample("mesh_router_tokens_total", kind="output") == 5.0
    assert sample("mesh_router_tokens_total", kind="input") == done.response.usage.input_tokens
    assert sample("mesh_router_ttft_seconds_count", api="responses") == 1.0


def test_the_counted_responses_are_bounded(mock_factory: Any, mesh_factory: Any) -> None:
    # One id remembered: a response forgotten past the bound is counted again when
    # it is read again (the documented cost of the bound), then remembered again.
    mock = mock_factory(name="w0", output_tokens=5)
    mesh = mesh_factory(workers=[mock.url], routing={"responses_counted_max": 1})
    assert mesh.router.counted.max_entries == 1
    mode = TransportMode(mesh)
    try:
        sdk = Sdk(mode)
        sample = _metrics(mesh)
        calls = 0

        def output_after(call: Callable[[], Any]) -> float:
            nonlocal calls
            call()
            calls += 1
            assert wait_until(lambda: _answered(mesh, calls))
            return sample("mesh_router_tokens_total", kind="output")

        def create() -> str:
            events = sdk.create(model="m", input="hi", background=True, stream=True)
            return str(events[-1].response.id)

        ids: list[str] = []
        assert output_after(lambda: ids.append(create())) == 5.0
        assert output_after(lambda: ids.append(create())) == 10.0  # the first forgotten
        a, b = ids
        assert len(mesh.router.counted) == 1
        assert output_after(lambda: sdk.retrieve(b)) == 10.0
        assert output_after(lambda: sdk.retrieve(a)) == 15.0  # forgotten: counted again
        assert output_after(lambda: sdk.retrieve(a)) == 15.0
    finally:
        mode.close()


def test_the_counted_responses_forget_the_least_recently_read() -> None:
    from meshkit.accounting import CountedResponses

    counted = CountedResponses(2)
    assert counted.first("a") and counted.first("b")
    assert not counted.first("a")  # read again: now the most recent
    assert counted.first("c")  # "b" goes
    assert ("a" in counted, "b" in counted, "c" in counted) == (True, False, True)
    assert len(counted) == 2
    assert counted.first("b")


@pytest.mark.parametrize("value", [0, -1])
def test_the_counted_responses_bound_is_at_least_one(value: int) -> None:
    assert MeshConfig.build().routing.responses_counted_max == 100_000
    with pytest.raises(ConfigError) as info:
        MeshConfig.build(routing={"responses_counted_max": value})
    assert info.value.key == "routing.responses_counted_max"
