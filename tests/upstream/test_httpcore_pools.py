"""The httpcore client: requests built from attempts, and every client's bounded
cache of them (the wire behaviour is the contract's, ``test_contract.py``)."""

from __future__ import annotations

import asyncio

import httpx2

from meshkit.config import UpstreamConfig
from meshkit.upstream.blocking import BlockingUpstream
from meshkit.upstream.fast import FastUpstream
from meshkit.upstream.httpcore_pools import HttpcoreUpstream
from upstreams import attempt


def test_the_request_names_the_worker_and_keeps_path_and_query() -> None:
    up = HttpcoreUpstream(UpstreamConfig(), lib=httpx2)
    try:
        req = up._prepared(attempt("http://[::1]:8001/v1/completions?x=1", b"{}"))
        assert req.url.scheme == b"http" and req.url.port == 8001
        assert req.url.target == b"/v1/completions?x=1"
        assert req.headers[0] == (b"host", b"[::1]:8001")
        assert (b"content-length", b"2") in req.headers
        bare = up._prepared(attempt("https://w.example/v1/models", method="GET", headers=[]))
        assert bare.url.scheme == b"https" and bare.url.port == 443
        assert bare.headers == [(b"host", b"w.example")]
    finally:
        up.close()


def test_the_url_cache_is_bounded() -> None:
    up = HttpcoreUpstream(UpstreamConfig(max_cached_urls=8))
    try:
        for i in range(20):
            up._prepared(attempt(f"http://127.0.0.1:8001/v1/completions?i={i}", b"{}"))
            assert len(up._urls) <= 8
        again = up._prepared(attempt("http://127.0.0.1:8001/v1/completions?i=3", b"{}"))
        assert again.url.target == b"/v1/completions?i=3"
    finally:
        up.close()


def test_the_fast_clients_url_caches_are_bounded_too() -> None:
    """``upstream.max_cached_urls`` bounds the request lines the fast clients keep
    (the query is the client's: it must not grow a cache without end)."""
    config = UpstreamConfig(max_cached_urls=8)
    blocking = BlockingUpstream(config)
    fast = FastUpstream(config)
    loop = asyncio.new_event_loop()
    try:
        hub = fast._bind(loop)
        for i in range(20):
            url = f"http://127.0.0.1:8001/v1/completions?i={i}"
            assert b" /v1/completions?i=%d HTTP/1.1\r\n" % i in blocking._route(url)[1]
            assert fast._route(url, hub)[1] == blocking._route(url)[1]
            assert len(blocking._routes) <= 8 and len(fast._routes) <= 8
        assert len(fast._routes) > 1  # it was filled, then started over
    finally:
        blocking.close()
        loop.close()
