"""
WSGI middleware
===============

.. code-block:: python

    flask_app.wsgi_app = MeshWSGIMiddleware(flask_app.wsgi_app, mesh=mesh)

Inference paths are routed; every other request goes to the wrapped app. The
request head is checked against ``bounds.max_header_bytes`` and
``bounds.max_headers`` (431), then the body is read in bounded pieces through
werkzeug's input stream (413 past ``bounds.max_body_bytes``, checked while
reading; a body that ends before its ``Content-Length`` is a 400, the client is
gone anyway). Upstream requests carry ``upstream.connect_timeout_s`` and
``read_timeout_s`` (a stalled worker is a 504). The upstream is
:func:`~meshkit.upstream.select.sync_upstream`'s (pooled keep-alive sockets,
httpcore for https; a ``transport=`` given, that one). The response is an
iterable relayed chunk by chunk; its ``close()`` — which every WSGI server calls,
also when the client went away — settles accounting and releases the worker.

Security: the path used for routing is the raw request target when the server
provides it (``RAW_URI``/``REQUEST_URI``), else PATH_INFO re-quoted; the path
forwarded is always rebuilt from the endpoint registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote, urlsplit

from werkzeug.exceptions import ClientDisconnected, RequestEntityTooLarge
from werkzeug.wsgi import get_input_stream

from meshkit.core.credentials import served_headers
from meshkit.core.endpoints import shape_for_path
from meshkit.core.relay import Relay
from meshkit.core.requests import check_head
from meshkit.errors import InvalidRequest, MeshError, UpstreamError, body_over
from meshkit.frontends.relay import SyncRelayStream
from meshkit.http1 import status_line
from meshkit.mesh import Mesh
from meshkit.upstream.drive import Answered, UpstreamFailure, drive_sync, read_body
from meshkit.upstream.select import sync_upstream

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["MeshWSGIMiddleware"]


def _status_line(status: int) -> str:
    """``"200 OK"``: the status line's code and reason (cached there)."""
    return status_line(status)[9:-2].decode("latin-1")


def _str_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]


def _raw_path(environ: WSGIEnvironment) -> str:
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if raw:
        if not raw.startswith("/"):
            raw = urlsplit(raw).path or "/"
        return str(raw).split("?", 1)[0]
    script = environ.get("SCRIPT_NAME", "")
    info = environ.get("PATH_INFO", "")
    return quote((script + info).encode("latin-1"), safe="/:@!$&'()*+,;=-._~")


def _client_headers(environ: WSGIEnvironment) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    for key, value in environ.items():
        if key.startswith("HTTP_"):
            name = key[5:].replace("_", "-").lower()
        elif key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            name = key.replace("_", "-").lower()
        else:
            continue
        if value:
            out.append((name.encode("latin-1"), str(value).encode("latin-1")))
    return out


#: bodies are read in pieces of at most this size (never one buffer of the bound)
_READ_SIZE: Final = 64 * 1024


def _read_body(environ: WSGIEnvironment, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is over ``limit`` bytes."""
    try:
        # limit + 1: werkzeug refuses a read *after* a streamed body reached its
        # maximum, which would refuse a body of exactly ``limit`` bytes.
        stream = get_input_stream(environ, max_content_length=limit + 1)
        return read_body(iter(lambda: stream.read(_READ_SIZE), b""), limit)
    except RequestEntityTooLarge:
        raise body_over(limit) from None
    except ClientDisconnected:
        raise InvalidRequest("the request body ended before its Content-Length") from None


def _whole(
    start_response: StartResponse, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes
) -> Iterable[bytes]:
    """A response meshkit built, of known length."""
    out = _str_headers(headers)
    out.append(("Content-Length", str(len(body))))
    start_response(_status_line(status), out)
    return [body]


class MeshWSGIMiddleware:
    """Routes inference requests of a WSGI app to a fleet of workers.

    :param app: the wrapped WSGI application.
    :param mesh: the :class:`~meshkit.Mesh`; ``Mesh.from_env()`` when omitted.
    :param transport: an httpx/httpx2 sync transport to send every request through
        (default: meshkit's own connections).
    """

    def __init__(
        self, app: WSGIApplication, mesh: Mesh | None = None, *, transport: Any = None
    ) -> None:
        self.app = app
        self.mesh = mesh if mesh is not None else Mesh.from_env()
        self.upstream = sync_upstream(self.mesh.config.upstream, inner=transport)

    def _error(self, start_response: StartResponse, exc: MeshError, path: str) -> Iterable[bytes]:
        self.mesh.reject(exc)
        return _whole(start_response, exc.status, exc.headers(), exc.body(shape_for_path(path)))

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        mesh = self.mesh
        path = _raw_path(environ)
        method = environ.get("REQUEST_METHOD", "GET").upper()
        try:
            match = mesh.resolve(method, path)
        except MeshError as exc:
            return self._error(start_response, exc, path)
        if match is None:
            return self.app(environ, start_response)
        headers = _client_headers(environ)
        bounds = mesh.config.bounds
        try:
            check_head(headers, max_bytes=bounds.max_header_bytes, max_count=bounds.max_headers)
            body = b""
            if match.endpoint.has_body:
                body = _read_body(environ, bounds.max_body_bytes)
            view = mesh.prepare(match, body, headers, environ.get("QUERY_STRING", ""))
            flow = mesh.forward(view, headers, method)
            final = drive_sync(flow, self.upstream.send, mesh.legs)
        except MeshError as exc:
            return self._error(start_response, exc, path)
        except UpstreamFailure:
            unreachable = UpstreamError("the worker could not be reached")
            return self._error(start_response, unreachable, path)
        if isinstance(final, Answered):
            local = final.local
            mesh.account_local(view, final.attempt, local)
            return _whole(start_response, local.status, local.headers, local.body)
        exchange = final.exchange
        lease = final.attempt.lease
        acct = mesh.account(view, lease, exchange.status)
        start_response(
            _status_line(exchange.status),
            _str_headers(served_headers(exchange.headers, exchange.status)),
        )
        return SyncRelayStream(exchange, Relay(acct, view))

    def close(self) -> None:
        self.upstream.close()
