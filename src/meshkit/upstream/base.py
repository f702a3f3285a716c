"""
The upstream contract
=====================

An upstream sends one request (method, URL, headers, body) to a worker and gives
back its response as an *exchange*: the head at once, the body as it arrives. The
shape is httpx's transport base, one method with sync and async twins:
:class:`SyncUpstream` (``send``/``close``) and :class:`AsyncUpstream`
(``asend``/``aclose``). Every client (:mod:`~meshkit.upstream.fast`,
:mod:`~meshkit.upstream.blocking`, :mod:`~meshkit.upstream.httpcore_pools`,
:mod:`~meshkit.upstream.inner`) implements it, and :mod:`~meshkit.upstream.select`
picks one, so what follows is written here once and every client behaves alike:

* **Failures** before a response head raise :class:`UpstreamFailure` with the
  flow's :class:`~meshkit.core.forward.Failure`, mapped by :func:`failure` from
  one table: httpcore, httpcore2, httpx and httpx2 share their exception class
  names (httpx's ``map_httpcore_exceptions`` relies on it too), and the fast
  clients' outcome codes (:data:`HEAD_RESET`, ...) are keys of the same table.
  From ``chunks()`` (after the head) the worker's silence past the read timeout
  is ``Failure.TIMEOUT``, any other failure ``Failure.PROTOCOL``.
* **A client's own timeouts** (``request.timeout``, set by the client transports
  where tighter than ``[upstream]``'s) bound the attempt instead; one that fires
  raises :class:`~meshkit.upstream.timeouts.ClientTimeout`.
* **Resend once**: a connection closed or reset before any response byte is most
  often a pooled keep-alive the worker was closing as the request arrived
  (SGLang closes idle ones after 5 s), a request it never applied, which RFC 9112
  §9.3.1 lets a client retry. Sent on a connection that was (or, for httpcore
  and httpx, which cannot tell, may have been) pooled, the request goes once more
  on a new connection; a second time, or on a connection known to be new, it is
  ``Failure.CONNECT``, which the flow may move to another worker.
* **A request without content** states no ``content-length`` when its method
  anticipates none (:data:`~meshkit.http1.NO_CONTENT`, RFC 9110 §8.6), else
  ``content-length: 0``: :func:`content_length`.
* **A request that cannot be sent as valid HTTP** (CR or LF in a header or the
  target, a method that is not a token) is the client's fault: the 400
  :func:`unsendable`, in every client, before anything is sent; never a worker
  failure.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol, TypeVar

from meshkit.core.forward import Failure
from meshkit.errors import InvalidRequest
from meshkit.http1 import NO_CONTENT, Unsendable, build_head, http_origin

if TYPE_CHECKING:
    from meshkit.core.requests import Timeouts
    from meshkit.core.workers import Tls

__all__ = [
    "AsyncExchange",
    "AsyncUpstream",
    "Call",
    "Request",
    "SyncExchange",
    "SyncUpstream",
    "UpstreamFailure",
    "aread_upto",
    "read_upto",
]

Headers = list[tuple[bytes, bytes]]
T = TypeVar("T")


class Request(Protocol):
    """What an upstream sends (:class:`~meshkit.core.forward.Attempt` is one)."""

    @property
    def method(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def headers(self) -> Headers: ...

    @property
    def body(self) -> bytes: ...

    @property
    def timeout(self) -> Timeouts | None:
        """The client's own timeouts (None: ``[upstream]``'s)."""


class Call(NamedTuple):
    """A :class:`Request` of meshkit's own (a probe, a sibling's question), not a
    client's: the flow's requests are :class:`~meshkit.core.forward.Attempt`."""

    method: str
    url: str
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    tls: Tls | None = None
    timeout: Timeouts | None = None


class UpstreamFailure(Exception):
    """The attempt failed before (or, from ``chunks``, during) the response body."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.value)
        self.failure = failure


class SyncExchange(Protocol):
    """A response: ``status`` and ``headers`` (names lower-cased, in the order
    received) at once, the body from ``chunks()`` (or bounded, ``read``)."""

    status: int
    headers: Headers

    def chunks(self) -> Iterator[bytes]: ...

    def read(self, limit: int) -> bytes: ...

    def whole(self) -> bytes | None:
        """The entire body when it already ended with its head, else None (then
        read it from ``chunks()``); an exchange that cannot know returns None."""

    def close(self) -> None:
        """Done with it: a body that did not end closes its connection (the
        worker sees the client leave); an ended one may return it to a pool."""


class AsyncExchange(Protocol):
    """:class:`SyncExchange` for async clients."""

    status: int
    headers: Headers

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self, limit: int) -> bytes: ...

    def whole(self) -> bytes | None: ...

    async def aclose(self) -> None: ...


class SyncUpstream:
    """Sends requests to workers from threads."""

    __slots__ = ()

    def send(self, request: Request) -> SyncExchange:
        """The response head of ``request``; raises :class:`UpstreamFailure` (or the
        400 :func:`unsendable`) before one."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the connections (busy ones when their exchange ends)."""

    def __enter__(self) -> SyncUpstream:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncUpstream:
    """Sends requests to workers from an event loop."""

    __slots__ = ()

    async def asend(self, request: Request) -> AsyncExchange:
        """:meth:`SyncUpstream.send`, awaited."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close the connections."""

    async def __aenter__(self) -> AsyncUpstream:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def read_upto(chunks: Iterable[bytes], limit: int) -> bytes:
    """At most ``limit`` bytes of a body (error and listing bodies are bounded)."""
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        if len(buf) >= limit:
            break
    return bytes(buf[:limit])


