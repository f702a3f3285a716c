"""
The mock worker's HTTP/1.1 server
=================================

A raw :class:`asyncio.Protocol` per connection, parsing with
``httptools.HttpRequestParser``: keep-alive, pipelining (answers stay in order),
``Content-Length`` and chunked request bodies, ``Expect: 100-continue``, chunked
streaming responses with write back-pressure. A ``HEAD`` request gets the head of
the answer its ``GET`` would get, never a body (RFC 9110 §9.3.2): stray body bytes
would be read as the start of the next response on that keep-alive connection.

Complete answers (:class:`bytes`) are written from inside the parser callback, with
no task and no await: that is the hot path. Delayed answers and streams run as one
task per connection; a client that goes away cancels it and counts in
``stats.disconnects``.

:meth:`MockWorker.kill` simulates a crash: the listening socket and every connection
close abruptly and the worker's volatile state (prefix cache, stored responses and
conversations, sleep state) is lost; :meth:`MockWorker.start` then binds the **same** port again.

With ``MockConfig.kv_events`` the worker also binds its KV-event sockets
(:mod:`meshkit.mock.kv_publisher`) on start and closes them on stop or kill. A kill
is an engine restart: the next start numbers batches from 0 again, with an empty
replay buffer and a new block-hash seed (nothing is published for the lost cache).
A stop and start keeps the sequence, the buffer and the cache.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl as ssl_module
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools

from meshkit.mock.app import MockApp
from meshkit.mock.config import MockConfig, MockStats
from meshkit.mock.wire import Delayed, Reply, Request, Stream, chunk, response

if TYPE_CHECKING:
    from meshkit.mock.kv_publisher import KvEventPublisher

__all__ = ["MockWorker"]

log = logging.getLogger(__name__)

_BAD_REQUEST = (
    b'{"error":{"message":"bad HTTP request","type":"invalid_request_error",'
    b'"param":null,"code":null}}'
)
_INTERNAL = (
    b'{"error":{"message":"mock worker error","type":"server_error","param":null,"code":null}}'
)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


def _head_only(reply: Reply) -> Reply:
    """The answer to a HEAD request: the head of ``reply``, without its body."""
    if isinstance(reply, Stream):
        return reply.head
    if isinstance(reply, Delayed):
        data = reply.data
        end = data.find(b"\r\n\r\n")
        head = data if end < 0 else data[: end + 4]
        return Delayed(reply.delay, head, reply.keep_alive, reply.before)
    end = reply.find(b"\r\n\r\n")
    return reply if end < 0 else reply[: end + 4]


class _Conn(asyncio.Protocol):
    """One client connection."""

    __slots__ = (
        "_aborted",
        "_app",
        "_body",
        "_busy",
        "_closed",
        "_drain",
        "_headers",
        "_loop",
        "_parser",
        "_pending",
        "_stats",
        "_task",
        "_transport",
        "_url",
        "_worker",
    )

    def __init__(self, worker: MockWorker) -> None:
        self._worker = worker
        self._app = worker.app
        self._stats = worker.stats
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._busy = False
        self._pending: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._aborted = False
        self._drain: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._worker._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._worker._conns.discard(self)
        task = self._task
        if task is not None and not task.done():
            if not self._aborted:
                self._stats.disconnects += 1
            task.cancel()
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            if self._transport is not None and not self._busy:
                self._transport.write(response(400, _BAD_REQUEST, self._app.headers, False))
            self.close()

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        self._wake_writer()

    def _wake_writer(self) -> None:
        waiter, self._drain = self._drain, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- httptools callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        if (
            len(name) == 6
            and name.lower() == b"expect"
            and value.lower() == b"100-continue"
            and self._transport is not None
            and not self._busy
        ):
            self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        req = Request(
            parser.get_method(),
            self._url,
            self._headers,
            b"".join(self._body),
            parser.should_keep_alive(),
        )
        if self._busy:
            self._pending.append(req)
        else:
            self._dispatch(req)

    # -- answering -----------------------------------------------------------------

    def close(self) -> None:
        """Close gracefully (buffered bytes are still sent)."""
        self._aborted = True
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Close abruptly (buffered bytes are dropped)."""
        self._aborted = True
        if self._transport is not None:
            self._transport.abort()

    def _dispatch(self, req: Request) -> None:
        transport = self._transport
        if transport is None or self._closed or transport.is_closing():
            return
        try:
            reply = self._app.handle(req)
        except Exception:
            log.exception("mock worker: error answering %r", req.path)
            reply = response(500, _INTERNAL, self._app.headers, False)
            req.keep_alive = False
        if req.method == b"HEAD":
            reply = _head_only(reply)
        if isinstance(reply, bytes):
            transport.write(reply)
            if not req.keep_alive:
                transport.close()
            return
        self._busy = True
        self._task = self._loop.create_task(self._run(reply))

    async def _run(self, reply: Delayed | Stream) -> None:
        stats = self._stats
        stats.in_flight += 1
        done = False
        try:
            if isinstance(reply, Delayed):
                try:
                    await asyncio.sleep(reply.delay)
                finally:
                    if reply.before is not None:
                        reply.before()
                if self._transport is not None and not self._closed:
                    self._transport.write(reply.data)
                    done = True
            else:
                done = await self._stream(reply)
        except asyncio.CancelledError:
            done = False
        finally:
            stats.in_flight -= 1
            self._task = None
            self._busy = False
        if not done or self._closed:
            return
        if not reply.keep_alive:
            self.close()
            return
        while self._pending and not self._busy and not self._closed:
            self._dispatch(self._pending.popleft())

    async def _stream(self, s: Stream) -> bool:
        """Write ``s``; ``False`` when the connection was crashed on purpose."""
        transport = self._transport
        assert transport is not None
        stats = self._stats
        stats.active_streams += 1
        try:
            transport.write(s.head)
            crash = s.crash_after
            if crash is not None and crash <= 0:
                await self._crash()
                return False
            buf: list[bytes] = []
            for sent, (delay, data) in enumerate(s.events, 1):
                if delay > 0.0:
                    if buf:
                        transport.write(b"".join(buf))
                        buf.clear()
                    if self._drain is not None:
                        await self._drain
                    await asyncio.sleep(delay)
                    if self._closed:
                        return False
                buf.append(chunk(data))
                if crash is not None and sent >= crash:
                    transport.write(b"".join(buf))
                    await self._crash()
                    return False
            buf.append(_LAST_CHUNK)
            transport.write(b"".join(buf))
            return True
        finally:
            stats.active_streams -= 1

    async def _crash(self) -> None:
        transport = self._transport
        assert transport is not None
        self._stats.crashes += 1
        self._aborted = True
        for _ in range(200):
            if self._closed or transport.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.005)
        self.abort()


