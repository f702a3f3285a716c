"""
The ext_proc server
===================

``meshkit extproc`` serves ``envoy.service.ext_proc.v3.ExternalProcessor`` over
gRPC (grpcio's asyncio server): one bidirectional stream per HTTP request Envoy
proxies, driven by a :class:`~meshkit.frontends.extproc.picker.Picker`.

Body modes, as Envoy 1.40 runs them (``docs/extproc.md``):

* ``FULL_DUPLEX_STREAMED`` (the Gateway API Inference Extension's MUST): the
  headers response is held until the request body ends (often an empty last
  chunk); then the header mutation, then the body back as one streamed chunk.
  The response body is passed back chunk by chunk the same way.
* ``BUFFERED``: the headers message is answered CONTINUE at once; the route (header
  mutation, credentials, metadata, a changed body with its ``content-length``)
  goes on the body response.
* A request without a body (headers with end of stream) is routed at the headers.

Beside it: the gRPC health service (``""``, ``liveness``, ``readiness`` and the
ExternalProcessor's name; readiness follows ``/readiness`` of the gateway: a
worker verified healthy), and, on ``extproc.metrics_port``, the gateway's own
routes (``/metrics``, ``/health``, ``/readiness``, ``/workers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshkit.errors import MeshError
from meshkit.frontends.extproc import wire
from meshkit.frontends.extproc.picker import Answer, Picker, Route
from meshkit.frontends.extproc.resolve import EndpointResolver
from meshkit.mesh import Mesh
from meshkit.upstream.base import AsyncUpstream
from meshkit.upstream.select import async_upstream

__all__ = ["SERVICE", "ExtProcServer", "Processor"]

log = logging.getLogger("meshkit.extproc")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_BODY_MODE = (
    "meshkit extproc needs the ext_proc filter's request_body_mode to be "
    "FULL_DUPLEX_STREAMED or BUFFERED"
)
_REQ, _RESP = "request", "response"


class _Stream:
    """The replies of one ext_proc stream, message by message."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.request_mode = wire.FULL_DUPLEX
        self.response_mode = wire.FULL_DUPLEX
        self.routed = False
        self.response_ended = False
        self.done = False  # an immediate response ended the exchange

    def modes(self, message: Any) -> None:
        modes = wire.body_modes(message)
        if modes is not None:
            self.request_mode, self.response_mode = modes

    async def handle(self, message: Any) -> list[Any]:
        kind = message.WhichOneof("request")
        picker = self.picker
        if kind == "request_headers":
            head = message.request_headers
            picker.subset = wire.subset_of(message)
            answer = picker.request_headers(wire.headers_of(head))
            if answer is not None:
                return self._immediate(answer)
            if head.end_of_stream:
                return await self._route(body_ends=False)
            if self.request_mode not in (wire.FULL_DUPLEX, wire.BUFFERED):
                # STREAMED would send the body on before the route exists; NONE never
                # shows it. The operator's Envoy config is wrong: say so, in the API's shape.
                return self._immediate(picker.refuse(MeshError(_BODY_MODE)))
            if self.request_mode == wire.FULL_DUPLEX:
                return []  # held until the body's end: the route goes on this answer
            return [wire.headers_reply(_REQ)]
        if kind == "request_body":
            body = message.request_body
            answer = picker.request_body(body.body)
            if answer is not None:
                return self._immediate(answer)
            if body.end_of_stream and not self.routed:
                return await self._route(body_ends=True)
            return [] if self.request_mode == wire.FULL_DUPLEX else [wire.body_reply(_REQ)]
        if kind == "request_trailers":
            first = [] if self.routed else await self._route(body_ends=False, trailers=True)
            return first if self.done else [*first, wire.trailers_reply(_REQ)]
        if kind == "response_headers":
            head = message.response_headers
            headers = wire.headers_of(head)
            answer = picker.response_headers(
                wire.status_of(headers), head.end_of_stream, proxy=wire.from_proxy(headers)
            )
            if answer is not None:
                return self._immediate(answer)
            return [wire.headers_reply(_RESP)]
        if kind == "response_body":
            body = message.response_body
            chunk, end = picker.response_body(body.body, body.end_of_stream)
            if self.response_mode != wire.FULL_DUPLEX:
                return [wire.body_reply(_RESP)]
            if self.response_ended:
                return []
            self.response_ended = end
            return [wire.streamed_reply(_RESP, chunk, end)]
        if kind == "response_trailers":
            rest = picker.response_end()
            replies = []
            if self.response_mode == wire.FULL_DUPLEX and rest and not self.response_ended:
                replies.append(wire.streamed_reply(_RESP, rest, False))
            return [*replies, wire.trailers_reply(_RESP)]
        return []

    async def _route(self, *, body_ends: bool, trailers: bool = False) -> list[Any]:
        decision = await self.picker.decide()
        if isinstance(decision, Answer):
            return self._immediate(decision)
        self.routed = True
        return self._routed(decision, body_ends=body_ends, trailers=trailers)

    def _routed(self, route: Route, *, body_ends: bool, trailers: bool) -> list[Any]:
        if not body_ends and not trailers:  # a body-less request, routed at its headers
            mutation = wire.route_mutation(route, content_length=False)
            return [wire.headers_reply(_REQ, mutation, route=route)]
        body = route.body if route.body is not None else self.picker.body
        if self.request_mode == wire.FULL_DUPLEX:
            # The body's length may change (the rank append) and full duplex sends
            # it chunked anyway: Content-Length does not survive this mode.
            mutation = wire.route_mutation(route, content_length=False)
            return [
                wire.headers_reply(_REQ, mutation, route=route),
                wire.streamed_reply(_REQ, body, not trailers),
            ]
        mutation = wire.route_mutation(route, content_length=True)
        return [wire.body_reply(_REQ, mutation, body=route.body, route=route)]

    def _immediate(self, answer: Answer) -> list[Any]:
        self.done = True
        return [wire.immediate(answer)]


