"""
Client transports
=================

.. code-block:: python

    client = openai.OpenAI(base_url="http://mesh/v1", api_key="unused",
                           http_client=httpx2.Client(transport=MeshTransport(mesh)))

The client does its own placement, with no extra network hop. The transport
ignores the host of the client's base URL, places the request on a worker,
rewrites scheme/host/port (path and query kept), applies the worker's
credentials and delegates to an inner transport of the client's own library.

One class serves both httpx and httpx2 clients (the openai 3.x and anthropic 2.x
SDKs use httpx2; a legacy ``httpx.Client`` still works): each request is answered
in its own library's ``Response`` type. Inner transports are created lazily per
library (pooled ``HTTPTransport``) unless one is given.

Non-inference paths go to a healthy worker as they are; ``GET /v1/models``
answers the union of the workers' lists.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import httpx

from meshkit.adapters.drive import Answered, UpstreamFailure, drive_async, drive_sync
from meshkit.adapters.httpx_upstream import send_async, send_sync
from meshkit.adapters.relay import AsyncRelayStream, Relay, SyncRelayStream
from meshkit.core.credentials import response_headers
from meshkit.core.endpoints import Match, shape_for_path
from meshkit.core.forward import Attempt
from meshkit.core.requests import RequestView
from meshkit.errors import MeshError, RequestTooLarge, UpstreamError
from meshkit.mesh import Mesh

try:  # httpx2 is a dependency; keep the module importable if a user removed it
    import httpx2
except ImportError:  # pragma: no cover
    httpx2 = None  # type: ignore[assignment]

__all__ = ["AsyncMeshTransport", "MeshTransport"]

_SyncBase: tuple[type, ...] = (httpx.BaseTransport,) + ((httpx2.BaseTransport,) if httpx2 else ())
_AsyncBase: tuple[type, ...] = (httpx.AsyncBaseTransport,) + (
    (httpx2.AsyncBaseTransport,) if httpx2 else ()
)


def _lib_of(request: Any) -> ModuleType:
    name = type(request).__module__.split(".", 1)[0]
    return sys.modules.get(name) or importlib.import_module(name)


def _split(request: Any) -> tuple[str, str]:
    raw: bytes = request.url.raw_path
    path, _, query = raw.decode("latin-1").partition("?")
    return path, query


def _error_response(lib: ModuleType, exc: MeshError, path: str, mesh: Mesh) -> Any:
    mesh.reject(exc)
    return lib.Response(exc.status, headers=exc.headers(), content=exc.body(shape_for_path(path)))


class _Common:
    def __init__(self, mesh: Mesh | None, inner: Any) -> None:
        self.mesh = mesh if mesh is not None else Mesh.from_env()
        self._inner: dict[str, Any] = {}
        if inner is not None:
            self._inner[type(inner).__module__.split(".", 1)[0]] = inner

    def _limits(self, lib: ModuleType) -> Any:
        up = self.mesh.config.upstream
        return lib.Limits(
            max_connections=up.pool_limit,
            max_keepalive_connections=up.pool_limit_per_worker,
            keepalive_expiry=up.idle_timeout_s,
        )

    def _begin(self, request: Any, body: bytes) -> tuple[str, str, Match | None]:
        path, query = _split(request)
        match = self.mesh.resolve(request.method, path)
        limit = self.mesh.config.bounds.max_body_bytes
        if len(body) > limit:
            raise RequestTooLarge(f"request body is over {limit} bytes")
        return path, query, match

    def _pass_through(self, request: Any, path: str, query: str, body: bytes) -> Attempt:
        return self.mesh.pass_through(request.method, path, query, list(request.headers.raw), body)

    def _answer(self, lib: ModuleType, final: Answered, view: RequestView) -> Any:
        self.mesh.account_local(view, final.attempt, final.local)
        local = final.local
        return lib.Response(local.status, headers=list(local.headers), content=local.body)


class MeshTransport(_Common, *_SyncBase):  # type: ignore[misc]
    """A sync transport for ``httpx.Client`` and ``httpx2.Client``.

    :param mesh: the :class:`~meshkit.Mesh` (``Mesh.from_env()`` when omitted).
    :param inner: the transport that talks to workers; by default a pooled
        ``HTTPTransport`` of each request's own library.
    """

    def __init__(self, mesh: Mesh | None = None, *, inner: Any = None) -> None:
        _Common.__init__(self, mesh, inner)

    def _transport(self, lib: ModuleType) -> Any:
        t = self._inner.get(lib.__name__)
        if t is None:
            t = self._inner[lib.__name__] = lib.HTTPTransport(limits=self._limits(lib))
        return t

    def handle_request(self, request: Any) -> Any:
        lib = _lib_of(request)
        transport = self._transport(lib)
        mesh = self.mesh
        path = ""
        try:
            body = request.read()
            path, query, match = self._begin(request, body)
            if match is None:
                attempt = self._pass_through(request, path, query, body)
                plain = send_sync(lib, transport, attempt)
                return lib.Response(
                    plain.status, headers=response_headers(plain.headers), stream=plain.stream
                )
            headers = list(request.headers.raw)
            view = mesh.prepare(match, body, headers, query)
            flow = mesh.forward(view, headers, request.method)
            final = drive_sync(flow, lambda a: send_sync(lib, transport, a))
        except MeshError as exc:
            return _error_response(lib, exc, path, mesh)
        except UpstreamFailure:
            return _error_response(
                lib, UpstreamError("the worker could not be reached"), path, mesh
            )
        if isinstance(final, Answered):
            return self._answer(lib, final, view)
        exchange, lease = final.exchange, final.attempt.lease
        relay = Relay(view, mesh.account(view, lease, exchange.status))
        return lib.Response(
            exchange.status,
            headers=response_headers(exchange.headers),
            stream=SyncRelayStream(exchange, relay),
        )

    def close(self) -> None:
        for t in self._inner.values():
            t.close()


class AsyncMeshTransport(_Common, *_AsyncBase):  # type: ignore[misc]
    """An async transport for ``httpx.AsyncClient`` and ``httpx2.AsyncClient``."""

    def __init__(self, mesh: Mesh | None = None, *, inner: Any = None) -> None:
        _Common.__init__(self, mesh, inner)

    def _transport(self, lib: ModuleType) -> Any:
        t = self._inner.get(lib.__name__)
        if t is None:
            t = self._inner[lib.__name__] = lib.AsyncHTTPTransport(limits=self._limits(lib))
        return t

    async def handle_async_request(self, request: Any) -> Any:
        lib = _lib_of(request)
        transport = self._transport(lib)
        mesh = self.mesh
        path = ""
        try:
            body = await request.aread()
            path, query, match = self._begin(request, body)
            if match is None:
                attempt = self._pass_through(request, path, query, body)
                plain = await send_async(lib, transport, attempt)
                return lib.Response(
                    plain.status, headers=response_headers(plain.headers), stream=plain.stream
                )
            headers = list(request.headers.raw)
            view = await mesh.prepare_async(match, body, headers, query)
            flow = mesh.forward(view, headers, request.method)
            final = await drive_async(flow, lambda a: send_async(lib, transport, a))
        except MeshError as exc:
            return _error_response(lib, exc, path, mesh)
        except UpstreamFailure:
            return _error_response(
                lib, UpstreamError("the worker could not be reached"), path, mesh
            )
        if isinstance(final, Answered):
            return self._answer(lib, final, view)
        exchange, lease = final.exchange, final.attempt.lease
        relay = Relay(view, mesh.account(view, lease, exchange.status))
        return lib.Response(
            exchange.status,
            headers=response_headers(exchange.headers),
            stream=AsyncRelayStream(exchange, relay),
        )

    async def aclose(self) -> None:
        for t in self._inner.values():
            await t.aclose()
