"""
Client transports
=================

.. code-block:: python

    client = openai.OpenAI(base_url="http://mesh/v1", api_key="unused",
                           http_client=httpx2.Client(transport=MeshTransport(mesh)))

The client does its own placement, with no extra network hop. The transport
ignores the host of the client's base URL, places the request on a worker,
rewrites scheme/host/port (path and query kept), applies the worker's
credentials and sends it to the worker.

One class serves both httpx and httpx2 clients (the openai 3.x and anthropic 2.x
SDKs use httpx2; a legacy ``httpx.Client`` still works): each request is answered
in its own library's ``Response`` type. Each library gets its own upstream, made
on its first request by :mod:`meshkit.upstream.select`: ``http://`` workers on
meshkit's own connections (the sync transport's on blocking sockets: ~30 µs of
CPU per attempt where httpcore and h11 take ~200 µs; the async transport's, under
asyncio, on asyncio protocols), ``https://`` workers and every attempt of the
async transport under another library (trio) on the httpcore the library is
built on. An ``inner`` transport given, attempts of its library go through it.

Non-inference paths go to a healthy worker as they are; ``GET /v1/models``
answers the union of the workers' lists.

A whole (not streamed) answer whose ``Content-Length`` is within
``bounds.max_sse_line_bytes`` (what accounting parses anyway) is read and
accounted before the response is handed over, so its books are closed even if
the client never reads it; a longer one, or a stream, is relayed as it is read.
A body the worker cuts short raises the library's ``RemoteProtocolError``, as a
direct connection would.

Bounds: an inference request's head is checked against ``bounds.max_header_bytes``
and ``bounds.max_headers`` (431); a body is read from the request's stream piece
by piece and refused (413) as soon as it is over ``bounds.max_body_bytes``, or at
once when its ``Content-Length`` says so. Upstream attempts carry the
``[upstream]`` timeouts.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import ModuleType
from typing import Any

import httpx

from meshkit.config import BoundsConfig
from meshkit.core.credentials import response_headers
from meshkit.core.endpoints import shape_for_path
from meshkit.core.forward import Attempt
from meshkit.core.requests import RequestView, head_error
from meshkit.errors import MeshError, RequestTooLarge, UpstreamError
from meshkit.frontends.relay import AsyncRelayStream, Relay, SyncRelayStream
from meshkit.mesh import Accounting, Mesh
from meshkit.upstream.base import AsyncUpstream, SyncUpstream
from meshkit.upstream.drive import Answered, UpstreamFailure, drive_async, drive_sync
from meshkit.upstream.inner import library_of
from meshkit.upstream.select import async_upstream, sync_upstream

try:  # httpx2 is a dependency; keep the module importable if a user removed it
    import httpx2
except ImportError:  # pragma: no cover
    httpx2 = None  # type: ignore[assignment]

__all__ = ["AsyncMeshTransport", "MeshTransport"]

_SyncBase: tuple[type, ...] = (httpx.BaseTransport,) + ((httpx2.BaseTransport,) if httpx2 else ())
_AsyncBase: tuple[type, ...] = (httpx.AsyncBaseTransport,) + (
    (httpx2.AsyncBaseTransport,) if httpx2 else ()
)
_SyncStream: tuple[type, ...] = (httpx.SyncByteStream,) + (
    (httpx2.SyncByteStream,) if httpx2 else ()
)
_AsyncStream: tuple[type, ...] = (httpx.AsyncByteStream,) + (
    (httpx2.AsyncByteStream,) if httpx2 else ()
)


_LIBS: dict[type, ModuleType] = {}


def _lib_of(request: Any) -> ModuleType:
    kind = type(request)
    lib = _LIBS.get(kind)
    if lib is None:
        name = kind.__module__.split(".", 1)[0]
        lib = _LIBS[kind] = sys.modules.get(name) or importlib.import_module(name)
    return lib


def _split(request: Any) -> tuple[str, str]:
    raw: bytes = request.url.raw_path
    path, _, query = raw.decode("latin-1").partition("?")
    return path, query


def _head(request: Any, inference: bool, bounds: BoundsConfig) -> list[tuple[bytes, bytes]]:
    """The request's headers as a server would hand them on, in one pass.

    Values lose the optional whitespace around them (RFC 9110 §5.5; h11 refuses
    to send it). An inference request's head is held to the header bounds (431,
    measured on the raw lines as every mode does), and any request whose
    ``Content-Length`` is over ``bounds.max_body_bytes`` is refused (413) before
    its body is read.
    """
    out: list[tuple[bytes, bytes]] = []
    size = 0
    declared = b""
    for k, v in request.headers.raw:
        size += len(k) + len(v) + 4
        if len(k) == 14 and not declared and k.lower() == b"content-length":
            declared = v.strip() or b"-"
        out.append((k, v.strip(b" \t")))
    if inference:
        error = head_error(
            len(out), size, max_bytes=bounds.max_header_bytes, max_count=bounds.max_headers
        )
        if error is not None:
            raise error
    if declared.isdigit() and int(declared) > bounds.max_body_bytes:
        raise _too_large(bounds.max_body_bytes)
    return out


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"request body is over {limit} bytes")


def _held(lib: ModuleType, request: Any, limit: int) -> bytes | None:
    """The body, when the client library holds it in memory already (``content=``)."""
    try:
        body = request.content
    except lib.RequestNotRead:  # a streamed body: read piece by piece
        return None
    if not isinstance(body, bytes):
        return None
    if len(body) > limit:
        raise _too_large(limit)
    return body


def _read_sync(lib: ModuleType, request: Any, limit: int) -> bytes:
    """The request body, refused as soon as it is over ``limit`` (never buffered whole)."""
    body = _held(lib, request, limit)
    if body is not None:
        return body
    chunks: list[bytes] = []
    total = 0
    for chunk in request.stream:
        total += len(chunk)
        if total > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_async(lib: ModuleType, request: Any, limit: int) -> bytes:
    body = _held(lib, request, limit)
    if body is not None:
        return body
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream:
        total += len(chunk)
        if total > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class _SyncBody(*_SyncStream):  # type: ignore[misc]
    """A passed-through answer's body, as the client library's byte stream: read
    from the exchange whatever its upstream, a cut raising the library's own error."""

    def __init__(self, exchange: Any, lib: ModuleType) -> None:
        self._exchange = exchange
        self._lib = lib

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._exchange.chunks()
        except UpstreamFailure:
            raise _cut_short(self._lib)() from None

    def close(self) -> None:
        self._exchange.close()