class Processor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ExternalProcessor service over one mesh."""

    def __init__(self, mesh: Mesh, upstream: AsyncUpstream, resolver: EndpointResolver) -> None:
        self.mesh = mesh
        self.upstream = upstream
        self.resolver = resolver

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        picker = Picker(self.mesh, self.resolver, self.upstream.asend)
        stream = _Stream(picker)
        first = True
        try:
            async for message in requests:
                if first:
                    stream.modes(message)
                    first = False
                for reply in await stream.handle(message):
                    yield reply
                if stream.done:
                    return
        finally:
            # The client left, Envoy gave up, or the exchange ended: settle once.
            picker.close()


class ExtProcServer:
    """The gRPC server, its health service and its readiness updates."""

    def __init__(
        self,
        mesh: Mesh,
        *,
        host: str,
        port: int,
        max_streams: int,
        resolve_ttl_s: float,
        resolve_max: int,
    ) -> None:
        self.mesh = mesh
        self.host = host
        self.port = port
        self.max_streams = max_streams
        self.upstream = async_upstream(mesh.config.upstream)
        self.resolver = EndpointResolver(ttl_s=resolve_ttl_s, max_entries=resolve_max)
        self.health = health.aio.HealthServicer()
        self.server: Any = None
        self.bound_port = 0
        self._ready_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and serve; returns the port (``port = 0`` picks a free one)."""
        config = self.mesh.config
        most = config.extproc.message_limit(config.bounds.max_body_bytes)
        server = grpc.aio.server(
            maximum_concurrent_rpcs=self.max_streams,
            options=[
                ("grpc.max_receive_message_length", most),
                ("grpc.max_send_message_length", most),
            ],
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(
            Processor(self.mesh, self.upstream, self.resolver), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.bound_port = server.add_insecure_port(f"{self.host}:{self.port}")
        if not self.bound_port:
            raise OSError(f"cannot listen on {self.host}:{self.port}")
        await server.start()
        self.server = server
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        self._ready_task = asyncio.create_task(self._readiness())
        return self.bound_port

    async def _readiness(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        last = None
        while True:
            h = self.mesh.health()
            ok = h["pool"] == "ok" and h["verified_workers"] > 0
            if ok != last:
                state = serving if ok else not_serving
                for name in ("", "readiness", SERVICE):
                    await self.health.set(name, state)
                last = ok
            await asyncio.sleep(0.5)

    async def stop(self, grace_s: float) -> None:
        """Stop taking streams; those running get ``grace_s`` to end."""
        if self._ready_task is not None:
            self._ready_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ready_task
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.upstream.aclose()


async def serve_extproc(
    mesh: Mesh,
    server: ExtProcServer,
    *,
    grace_s: float,
    stop: asyncio.Event,
    ready: Callable[[int], None],
) -> None:
    """Serve until ``stop`` is set, then shut down gracefully."""
    port = await server.start()
    mesh.start_lifecycle()
    ready(port)
    try:
        await stop.wait()
    finally:
        await server.stop(grace_s)
