"""The httpcore client: requests built from attempts (the wire behaviour is the
contract's, ``test_contract.py``)."""

from __future__ import annotations

import httpx2

from meshkit.config import UpstreamConfig
from meshkit.upstream.base import MAX_URLS
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
    up = HttpcoreUpstream(UpstreamConfig())
    try:
        for i in range(MAX_URLS + 10):
            up._prepared(attempt(f"http://127.0.0.1:8001/v1/completions?i={i}", b"{}"))
            assert len(up._urls) <= MAX_URLS
        again = up._prepared(attempt("http://127.0.0.1:8001/v1/completions?i=3", b"{}"))
        assert again.url.target == b"/v1/completions?i=3"
    finally:
        up.close()
