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

Timeouts: each attempt is bound by the tighter of the request's own (its library's
``timeout`` extension: the SDK's ``timeout=``, or the client's default) and
``[upstream]``'s (``connect_timeout_s``, ``read_timeout_s``), which stay the
operator's bound: a client can only shorten them
(:mod:`meshkit.upstream.timeouts`; writes are bound by the request's ``write``,
held against ``read_timeout_s`` as well). Either bound that runs out raises the
library's own ``ReadTimeout`` (``ConnectTimeout``, ``WriteTimeout`` for the
client's connect and write bounds), before the response or from its body, as a
direct connection would (the openai SDK raises ``APITimeoutError`` and applies
its retry rules). Past ``[upstream]``'s bound the worker is blamed (a breaker
failure, counted as an ``upstream_timeout`` rejection); past the client's own, the
client gave up: the lease goes back without a verdict, as when a client leaves.
A connect that fails (``[upstream]``'s bound included) moves the request to
another worker; a pool wait that runs out is still 503 ``overloaded``.

Bounds: an inference request's head is checked against ``bounds.max_header_bytes``
and ``bounds.max_headers`` (431); a body is read from the request's stream piece
by piece and refused (413) as soon as it is over ``bounds.max_body_bytes``, or at
once when its ``Content-Length`` says so.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import httpx

from meshkit.config import BoundsConfig
from meshkit.core.credentials import response_headers
from meshkit.core.endpoints import shape_for_path
from meshkit.core.forward import Failure
from meshkit.core.relay import Relay
from meshkit.core.requests import RequestView, Timeouts, declared_over, head_error
from meshkit.errors import MeshError, UpstreamError, UpstreamTimeout, body_over
from meshkit.frontends.relay import NO_BOOKS, AsyncRelayStream, SyncRelayStream
from meshkit.mesh import Mesh
from meshkit.types import Headers
from meshkit.upstream.drive import (
    BODY,
    CLOSE,
    PREPARE,
    READ,
    SEND,
    Answered,
    Steps,
    UpstreamFailure,
    flow_steps,
    run_async,
    run_sync,
)
from meshkit.upstream.inner import library_of
from meshkit.upstream.select import async_upstream, sync_upstream
from meshkit.upstream.timeouts import ClientTimeout, client_timeouts

try:  # httpx2 is a dependency; keep the module importable if a user removed it
    import httpx2
except ImportError:  # pragma: no cover
    httpx2 = None  # type: ignore[assignment]

__all__ = ["AsyncMeshTransport", "MeshTransport"]

_TIMEOUT = Failure.TIMEOUT


def _both(name: str) -> tuple[type, ...]:
    """The class ``name`` of httpx and of httpx2 (each library checks its own)."""
    return (getattr(httpx, name),) + ((getattr(httpx2, name),) if httpx2 else ())


class _SyncStream(SyncRelayStream, *_both("SyncByteStream")):  # type: ignore[misc]
    """A relayed body as both libraries' sync byte stream."""


class _AsyncStream(AsyncRelayStream, *_both("AsyncByteStream")):  # type: ignore[misc]
    """A relayed body as both libraries' async byte stream."""


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


def _head(request: Any, inference: bool, bounds: BoundsConfig) -> Headers:
    """The request's headers as a server would hand them on, in one pass.

    Values lose the optional whitespace around them (RFC 9110 §5.5; h11 refuses
    to send it). An inference request's head is held to the header bounds (431,
    measured on the raw lines as every mode does), and any request whose
    ``Content-Length`` is over ``bounds.max_body_bytes`` is refused (413) before
    its body is read.
    """
    out: Headers = []
    size = 0
    declared: bytes | None = None
    for k, v in request.headers.raw:
        size += len(k) + len(v) + 4
        if declared is None and len(k) == 14 and k.lower() == b"content-length":
            declared = v
        out.append((k, v.strip(b" \t")))
    if inference:
        error = head_error(
            len(out), size, max_bytes=bounds.max_header_bytes, max_count=bounds.max_headers
        )
        if error is not None:
            raise error
    if declared is not None and declared_over(declared, bounds.max_body_bytes):
        raise body_over(bounds.max_body_bytes)
    return out


def _held(lib: ModuleType, request: Any, limit: int) -> bytes | None:
    """The body, when the client library holds it in memory already (``content=``)."""
    try:
        body = request.content
    except lib.RequestNotRead:  # a streamed body: read piece by piece
        return None
    if not isinstance(body, bytes):
        return None
    if len(body) > limit:
        raise body_over(limit)
    return body


def _cut_short(lib: ModuleType) -> Callable[[], BaseException]:
    """What a body the worker cut short raises in the client (as a direct connection)."""
    return lambda: lib.RemoteProtocolError("the worker closed the connection mid-response")


_PHASES = {
    "connect": "ConnectTimeout",
    "read": "ReadTimeout",
    "write": "WriteTimeout",
    "pool": "PoolTimeout",
}


def _timed_out(lib: ModuleType, phase: str = "read") -> BaseException:
    """What a bound that ran out raises in the client (as a direct connection)."""
    what = "the wait to prepare the request" if phase == "pool" else f"the worker's {phase}"
    exc: BaseException = getattr(lib, _PHASES[phase])(f"{what} timed out")
    return exc


_RAISERS: dict[str, tuple[Callable[[], BaseException], Callable[[], BaseException]]] = {}


def _raisers(lib: ModuleType) -> tuple[Callable[[], BaseException], Callable[[], BaseException]]:
    """What a relayed body raises when the worker cut it short, or went silent."""
    got = _RAISERS.get(lib.__name__)
    if got is None:
        got = _RAISERS[lib.__name__] = (_cut_short(lib), lambda: _timed_out(lib))
    return got


def _bytes_response(lib: ModuleType, status: int, headers: Headers, body: bytes) -> Any:
    """A response meshkit built, streamable like one from the network.

    ``Response(content=...)`` would mark the stream consumed at once, and a client
    reading it with ``client.stream(...)`` / ``iter_raw()`` would get
    ``StreamConsumed`` instead of the body.
    """
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return lib.Response(status, headers=headers, stream=lib.ByteStream(body))


def _whole(view: RequestView, headers: Headers, limit: int) -> bool:
    """Whether to read the worker's body before answering: a whole (not streamed)
    body whose ``Content-Length`` is within what accounting parses anyway.

    Read at once, it is accounted before the client gets the response (the books
    close first), and the response carries it in memory: no relay stream for the
    client library to drive (~10 µs of a client's ~400 µs per request).
    """
    if view.stream:
        return False
    for k, v in headers:
        if len(k) == 14 and k.lower() == b"content-length":
            return v.isdigit() and int(v) <= limit
    return False


class _Common:
    """What both transports do: one request's steps, driven by each one's loop."""

    #: the byte stream a relayed body is handed over as
    _stream: type[SyncRelayStream] | type[AsyncRelayStream]

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
        #: a request's (connect, read, write, pool) timeouts -> the bounds it carries
        self._bounds: dict[tuple[Any, ...], Timeouts | None] = {}

    def _timeouts(self, request: Any) -> Timeouts | None:
        """The request's own bounds (its ``timeout`` extension), where tighter than
        ``[upstream]``'s: made once per distinct extension, then looked up."""
        ext = request.extensions.get("timeout")
        if not ext:
            return None
        key = (ext.get("connect"), ext.get("read"), ext.get("write"), ext.get("pool"))
        try:
            return self._bounds[key]
        except KeyError:
            pass
        bounds = client_timeouts(self.mesh.config.upstream, ext)
        if len(self._bounds) >= self.mesh.config.upstream.max_cached_timeouts:
            self._bounds.clear()
        self._bounds[key] = bounds
        return bounds

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

    def _steps(self, request: Any, lib: ModuleType, timeouts: Timeouts | None) -> Steps[Any]:
        """One client request, start to response, as the operations of
        :mod:`meshkit.upstream.drive`; ``timeouts``: its own."""
        mesh = self.mesh
        bounds = mesh.config.bounds
        path, query = _split(request)
        try:
            match = mesh.resolve(request.method, path)
            headers = _head(request, match is not None, bounds)
            body = _held(lib, request, bounds.max_body_bytes)
            if body is None:
                body = yield (BODY, (request.stream, bounds.max_body_bytes))
            if match is None:  # not ours: to a healthy worker, as it is
                attempt = mesh.pass_through(request.method, path, query, headers, body)
                attempt.timeout = timeouts
                plain = yield (SEND, attempt)
                return self._relayed(lib, plain, Relay(NO_BOOKS, None))
            # The client's bound on waiting for a connection bounds waiting for the
            # prepare pool too: both are waits for a resource before any worker.
            within = timeouts.connect if timeouts is not None else None
            view = yield (PREPARE, (mesh, match, body, headers, query, within))
            view.timeout = timeouts
            final = yield from flow_steps(mesh.forward(view, headers, request.method))
        except UpstreamTimeout as exc:
            mesh.reject(exc)
            raise _timed_out(lib) from None
        except MeshError as exc:
            return self._refused(lib, exc, path)
        except UpstreamFailure as exc:
            if exc.failure is _TIMEOUT:  # a passed-through request's worker
                mesh.reject(UpstreamTimeout("the worker did not answer in time"))
                raise _timed_out(lib) from None
            return self._refused(lib, UpstreamError("the worker could not be reached"), path)
        if isinstance(final, Answered):
            local = final.local
            mesh.account_local(view, final.attempt, local)
            return _bytes_response(lib, local.status, list(local.headers), local.body)
        exchange = final.exchange
        relay = Relay(mesh.account(view, final.attempt.lease, exchange.status), view)
        if not _whole(view, exchange.headers, bounds.max_sse_line_bytes):
            return self._relayed(lib, exchange, relay)
        # Read whole: the books close before the client holds the response.
        try:
            data = exchange.whole()
            if data is None:
                data = yield (READ, (exchange, bounds.max_sse_line_bytes))
        except UpstreamFailure as exc:
            relay.fail()
            raise (_timed_out(lib) if exc.failure is _TIMEOUT else _cut_short(lib)()) from None
        except BaseException:
            relay.close()  # cancelled mid-read: the client left; the lease goes back
            raise
        finally:
            yield (CLOSE, exchange)
        data = relay.whole(data)
        relay.end()
        headers = response_headers(exchange.headers)
        return lib.Response(exchange.status, headers=headers, stream=lib.ByteStream(data))

    def _refused(self, lib: ModuleType, exc: MeshError, path: str) -> Any:
        self.mesh.reject(exc)
        return _bytes_response(lib, exc.status, exc.headers(), exc.body(shape_for_path(path)))

    def _relayed(self, lib: ModuleType, exchange: Any, relay: Relay) -> Any:
        stream = self._stream(exchange, relay, *_raisers(lib))
        return lib.Response(
            exchange.status, headers=response_headers(exchange.headers), stream=stream
        )


class MeshTransport(_Common, *_both("BaseTransport")):  # type: ignore[misc]
    """A sync transport for ``httpx.Client`` and ``httpx2.Client``.

    :param mesh: the :class:`~meshkit.Mesh` (``Mesh.from_env()`` when omitted).
    :param inner: an httpx/httpx2 transport that talks to workers for the requests
        of its library; by default meshkit's own connections.
    """

    _stream = _SyncStream

    def __init__(self, mesh: Mesh | None = None, *, inner: Any = None) -> None:
        _Common.__init__(self, mesh, inner)

    def handle_request(self, request: Any) -> Any:
        lib = _lib_of(request)
        send = self._upstream(lib, sync_upstream).send
        steps = self._steps(request, lib, self._timeouts(request))
        try:
            return run_sync(steps, send, self.mesh.legs)
        except ClientTimeout as exc:
            raise _timed_out(lib, exc.phase) from None

    def close(self) -> None:
        for up in self._upstreams.values():
            up.close()


class AsyncMeshTransport(_Common, *_both("AsyncBaseTransport")):  # type: ignore[misc]
    """An async transport for ``httpx.AsyncClient`` and ``httpx2.AsyncClient``."""

    _stream = _AsyncStream

    def __init__(self, mesh: Mesh | None = None, *, inner: Any = None) -> None:
        _Common.__init__(self, mesh, inner)

    async def handle_async_request(self, request: Any) -> Any:
        lib = _lib_of(request)
        send = self._upstream(lib, async_upstream).asend
        steps = self._steps(request, lib, self._timeouts(request))
        try:
            return await run_async(steps, send)
        except ClientTimeout as exc:
            raise _timed_out(lib, exc.phase) from None

    async def aclose(self) -> None:
        for up in self._upstreams.values():
            await up.aclose()
