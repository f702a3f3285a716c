"""The client transports' httpcore upstream: requests built from attempts."""

from __future__ import annotations

import httpcore2

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Attempt
from meshkit.core.workers import Fleet, Worker
from meshkit.upstream.httpcore_pools import MAX_URLS, CoreUpstream


def _attempt(url: str, body: bytes = b"{}", method: str = "POST") -> Attempt:
    fleet = Fleet([Worker("http://127.0.0.1:9")])
    cand = fleet.candidates_of(fleet.workers[0])[0]
    return Attempt(
        number=0,
        candidate=cand,
        lease=None,  # type: ignore[arg-type]
        method=method,
        url=url,
        headers=[(b"content-type", b"application/json")],
        body=body,
    )


def test_the_request_names_the_worker_and_keeps_path_and_query() -> None:
    up = CoreUpstream(httpcore2, UpstreamConfig())
    try:
        req = up._request(_attempt("http://[::1]:8001/v1/completions?x=1"))
        assert req.url.scheme == b"http" and req.url.port == 8001
        assert req.url.target == b"/v1/completions?x=1"
        assert req.headers[0] == (b"host", b"[::1]:8001")
        assert (b"content-length", b"2") in req.headers
        bare = up._request(_attempt("http://w.example/v1/models", b"", "GET"))
        assert bare.headers[0] == (b"host", b"w.example")
        assert not any(k == b"content-length" for k, _ in bare.headers)
    finally:
        up.close()


def test_the_url_cache_is_bounded() -> None:
    up = CoreUpstream(httpcore2, UpstreamConfig())
    try:
        for i in range(MAX_URLS + 10):
            up._request(_attempt(f"http://127.0.0.1:8001/v1/completions?i={i}"))
            assert len(up._urls) <= MAX_URLS
        again = up._request(_attempt("http://127.0.0.1:8001/v1/completions?i=3"))
        assert again.url.target == b"/v1/completions?i=3"
    finally:
        up.close()