class MockWorker:
    """An OpenAI + Anthropic + Responses + SGLang-compatible mock inference worker.

    Start and stop it inside a running event loop::

        worker = MockWorker(MockConfig(name="w1"))
        await worker.start()
        ...  # worker.url, worker.stats
        await worker.stop()
    """

    def __init__(
        self,
        config: MockConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        """:param ssl: a server context: the worker speaks ``https://``."""
        self.config = config if config is not None else MockConfig()
        self.host = host
        self.port = port
        self.ssl = ssl
        self.stats = MockStats()
        self.app = MockApp(self.config, self.stats)
        self._server: asyncio.AbstractServer | None = None
        # after kill(): the port, bound and not listening (see hold_port)
        self._held: socket.socket | None = None
        self._conns: set[_Conn] = set()
        self._kv: KvEventPublisher | None = None
        cfg = self.config
        if cfg.kv_events is not None:
            from meshkit.mock.kv_publisher import KvEventPublisher

            self._kv = KvEventPublisher(
                cfg.kv_events,
                replay=cfg.kv_replay,
                topic=cfg.kv_topic,
                fmt=cfg.kv_events_format,
                buffer=cfg.kv_replay_buffer,
                stats=self.stats,
            )
            if self.app.cache is not None:
                self.app.cache.events = self._kv.publish

    @property
    def url(self) -> str:
        """``http(s)://host:port`` (the bound port once started)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl else 'http'}://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def kv_events_endpoint(self) -> str | None:
        """The KV-event PUB endpoint (the one bound, once started), or ``None``."""
        return None if self._kv is None else self._kv.endpoint

    @property
    def kv_replay_endpoint(self) -> str | None:
        """The KV-event replay ROUTER endpoint (bound, once started), or ``None``."""
        return None if self._kv is None else self._kv.replay_endpoint

    @property
    def kv_publisher(self) -> KvEventPublisher | None:
        return self._kv

    async def start(self) -> None:
        """Bind and listen (again on the same port after :meth:`kill` or :meth:`stop`)."""
        if self._server is not None:
            raise RuntimeError("mock worker already running")
        self._release_port()
        loop = asyncio.get_running_loop()
        if self._kv is not None:
            await self._kv.open()
        try:
            await self._listen(loop)
        except BaseException:
            if self._kv is not None:
                self._kv.close()
            raise

    async def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        server: asyncio.Server | None = None
        for attempt in range(100):
            try:
                server = await loop.create_server(
                    lambda: _Conn(self),
                    self.host,
                    self.port,
                    reuse_address=True,
                    backlog=1024,
                    ssl=self.ssl,
                )
                break
            except OSError as exc:
                # A just-closed listening socket can linger for a loop iteration.
                if exc.errno != errno.EADDRINUSE or self.port == 0 or attempt == 99:
                    raise
                await asyncio.sleep(0.02)
        assert server is not None
        self._server = server
        self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and close every connection (in-flight answers are dropped)."""
        self._release_port()
        server, self._server = self._server, None
        if server is None:
            return
        if self._kv is not None:
            self._kv.close()
        server.close()
        for conn in list(self._conns):
            conn.close()
        await server.wait_closed()
        await asyncio.sleep(0)

    def kill(self) -> None:
        """Simulate a crash: close the listener and abort every connection, drop state."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self._conns):
            conn.abort()
        if self._kv is not None:
            self._kv.close()  # first: a crash publishes nothing
            self._kv.reset()
        self.app.reset_state()

    def hold_port(self) -> None:
        """Keep a killed worker's port bound, not listening, until it starts again.

        Connecting is then refused, as to a crashed engine, and no other server on
        the machine (another pytest-xdist worker's) can be given the freed port and
        answer in its place, or take it before a restart. Call it once the
        listener has closed (a loop iteration after :meth:`kill`); best effort.
        """
        if self._server is not None or self._held is not None or not self.port:
            return
        # Without SO_REUSEADDR first: only then may no other socket bind the port
        # (two sockets that both set it may share a port neither listens on). A
        # connection of the old listener in TIME_WAIT refuses that; then with it.
        for reuse in (False, True):
            held = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
            if reuse:
                held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                held.bind((self.host, self.port))
            except OSError:
                held.close()
                continue
            self._held = held
            return

    def _release_port(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()

    async def __aenter__(self) -> MockWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
