"""
The ext_proc messages
=====================

The only module that knows protobuf: Envoy's ``ProcessingRequest`` in, plain
values out, and the ``ProcessingResponse`` for each of the picker's answers.
The messages are those of ``envoy/service/ext_proc/v3/external_processor.proto``
(the ``xds-protos`` stubs); the picker protocol is the Gateway API Inference
Extension's (``docs/proposals/004-endpoint-picker-protocol``): the chosen
endpoint goes in the ``x-gateway-destination-endpoint`` request header and in
the dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``.
"""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from meshkit.frontends.extproc.picker import DESTINATION, Answer, Route
from meshkit.types import Headers

__all__ = ["FULL_DUPLEX", "Kind", "body_modes", "headers_of", "pb"]

#: ``ProcessingMode.BodySendMode`` values (processing_mode.proto)
_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED = _Mode.BUFFERED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_LB = "envoy.lb"
_SUBSET_NS = "envoy.lb.subset_hint"
_SUBSET_KEY = "x-gateway-destination-endpoint-subset"
_DEST = DESTINATION.decode()

#: which side a response message answers: "request" or "response"
Kind = str


def headers_of(message: Any) -> Headers:
    """An ``HttpHeaders``' header map as lower-case byte pairs. Envoy fills
    ``raw_value`` (``value`` only in old releases)."""
    out: Headers = []
    for h in message.headers.headers:
        out.append((h.key.lower().encode("latin-1"), h.raw_value or h.value.encode("latin-1")))
    return out


def status_of(headers: Headers) -> int:
    for k, v in headers:
        if k == b":status":
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


def from_proxy(headers: Headers) -> bool:
    """Whether Envoy wrote this response itself (a local reply: the worker was not
    reached, or timed out). Envoy's router marks every upstream response with
    ``x-envoy-upstream-service-time`` (unless ``suppress_envoy_headers`` is set on
    it, which this mode therefore does not support)."""
    return not any(k == b"x-envoy-upstream-service-time" for k, _ in headers)


def subset_of(request: Any) -> list[str] | None:
    """The GIE subset hint of a request (``metadata_context.filter_metadata``
    ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``: a list of
    ``IP:port``, or one comma list); None when the proxy sets none."""
    md = request.metadata_context.filter_metadata
    if _SUBSET_NS not in md:
        return None
    fields = md[_SUBSET_NS].fields
    if _SUBSET_KEY not in fields:
        return None
    value = fields[_SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value.strip() for v in value.list_value.values if v.string_value]
    if kind == "string_value":
        return [e.strip() for e in value.string_value.split(",") if e.strip()]
    return []


def body_modes(request: Any) -> tuple[int, int] | None:
    """The request and response body modes Envoy says it runs (``protocol_config``
    of the first message; None when it does not say)."""
    if not request.HasField("protocol_config"):
        return None
    pc = request.protocol_config
    return pc.request_body_mode, pc.response_body_mode


def _option(key: bytes, value: bytes) -> Any:
    header = base_pb2.HeaderValue(key=key.decode("latin-1"), raw_value=value)
    return base_pb2.HeaderValueOption(header=header, append_action=_OVERWRITE)


def _mutation(sets: Headers, removes: list[bytes]) -> Any:
    return pb.HeaderMutation(
        set_headers=[_option(k, v) for k, v in sets],
        remove_headers=[n.decode("latin-1") for n in removes],
    )


def route_mutation(route: Route, *, content_length: bool) -> Any:
    """The header edits of a route: the destination, credentials, the rank, and
    (``content_length``, BUFFERED mode) the length of a body that changed."""
    sets = [(DESTINATION, route.endpoint.encode()), *route.set_headers]
    if content_length and route.body is not None:
        sets.append((b"content-length", str(len(route.body)).encode()))
    return _mutation(sets, route.remove_headers)


def metadata(route: Route) -> Any:
    md = struct_pb2.Struct()
    md.update({_LB: {_DEST: route.endpoint}})
    return md


def _common(mutation: Any = None, body: Any = None) -> Any:
    common = pb.CommonResponse()
    if mutation is not None:
        common.header_mutation.CopyFrom(mutation)
    if body is not None:
        common.body_mutation.CopyFrom(body)
    return common


def headers_reply(kind: Kind, mutation: Any = None, *, route: Route | None = None) -> Any:
    reply = pb.ProcessingResponse(
        **{f"{kind}_headers": pb.HeadersResponse(response=_common(mutation))}
    )
    if route is not None:
        reply.dynamic_metadata.CopyFrom(metadata(route))
    return reply


def body_reply(
    kind: Kind, mutation: Any = None, *, body: bytes | None = None, route: Route | None = None
) -> Any:
    """A ``BodyResponse`` for BUFFERED/STREAMED bodies: continue, with edits."""
    change = None if body is None else pb.BodyMutation(body=body)
    reply = pb.ProcessingResponse(
        **{f"{kind}_body": pb.BodyResponse(response=_common(mutation, change))}
    )
    if route is not None:
        reply.dynamic_metadata.CopyFrom(metadata(route))
    return reply


def streamed_reply(kind: Kind, chunk: bytes, end_of_stream: bool) -> Any:
    """A FULL_DUPLEX_STREAMED body chunk sent on."""
    change = pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
    )
    return pb.ProcessingResponse(**{f"{kind}_body": pb.BodyResponse(response=_common(body=change))})


def trailers_reply(kind: Kind) -> Any:
    return pb.ProcessingResponse(**{f"{kind}_trailers": pb.TrailersResponse()})


def immediate(answer: Answer) -> Any:
    """The answer as Envoy sends it to the client: its status, headers (Envoy's
    default content-type is text/plain) and body."""
    headers = list(answer.headers)
    if not any(k == b"content-type" for k, _ in headers):
        headers.append((b"content-type", b"application/json"))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=answer.status),
            headers=_mutation(headers, []),
            body=answer.body,
            details="meshkit",
        )
    )