class _AsyncBody(*_AsyncStream):  # type: ignore[misc]
    """:class:`_SyncBody` for the async transport."""

    def __init__(self, exchange: Any, lib: ModuleType) -> None:
        self._exchange = exchange
        self._lib = lib

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._exchange.chunks():
                yield chunk
        except UpstreamFailure:
            raise _cut_short(self._lib)() from None

    async def aclose(self) -> None:
        await self._exchange.aclose()


def _cut_short(lib: ModuleType) -> Any:
    """What a body the worker cut short raises in the client (as a direct connection)."""
    return lambda: lib.RemoteProtocolError("the worker closed the connection mid-response")


def _bytes_response(
    lib: ModuleType, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> Any:
    """A response meshkit built, streamable like one from the network.

    ``Response(content=...)`` would mark the stream consumed at once, and a client
    reading it with ``client.stream(...)`` / ``iter_raw()`` would get
    ``StreamConsumed`` instead of the body.
    """
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return lib.Response(status, headers=headers, stream=lib.ByteStream(body))


def _error_response(lib: ModuleType, exc: MeshError, path: str, mesh: Mesh) -> Any:
    mesh.reject(exc)
    return _bytes_response(lib, exc.status, exc.headers(), exc.body(shape_for_path(path)))


class _Common:
    def __init__(self, mesh: Mesh | None, inner: Any) -> None:
        self.mesh = mesh if mesh is not None else Mesh.from_env()
        self._inner = inner
        self._inner_lib = library_of(inner) if inner is not None else None
        #: library name -> its upstream, made on its first request
        self._upstreams: dict[str, Any] = {}
        # Clients are shared by threads: without the lock, the first requests of
        # a burst each built a pool of their own (the limits did not hold and the
        # extra pools were never closed).
        self._lock = threading.Lock()

    def _upstream(self, lib: ModuleType, make: Callable[..., Any]) -> Any:
        name = lib.__name__
        up = self._upstreams.get(name)
        if up is None:
            with self._lock:
                up = self._upstreams.get(name)
                if up is None:
                    inner = self._inner if name == self._inner_lib else None
                    up = make(self.mesh.config.upstream, inner=inner, lib=lib)
                    self._upstreams[name] = up
        return up

    def _pass_through(
        self, request: Any, path: str, query: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Attempt:
        return self.mesh.pass_through(request.method, path, query, headers, body)

    def _whole(self, view: RequestView, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether to read the worker's body before answering: a whole (not
        streamed) body whose ``Content-Length`` is within what accounting parses.

        Read at once, it is accounted before the client gets the response (the
        books close first, as when relayed one chunk behind), and the response
        carries it in memory: no relay stream for the client library to drive
        (~10 µs of a client's ~400 µs per request, ``benchmarks/RESULTS.md``).
        """
        if view.stream:
            return False
        for k, v in headers:
            if len(k) == 14 and k.lower() == b"content-length":
                return v.isdigit() and int(v) <= self.mesh.config.bounds.max_sse_line_bytes
        return False

    def _settled(self, lib: ModuleType, exchange: Any, acct: Accounting, body: bytes) -> Any:
        """The response of a body read whole, once accounted."""
        acct.feed(body)
        acct.end()
        return lib.Response(
            exchange.status, headers=response_headers(exchange.headers), stream=lib.ByteStream(body)
        )

    def _answer(self, lib: ModuleType, final: Answered, view: RequestView) -> Any:
        self.mesh.account_local(view, final.attempt, final.local)
        local = final.local
        return _bytes_response(lib, local.status, list(local.headers), local.body)


class MeshTransport(_Common, *_SyncBase):  # type: ignore[misc]
    """A sync transport for ``httpx.Client`` and ``httpx2.Client``.

    :param mesh: the :class:`~meshkit.Mesh` (``Mesh.from_env()`` when omitted).
    :param inner: an httpx/httpx2 transport that talks to workers for the requests
        of its library; by default meshkit's own connections.
    """

    def __init__(self, mesh: Mesh | None = None, *, inner: Any = None) -> None:
        _Common.__init__(self, mesh, inner)

    def _sender(self, lib: ModuleType) -> Callable[[Attempt], Any]:
        up: SyncUpstream = self._upstream(lib, sync_upstream)
        return up.send

    def handle_request(self, request: Any) -> Any:
        lib = _lib_of(request)
        send = self._sender(lib)
        mesh = self.mesh
        path, query = _split(request)
        try:
            match = mesh.resolve(request.method, path)
            bounds = mesh.config.bounds
            headers = _head(request, match is not None, bounds)
            body = _read_sync(lib, request, bounds.max_body_bytes)
            if match is None:
                attempt = self._pass_through(request, path, query, headers, body)
                plain = send(attempt)
                return lib.Response(
                    plain.status,
                    headers=response_headers(plain.headers),
                    stream=_SyncBody(plain, lib),
                )
            view = mesh.prepare(match, body, headers, query)
            flow = mesh.forward(view, headers, request.method)
            final = drive_sync(flow, send)
        except MeshError as exc:
            return _error_response(lib, exc, path, mesh)
        except UpstreamFailure:
            return _error_response(
                lib, UpstreamError("the worker could not be reached"), path, mesh
            )
        if isinstance(final, Answered):
            return self._answer(lib, final, view)
        exchange, lease = final.exchange, final.attempt.lease
        acct = mesh.account(view, lease, exchange.status)
        if self._whole(view, exchange.headers):
            try:
                body = b"".join(exchange.chunks())
            except UpstreamFailure:
                acct.abort(client_left=False)
                raise _cut_short(lib)() from None
            finally:
                exchange.close()
            return self._settled(lib, exchange, acct, body)
        relay = Relay(view, acct, _cut_short(lib))
        return lib.Response(
            exchange.status,
            headers=response_headers(exchange.headers),
            stream=SyncRelayStream(exchange, relay),
        )

    def close(self) -> None:
        for up in self._upstreams.values():
            up.close()


class AsyncMeshTransport(_Common, *_AsyncBase):  # type: ignore[misc]
    """An async transport for ``httpx.AsyncClient`` and ``httpx2.AsyncClient``."""

    def __init__(self, mesh: Mesh | None = None, *, inner: Any = None) -> None:
        _Common.__init__(self, mesh, inner)

    def _sender(self, lib: ModuleType) -> Callable[[Attempt], Awaitable[Any]]:
        up: AsyncUpstream = self._upstream(lib, async_upstream)
        return up.asend

    async def handle_async_request(self, request: Any) -> Any:
        lib = _lib_of(request)
        send = self._sender(lib)
        mesh = self.mesh
        path, query = _split(request)
        try:
            match = mesh.resolve(request.method, path)
            bounds = mesh.config.bounds
            headers = _head(request, match is not None, bounds)
            body = await _read_async(lib, request, bounds.max_body_bytes)
            if match is None:
                attempt = self._pass_through(request, path, query, headers, body)
                plain = await send(attempt)
                return lib.Response(
                    plain.status,
                    headers=response_headers(plain.headers),
                    stream=_AsyncBody(plain, lib),
                )
            view = await mesh.prepare_async(match, body, headers, query)
            flow = mesh.forward(view, headers, request.method)
            final = await drive_async(flow, send)
        except MeshError as exc:
            return _error_response(lib, exc, path, mesh)
        except UpstreamFailure:
            return _error_response(
                lib, UpstreamError("the worker could not be reached"), path, mesh
            )
        if isinstance(final, Answered):
            return self._answer(lib, final, view)
        exchange, lease = final.exchange, final.attempt.lease
        acct = mesh.account(view, lease, exchange.status)
        if self._whole(view, exchange.headers):
            try:
                body = b"".join([chunk async for chunk in exchange.chunks()])
            except UpstreamFailure:
                acct.abort(client_left=False)
                raise _cut_short(lib)() from None
            finally:
                await exchange.aclose()
            return self._settled(lib, exchange, acct, body)
        relay = Relay(view, acct, _cut_short(lib))
        return lib.Response(
            exchange.status,
            headers=response_headers(exchange.headers),
            stream=AsyncRelayStream(exchange, relay),
        )

    async def aclose(self) -> None:
        for up in self._upstreams.values():
            await up.aclose()
