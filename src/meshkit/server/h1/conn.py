"""
The built-in HTTP/1.1 server's connection
=========================================

``meshkit serve`` answers on :class:`H1Conn`, an ``asyncio.Protocol`` fed by
``httptools`` (uvicorn's parser), instead of uvicorn's ASGI layer: a request
meshkit routes goes straight to a :class:`~meshkit.frontends.routed.Routed` whose
downstream is this connection, so a response head is one ``bytes`` written
together with the first body chunk, and no ASGI message, scope or disconnect
watcher task is built per request (``benchmarks/RESULTS.md``: uvicorn was about a
quarter of a proxied request's samples). Every other path (``/health``,
``/metrics``, ``/workers``) goes to the gateway's ASGI app through a small bridge
(:mod:`meshkit.server.h1.bridge`).

Per connection: one request runs at a time; pipelined requests queue behind it
(``server.max_pipelined`` of them, or bodies over ``bounds.max_body_bytes`` in
all, then reading pauses). What one read of the socket holds is parsed whole, so
a request completed after the pause, in the same read, is not queued: it is
answered 503 ``unavailable`` in turn and the connection closes after it, unread
(RFC 9112 §9.3.2: a client retries the requests a closed connection left
unanswered). A connection holds at most ``max_pipelined`` + 2 requests, however
many a client writes at once. Bounds are those of every mode
(``bounds.max_header_bytes`` and ``bounds.max_headers`` while the head arrives:
431; ``bounds.max_body_bytes`` on the declared length and while the body arrives:
413, and the connection closes without reading the rest). A client that closes
its connection cancels its request at once (the prepare job, the upstream
request, the lease). Idle connections close after ``server.keep_alive_s``
(:class:`~meshkit.server.h1.server.H1Server` sweeps them).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Final, cast

import httptools
from mypy_extensions import mypyc_attr

from meshkit.core.endpoints import Match, shape_for_path
from meshkit.core.requests import declared_over, head_error
from meshkit.core.unbound import lower
from meshkit.errors import (
    HeadersTooLarge,
    InvalidRequest,
    MeshError,
    Unavailable,
    body_over,
)
from meshkit.frontends.routed import Headers, Routed, error_reply
from meshkit.http1 import LAST_CHUNK, Framing, chunk, date_header, response_head
from meshkit.inline import CURRENT, Inline, at_once, in_task
from meshkit.server.h1.bridge import INTERNAL

if TYPE_CHECKING:
    from meshkit.server.h1.server import H1Server

__all__ = ["H1Conn", "Request"]

log = logging.getLogger("meshkit.server")
access_log = logging.getLogger("meshkit.access")

_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


class Request:
    """A request read off the connection (a plain class: see ``core.forward.Attempt``)."""

    __slots__ = (
        "body",
        "headers",
        "http11",
        "keep_alive",
        "match",
        "method",
        "path",
        "query",
        "raw_path",
        "refusal",
        "shape",
    )

    def __init__(
        self,
        method: str,
        path: str,
        raw_path: bytes,
        query: bytes,
        headers: Headers,
        body: bytes,
        http11: bool,
        keep_alive: bool,
        match: Match | None,
        refusal: MeshError | None = None,
        shape: Any = "openai",
    ) -> None:
        self.method = method
        self.path = path
        self.raw_path = raw_path
        self.query = query
        self.headers = headers
        self.body = body
        self.http11 = http11
        self.keep_alive = keep_alive
        self.match = match
        #: answered with this error instead of being run (a bound, a bad request line)
        self.refusal = refusal
        #: the API shape of that error
        self.shape = shape


class _Refused(Exception):
    def __init__(self, error: MeshError) -> None:
        self.error = error


# Subclassed by the h1 fuzz tests to count what each connection took in; a
# compiled build (hatch_build.py) allows it for this class only.
@mypyc_attr(allow_interpreted_subclasses=True)
class H1Conn(asyncio.Protocol):
    """One client connection of the built-in server."""

    def __init__(self, server: H1Server) -> None:
        self.server = server
        self.loop = server.loop
        self.mesh = server.mesh
        bounds = server.mesh.config.bounds
        self.max_head = bounds.max_header_bytes
        self.max_headers = bounds.max_headers
        self.max_body = bounds.max_body_bytes
        self.max_pipelined = server.max_pipelined
        # The server's settings every request reads, copied: the server is an
        # interpreted object, whose attributes are looked up at each read.
        self.upstream = server.upstream
        self.inline = server.inline
        self.log_access = server.access_log
        self.parser = parser = httptools.HttpRequestParser(self)
        # Bound once: a call through the parser (or the loop, both compiled
        # elsewhere) looks its method up on every request.
        self._feed = parser.feed_data
        self._get_method = parser.get_method
        self._keeps_alive = parser.should_keep_alive
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.closed = False
        #: the server's sweep tick when bytes last arrived (idle connections close)
        self.seen = server.tick
        # the request being parsed
        self._url = b""
        self._headers: Headers = []
        self._size = 0
        self._count = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._match: Match | None = None
        # the request line, split once when the head is complete
        self._method = ""
        self._path = ""
        self._raw_path = b""
        self._query = b""
        self._refused = False  # stop parsing: an answer and a close are on their way
        # The head has a Connection (or Proxy-Connection) field: only then may a
        # request that keeps the connection be HTTP/1.0 (on_message_complete).
        self._connection_field = False
        # The request being parsed asked for a 100 while another ran: it is sent
        # when the connection turns idle (its client waits for it to send the body).
        self._continue = False
        # Bytes received since the head being parsed began: httptools buffers a
        # header line whole before any callback, so a line that never ends is only
        # seen here. Bounded like a head of endless lines (on_header).
        self._in_head = True
        self._head_bytes = 0
        self._framing_bytes = 0
        self._head_limit = 2 * self.max_head + 65536
        # the request being answered, and those parsed behind it
        self.queue: deque[Request] = deque()
        #: what answers a request (None when idle): the connection's runner
        self.task: Inline | None = None
        # One runner per connection answers its requests in turn (one per request
        # costs more than waking one); it idles, parked, between them (_idle). It
        # is stepped here, where the request arrives (meshkit.inline), until a
        # request hands it to a Task: then a new one takes the requests after it.
        self._runner: Inline | None = None
        self._idle = False
        # while data_received parses: a runner to step once it is done
        self._reading = False
        self._woken: Inline | None = None
        self.routed: Routed | None = None
        self.req: Request | None = None
        self.framing = Framing.LENGTH
        self.keep_alive = True
        self.pending = b""  # a response head waiting for its first body bytes
        self.remaining = 0  # body bytes the head announced, not yet written (LENGTH)
        self.status = 0
        self.read_paused = False
        self.queued_bytes = 0  # bodies of the queued requests
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = self.transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.client = f"{peer[0]}:{peer[1]}"
        if not self.server.attach(self):
            self._refuse(Unavailable("the gateway is at server.max_connections"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.detach(self)
        if self.task is not None and not self.task.done():
            if self.routed is not None:
                self.routed.client_left = True
            self.task.cancel()
        runner = self._runner
        if self._idle and runner is not None:
            self._idle = False
            runner.give(None)  # the idle runner ends
            runner.wake()
        self._wake_writer()

    def eof_received(self) -> bool | None:
        return None  # close: a client that half-closes has left

    def data_received(self, data: bytes) -> None:
        self.seen = self.server.tick
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        else:
            # What is not body: chunk framing and the trailer section, which
            # httptools keeps whole until its line ends (an endless one grew).
            self._framing_bytes += len(data)
        self._reading = True
        try:
            self._parse(data)
        finally:
            self._reading = False
        woken = self._woken
        if woken is not None:
            # The request parsed from these bytes runs now, not on the loop's next turn.
            self._woken = None
            woken.step()

    def _parse(self, data: bytes) -> None:
        try:
            self._feed(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                self._refuse(cause.error)
            else:
                log.error("unexpected error while reading a request", exc_info=cause)
                self._refuse(InvalidRequest("the request could not be read"))
        except httptools.HttpParserUpgrade:
            self._upgrade_asked()
        except httptools.HttpParserError:
            self._refuse(InvalidRequest("malformed HTTP request"))
        else:
            if self._in_head:
                if self._head_bytes > self._head_limit:
                    self._refuse(self._head_error())
            elif self._framing_bytes > self._head_limit + self._body_size:
                self._refuse(
                    HeadersTooLarge(
                        "the request's chunk framing and trailer fields are over "
                        f"{self._head_limit} bytes more than its body"
                    )
                )

    def _upgrade_asked(self) -> None:
        """The request just parsed asks for a protocol upgrade (or is a CONNECT).

        It is complete and queued (or started, its task not yet run): it is
        answered as HTTP/1.1 (a server may ignore Upgrade, RFC 9110 §7.8), then the
        connection closes, as what follows it is not HTTP/1.1. httptools reads
        the bytes after such a head as the new protocol's, never as a body: a
        request that announced one is refused rather than run without it.
        """
        self._refused = True
        req = self.queue[-1] if self.queue else self.req
        if req is None:  # pragma: no cover - on_message_complete always queued it
            return
        req.keep_alive = False
        if req is self.req:
            self.keep_alive = False
        if req.refusal is None and any(
            name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
            for name, value in req.headers
        ):
            req.refusal = InvalidRequest("a request asking for an Upgrade cannot have a body")
            req.shape = shape_for_path(req.path)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    # -- httptools callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._size = 0
        self._count = 0
        self._body = []
        self._body_size = 0
        self._match = None
        self._connection_field = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.max_head:
            raise _Refused(HeadersTooLarge(f"the request target is over {self.max_head} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._size += len(name) + len(value) + 4
        self._count += 1
        if self._size <= self.max_head and self._count <= self.max_headers:
            self._headers.append((lower(name), value))
        elif self._size > self._head_limit:
            # A head that never ends: refuse with what was measured so far.
            raise _Refused(self._head_error())
        # Over a bound: count on without keeping, so the refusal states the sizes
        # of the whole head (as in every other mode) once it is complete.

    def _head_error(self) -> MeshError:
        error = head_error(
            self._count, self._size, max_bytes=self.max_head, max_count=self.max_headers
        )
        return error or HeadersTooLarge(f"the request head is over {self._head_limit} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._size > self.max_head or self._count > self.max_headers:
            raise _Refused(self._head_error())
        url = self._url
        if url[:1] != b"/":  # absolute-form or asterisk-form
            try:
                parsed = httptools.parse_url(url)
            except httptools.HttpParserInvalidURLError:
                raise _Refused(InvalidRequest("malformed request target")) from None
            # None when absent, whatever httptools' stubs say (a compiled build
            # checks the declared type: read them as what they are).
            given: bytes | None = getattr(parsed, "path", None)
            query: bytes | None = getattr(parsed, "query", None)
            url = (given or b"/") + (b"?" + query if query else b"")
            self._url = url
        raw_path, _, self._query = url.partition(b"?")
        self._raw_path = raw_path
        self._path = path = raw_path.decode("latin-1")
        self._method = method = self._get_method().decode("latin-1")
        try:
            self._match = self.mesh.resolve(method, path)
        except MeshError as exc:
            raise _Refused(exc) from None
        expect = False
        for name, value in self._headers:
            if name == b"content-length":
                if declared_over(value, self.max_body):
                    raise _Refused(body_over(self.max_body))
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
            elif name == b"connection" or name == b"proxy-connection":
                self._connection_field = True
        if expect and self.transport is not None:
            if not self.queue and self.task is None:
                self.transport.write(_CONTINUE)
            else:
                self._continue = True  # after the requests before it (_finish)

    def on_chunk_header(self) -> None:
        # Called for chunked bodies only (the others pay nothing); acts once per
        # request, on its first chunk: the head is complete and within bounds.
        if self._size > self.max_head:
            return
        for name, value in self._headers:
            if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
                # httptools frames "gzip, chunked" as chunked but does not decode
                # gzip; a coding list is also how framing disagreements between a
                # proxy in front and this server begin (request smuggling).
                raise _Refused(InvalidRequest("only the chunked transfer coding is supported"))
        # Trailer fields after the last chunk are counted against the head bounds
        # but never kept: they would be merged into the head after a proxy in
        # front checked it (RFC 9110 §6.5.1). on_header keeps nothing past max_head.
        self._size = self.max_head + 1

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        self._framing_bytes -= len(body)
        if self._body_size > self.max_body:
            # Checked while the body streams in, before it is all buffered.
            raise _Refused(body_over(self.max_body))
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.read_paused:
            # Parsed from the read that filled the queue: refused rather than held
            # (a read of tiny requests would otherwise queue thousands).
            raise _Refused(Unavailable(self._over_pipelined()))
        self._in_head = True
        self._continue = False  # its body came without the 100
        self._head_bytes = 0
        self._framing_bytes = 0
        parts = self._body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        parser = self.parser
        keep_alive = self._keeps_alive()
        # llhttp keeps an HTTP/1.0 connection only when a Connection or
        # Proxy-Connection field asks to: without one, a kept connection is
        # HTTP/1.1 and its version need not be asked (get_http_version formats a
        # str: ~1.5 % of a proxied request's CPU).
        http11 = (keep_alive and not self._connection_field) or parser.get_http_version() == "1.1"
        req = Request(
            method=self._method,
            path=self._path,
            raw_path=self._raw_path,
            query=self._query,
            headers=self._headers,
            body=body,
            http11=http11,
            keep_alive=keep_alive,
            match=self._match,
        )
        self._body = []
        self._enqueue(req)

    # -- running requests ---------------------------------------------------------

    def _refuse(self, error: MeshError) -> None:
        """Answer ``error`` in turn, then close: the rest of the input is not read."""
        self._refused = True
        req = Request(
            # the head's method, once parsed: a refused HEAD is answered without a body
            method="" if self._in_head else self._method,
            path="",
            raw_path=b"",
            query=b"",
            headers=[],
            body=b"",
            http11=True,
            keep_alive=False,
            match=None,
            refusal=error,
            shape=shape_for_path(self._url.partition(b"?")[0].decode("latin-1")),
        )
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        if self.task is None:
            self._start(req)
            return
        self.queue.append(req)
        self.queued_bytes += len(req.body)
        if self._queue_full() and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def _queue_full(self) -> bool:
        # By count and by bytes: 16 queued bodies of max_body_bytes each would be
        # 16 x 32 MiB held for one connection.
        return len(self.queue) >= self.max_pipelined or self.queued_bytes > self.max_body

    def _over_pipelined(self) -> str:
        if len(self.queue) >= self.max_pipelined:
            bound = f"more than server.max_pipelined ({self.max_pipelined}) requests"
        else:
            bound = f"request bodies over bounds.max_body_bytes ({self.max_body})"
        return (
            f"{bound} were pipelined behind the one running; "
            "the connection closes after this answer"
        )

    def _start(self, req: Request) -> None:
        self.req = req
        self.keep_alive = req.keep_alive and not self.server.draining
        self.pending = b""
        self.status = 0
        runner = self._runner
        if runner is None:
            runner = self._runner = Inline(self.loop, self._serve(req))
            self._go(runner)
        elif self._idle:
            self._idle = False
            runner.give(req)
            self._go(runner)
        # else: _finish started a pipelined request; the runner takes it next
        self.task = runner

    def _go(self, runner: Inline) -> None:
        if self._reading and at_once(0):  # the request is not running yet
            self._woken = runner  # data_received steps it when its parse is done
        else:
            runner.wake()

    async def _serve(self, req: Request | None) -> None:
        runner = self._runner
        try:
            while req is not None:
                await self._run(req)
                req = self.req  # the pipelined request _finish started, if any
                if req is None:
                    if self.closed or runner is None or CURRENT.inline is not runner:
                        # Handed to a Task (or closing): the next request starts a
                        # new runner, stepped inline again.
                        return
                    self._idle = True
                    req = await runner
        finally:
            if self._runner is runner:
                self._runner = None
            self._idle = False

    async def _run(self, req: Request) -> None:
        CURRENT.busy += 1
        try:
            if req.refusal is not None:
                await self.whole(*error_reply(self.mesh, req.refusal, req.shape))
            elif req.match is None:
                await in_task()  # the gateway's ASGI app, as an ASGI server runs it
                await self.server.bridge(self, req)
            else:
                if not self.inline:
                    await in_task()
                routed = self.routed = Routed(self.mesh, self.upstream, req.match, self)
                await routed.run(req.method, req.body, req.headers, req.query.decode("latin-1"))
        except asyncio.CancelledError:
            self.keep_alive = False  # shutdown: no pipelined request starts after this one
            if not self.closed:
                raise
        except Exception:
            log.exception("unexpected error while answering a request")
            self.keep_alive = False
            if (self.status == 0 or self.pending) and not self.closed:
                # Nothing of the answer was written yet (a head may wait in pending).
                self.pending = b""
                await self.whole(500, [(b"content-type", b"application/json")], INTERNAL)
        finally:
            CURRENT.busy -= 1
            self._finish(req)

    def _finish(self, req: Request) -> None:
        self.task = None
        self.routed = None
        self.req = None
        if self.log_access and req.refusal is None:
            access_log.info(
                '%s - "%s %s HTTP/%s" %d',
                self.client,
                req.method,
                req.path,
                "1.1" if req.http11 else "1.0",
                self.status,
            )
        if self.closed:
            return
        if not self.keep_alive:
            self.close()
            return
        if self.queue:
            nxt = self.queue.popleft()
            self.queued_bytes -= len(nxt.body)
            self._start(nxt)
        elif self._continue and self.transport is not None:
            # The request behind waited for its 100 until this one was answered.
            self._continue = False
            self.transport.write(_CONTINUE)
        if self.read_paused and not self._queue_full() and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Close once the written bytes are flushed (asyncio's ``close``)."""
        if self.transport is not None and not self.closed:
            self.transport.close()
            self.closed = True

    @property
    def idle(self) -> bool:
        return self.task is None

    # -- Downstream (meshkit.frontends.routed) ------------------------------------

    async def start(self, status: int, headers: Headers) -> None:
        req = self.req
        assert req is not None
        self.status = status
        headers.append((b"date", date_header()))
        self.pending, self.framing, self.keep_alive, self.remaining = response_head(
            status,
            headers,
            keep_alive=self.keep_alive,
            http11=req.http11,
            bodyless=req.method == "HEAD",
        )

    async def body(self, data: bytes) -> None:
        if not data or self.closed:
            return
        transport = self.transport
        assert transport is not None
        if self.framing == Framing.CHUNKED:
            data = chunk(data)
        else:
            if len(data) > self.remaining and self.framing == Framing.LENGTH:
                # More than the head declared (or any body on a 204): what follows
                # would be read as the next response. Cut, and close after it.
                self.keep_alive = False
                data = data[: max(self.remaining, 0)]
            self.remaining -= len(data)
        if self.pending:
            transport.writelines((self.pending, data))
            self.pending = b""
        else:
            transport.write(data)
        if self.write_paused:
            await self._drain()

    async def end(self, data: bytes = b"") -> None:
        if self.closed:
            return
        transport = self.transport
        assert transport is not None
        out = [self.pending] if self.pending else []
        self.pending = b""
        framing = self.framing
        if framing == Framing.CHUNKED:
            if data:
                out.append(chunk(data))
            out.append(LAST_CHUNK)
        else:
            if framing == Framing.LENGTH and self.remaining != len(data):
                # A body shorter or longer than its content-length (a worker that
                # died half-way, an app that stopped early): only closing can say so.
                self.keep_alive = False
                data = data[: max(self.remaining, 0)]
            if data:
                out.append(data)
        if out:
            transport.writelines(out)
        if self.framing == Framing.CLOSE:
            self.keep_alive = False
        if self.write_paused:
            # The next pipelined request starts after this one: not before the
            # client read this answer (one that never reads would grow the buffer).
            await self._drain()

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        if self.closed:
            return
        transport = self.transport
        assert transport is not None
        req = self.req
        http11 = req.http11 if req is not None else True
        headers.append((b"date", date_header()))
        self.status = status
        head, _, self.keep_alive, _ = response_head(
            status, headers, keep_alive=self.keep_alive, http11=http11, length=len(body)
        )
        if req is not None and req.method == "HEAD":
            transport.write(head)
        else:
            transport.writelines((head, body))
        if self.write_paused:
            await self._drain()  # as in end()

    async def _drain(self) -> None:
        while self.write_paused and not self.closed:
            self._drained = self.loop.create_future()
            await self._drained

    def _wake_writer(self) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