async def aread_upto(chunks: AsyncIterable[bytes], limit: int) -> bytes:
    """:func:`read_upto` for an async body."""
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) >= limit:
            break
    return bytes(buf[:limit])


# -- the rules every client follows ------------------------------------------------------


def unsendable() -> InvalidRequest:
    """The 400 for a request that cannot be sent as valid HTTP."""
    return InvalidRequest("the request's headers or query cannot be sent as valid HTTP")


def content_length(method: str, body: bytes) -> int | None:
    """The ``content-length`` a request states; None: none at all (an empty body of
    a method that anticipates no content). :func:`meshkit.http1.build_head`, the
    fast clients' head, applies the same rule."""
    return len(body) if body or method not in NO_CONTENT else None


def check_request(request: Request) -> None:
    """Raise :func:`unsendable` for what the fast clients refuse to write, for the
    clients whose library would open a connection before it refuses, if it does."""
    try:
        build_head(request.method, b"", request.headers, 0)
    except Unsendable:
        raise unsendable() from None


def remember(cache: dict[str, T], url: str, parsed: T, limit: int) -> T:
    """``cache[url] = parsed``, the cache cleared first when it holds ``limit``
    (``upstream.max_cached_urls``: workers come and go, queries are the client's)."""
    if len(cache) >= limit:
        cache.clear()
    cache[url] = parsed
    return parsed


def http_origin_of(url: str) -> tuple[str, str, int, bytes] | None:
    """:func:`meshkit.http1.http_origin` for the fast clients: a URL that cannot be
    sent is the 400, one that names no http(s) worker ``Failure.CONNECT``."""
    try:
        return http_origin(url)
    except ValueError as exc:
        raise error_of(exc) from None


#: closed or reset before any response byte: see the resend-once rule
_RESET = "reset"
#: cannot be sent as valid HTTP: the client's 400
_INVALID = "invalid"

# How the fast clients' wait for a response head ended (ints: compared on their
# hot path); each but HEAD_OK is a key of _KINDS.
HEAD_OK: Final = 0
HEAD_RESET: Final = 1
HEAD_TIMEOUT: Final = 2
HEAD_PROTOCOL: Final = 3

#: what each failure is: by exception class name (the most specific in the MRO
#: wins: ReadTimeout is a TimeoutException, PoolTimeout one too but listed), or
#: by a fast client's outcome code
_KINDS: dict[str | int, Failure | str] = {
    "PoolTimeout": Failure.POOL,  # nothing was sent: the worker is busy, not failing
    "ConnectTimeout": Failure.CONNECT,
    "ConnectError": Failure.CONNECT,
    "TimeoutException": Failure.TIMEOUT,  # read or write: the worker may be working
    "RemoteProtocolError": _RESET,
    "ReadError": _RESET,
    "WriteError": _RESET,
    "LocalProtocolError": _INVALID,
    "InvalidURL": _INVALID,
    "UnicodeEncodeError": _INVALID,
    "Unsendable": _INVALID,
    # any other (network, proxy, unsupported scheme, no worker in the URL): CONNECT
    HEAD_RESET: _RESET,
    HEAD_TIMEOUT: Failure.TIMEOUT,
    HEAD_PROTOCOL: Failure.PROTOCOL,  # bytes came back, not a response
}

#: the exception bases of httpcore and httpx whose members _KINDS maps
_BASES = (
    "TransportError",
    "TimeoutException",
    "NetworkError",
    "ProtocolError",
    "ProxyError",
    "UnsupportedProtocol",
    "InvalidURL",
)


def errors_of(lib: ModuleType) -> tuple[type[BaseException], ...]:
    """The exceptions a client of ``lib`` (httpcore, httpcore2, httpx, httpx2)
    maps with :func:`failure`: the library's transport errors, and a header that
    is not Latin-1."""
    return (*{getattr(lib, name) for name in _BASES if hasattr(lib, name)}, UnicodeEncodeError)


def failure(cause: BaseException | int, *, fresh: bool) -> Exception | None:
    """What a request raises when ``cause`` (an exception of :func:`errors_of`, a
    ``ValueError`` of :mod:`meshkit.http1`, or a fast client's outcome code) ended
    it before a response head; None: send it once more, on a new connection (the
    resend-once rule). ``fresh``: the connection was known to be new, or this was
    the resend already."""
    kind = _kind(cause)
    return None if kind is _RESET and not fresh else _error(kind)


def error_of(cause: BaseException | int) -> Exception:
    """:func:`failure` with no resend left."""
    return _error(_kind(cause))


def _kind(cause: BaseException | int) -> Failure | str:
    if isinstance(cause, int):
        return _KINDS[cause]
    if _tls_failure(cause):
        return Failure.TLS
    for cls in type(cause).__mro__:
        kind = _KINDS.get(cls.__name__)
        if kind is not None:
            return kind
    return Failure.CONNECT


def _tls_failure(exc: BaseException) -> bool:
    """httpcore wraps a failed handshake in its ``ConnectError``; the ``ssl`` error
    is in the chain (an ``SSLCertVerificationError``, or the peer's alert)."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, ssl.SSLError):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def _error(kind: Failure | str) -> Exception:
    if kind is _RESET:
        return UpstreamFailure(Failure.CONNECT)
    if kind is _INVALID:
        return unsendable()
    assert isinstance(kind, Failure)
    return UpstreamFailure(kind)
