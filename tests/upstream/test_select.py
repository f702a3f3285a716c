"""The one place a client is chosen: ``http://`` on the fast clients, ``https://`` (and,
async, any request off asyncio) on httpcore made on first use, everything through an
``inner`` transport when one is given."""

from __future__ import annotations

import asyncio
from typing import Any

import httpcore
import httpcore2
import httpx
import httpx2
import pytest

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Failure
from meshkit.testing.ports import free_port
from meshkit.upstream.base import AsyncUpstream, Request, UpstreamFailure
from meshkit.upstream.blocking import BlockingUpstream
from meshkit.upstream.fast import FastUpstream
from meshkit.upstream.httpcore_pools import HttpcoreUpstream
from meshkit.upstream.inner import InnerUpstream, library_of
from meshkit.upstream.select import async_upstream, sync_upstream
from upstreams import RawServer, attempt


def test_sync_http_on_sockets_https_on_httpcore_loaded_when_first_needed() -> None:
    with RawServer() as srv:
        up = sync_upstream(UpstreamConfig(connect_timeout_s=1.0), lib=httpx2)
        try:
            assert isinstance(up, BlockingUpstream)
            fallback = up._fallback
            assert isinstance(fallback, HttpcoreUpstream)
            ex = up.send(attempt(srv.url + "/x", b"{}"))
            assert b"".join(ex.chunks()) == b"ok"
            ex.close()
            assert fallback.core is None  # no https yet: no httpcore loaded, no pool
            with pytest.raises(UpstreamFailure) as info:
                up.send(attempt(f"https://127.0.0.1:{free_port()}/x", b"{}"))
            assert info.value.failure is Failure.CONNECT
            assert fallback.core is httpcore2
        finally:
            up.close()


def test_async_http_on_asyncio_https_on_httpcore_loaded_when_first_needed() -> None:
    async def go() -> Any:
        up = async_upstream(UpstreamConfig(connect_timeout_s=1.0))
        try:
            assert isinstance(up, FastUpstream)
            fallback = up._fallback
            assert isinstance(fallback, HttpcoreUpstream) and fallback.core is None
            with pytest.raises(UpstreamFailure) as info:
                await up.asend(attempt(f"https://127.0.0.1:{free_port()}/x", b"{}"))
            assert info.value.failure is Failure.CONNECT
            return fallback.core
        finally:
            await up.aclose()

    assert asyncio.run(go()) is httpcore  # the default


class _Answered(AsyncUpstream):
    """A fallback that answers without awaiting anything (no event loop needed)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def asend(self, request: Request) -> Any:
        self.sent.append(request.url)
        return "answered by the fallback"


def test_off_asyncio_every_request_goes_to_the_fallback() -> None:
    """Under another async library (trio) there is no running asyncio loop:
    ``asyncio.get_running_loop()`` raises, and the request goes to the fallback
    (httpcore, which runs on trio). Driven here by hand, with no loop at all."""
    fallback = _Answered()
    up = FastUpstream(UpstreamConfig(), fallback=fallback)
    coro = up.asend(attempt("http://127.0.0.1:9/x", b"{}"))
    with pytest.raises(StopIteration) as stop:
        coro.send(None)
    assert stop.value.value == "answered by the fallback"
    assert fallback.sent == ["http://127.0.0.1:9/x"]
    assert up._hub is None  # no pool was made


def test_https_without_a_fallback_cannot_be_reached() -> None:
    with pytest.raises(UpstreamFailure) as info:
        BlockingUpstream().send(attempt("https://127.0.0.1:9/x", b"{}"))
    assert info.value.failure is Failure.CONNECT


@pytest.mark.parametrize("lib", [httpx, httpx2], ids=["httpx", "httpx2"])
def test_an_inner_transport_sends_everything(lib: Any) -> None:
    seen: list[str] = []

    def handler(request: Any) -> Any:
        seen.append(str(request.url))
        return lib.Response(201, headers={"X-Kind": "mock"}, content=b"from the inner transport")

    up = sync_upstream(UpstreamConfig(), inner=lib.MockTransport(handler))
    assert isinstance(up, InnerUpstream) and up.lib is lib
    for url in ("http://w.example/v1/x?a=1", "https://w.example:8443/v1/y"):
        ex = up.send(attempt(url, b"{}"))
        assert (ex.status, ex.headers[0]) == (201, (b"x-kind", b"mock"))
        assert ex.read(1 << 10) == b"from the inner transport"
        ex.close()
    assert seen == ["http://w.example/v1/x?a=1", "https://w.example:8443/v1/y"]


def test_the_library_of_a_transport_subclass_is_its_bases() -> None:
    class Mine(httpx2.HTTPTransport):
        pass

    assert library_of(Mine()) == "httpx2"
    assert library_of(httpx.HTTPTransport()) == "httpx"
