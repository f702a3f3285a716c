"""
The Python floor: the least a uvloop + httptools proxy can do per request
=========================================================================

``MESHBENCH_WORKERS=... python benchmarks/frontends/floor_proxy.py --port 8000``

Not a router and not meshkit: a measuring stick for issue 21's per-core target. It
does only what no HTTP/1.1 proxy in CPython can skip: parse the request with
httptools, pick the next worker (round robin), write the head and body to a pooled
keep-alive connection, parse the response with httptools and write it back. No
JSON, no bounds, no accounting, no error handling beyond dropping a broken
connection. What meshkit spends per request above this frontend's CPU is the
routing and its guarantees; what this frontend spends against vllm-router's is
the cost of the interpreter and its event loop themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
from collections import deque
from urllib.parse import urlsplit

import httptools
import uvloop


class Upstream(asyncio.Protocol):
    """One keep-alive connection to a worker; one request at a time."""

    def __init__(self, pool: deque[Upstream]) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.headers: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None:
            self.client.failed()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.headers = []
        self.body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append(b"%s: %s\r\n" % (name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        status = self.parser.get_status_code()
        head = b"HTTP/1.1 %d OK\r\n%s\r\n" % (status, b"".join(self.headers))
        self.pool.append(self)
        if client is not None:
            client.answer(head, self.body)


class Client(asyncio.Protocol):
    """One client connection."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() != b"host":
            self.headers.append(b"%s: %s\r\n" % (name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        self.proxy.send(self, method, self.url, self.headers, self.body)

    def answer(self, head: bytes, body: list[bytes]) -> None:
        if self.transport is not None:
            self.transport.writelines([head, *body])

    def failed(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Proxy:
    def __init__(self, loop: asyncio.AbstractEventLoop, workers: list[str]) -> None:
        self.loop = loop
        self.workers: list[tuple[str, int, bytes, deque[Upstream]]] = []
        for url in workers:
            parts = urlsplit(url)
            host = parts.hostname or "127.0.0.1"
            port = parts.port or 80
            self.workers.append((host, port, b"host: %s:%d\r\n" % (host.encode(), port), deque()))
        self.next = itertools.cycle(range(len(self.workers)))

    def send(
        self, client: Client, method: bytes, url: bytes, headers: list[bytes], body: list[bytes]
    ) -> None:
        host, port, host_line, pool = self.workers[next(self.next)]
        head = b"%s %s HTTP/1.1\r\n%s%s\r\n" % (method, url, host_line, b"".join(headers))
        if pool:
            up = pool.pop()
            up.client = client
            assert up.transport is not None
            up.transport.writelines([head, *body])
            return
        self.loop.create_task(self._connect(client, host, port, pool, [head, *body]))

    async def _connect(
        self, client: Client, host: str, port: int, pool: deque[Upstream], data: list[bytes]
    ) -> None:
        try:
            transport, up = await self.loop.create_connection(lambda: Upstream(pool), host, port)
        except OSError:
            client.failed()
            return
        up.client = client
        transport.writelines(data)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ns = ap.parse_args()
    loop = asyncio.get_running_loop()
    proxy = Proxy(loop, os.environ["MESHBENCH_WORKERS"].split(","))
    server = await loop.create_server(lambda: Client(proxy), ns.host, ns.port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main())
