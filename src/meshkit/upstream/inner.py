"""
Requests through a user's httpx transport
=========================================

:class:`InnerUpstream` sends every request through an httpx or httpx2 transport
the user gave (the client transports' ``inner=``, the WSGI middleware's
``transport=``): the two libraries share the transport contract
(``handle_request`` / ``handle_async_request``) with httpcore's pools, so the
send loops, the failure mapping and the exchanges are
:class:`~meshkit.upstream.httpcore_pools.HttpcoreUpstream`'s. What differs is the
request (an ``httpx.Request``, which adds ``Host`` itself) and the response
(``status_code``, ``headers.raw``).

A request the transport refuses to send (``LocalProtocolError``: a header value
with surrounding whitespace, say) is the client's 400, as in every client. Its
``timeout`` extension is httpcore's: ``[upstream]``'s, or the client's own where
tighter (:mod:`~meshkit.upstream.timeouts`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from meshkit.config import UpstreamConfig
from meshkit.upstream.base import Request, check_request, content_length, errors_of
from meshkit.upstream.httpcore_pools import HttpcoreUpstream, _lower, timeouts

__all__ = ["InnerUpstream", "library_of"]


def library_of(transport: Any) -> str:
    """``"httpx"`` or ``"httpx2"``: the library ``transport``'s class comes from
    (a subclass defined elsewhere is its base's)."""
    for cls in type(transport).__mro__:
        root = cls.__module__.split(".", 1)[0]
        if root in ("httpx", "httpx2"):
            return root
    return "httpx"


class InnerUpstream(HttpcoreUpstream):
    """Every request through ``transport`` (sync, async, or both)."""

    def __init__(self, transport: Any, config: UpstreamConfig | None = None) -> None:
        self.config = config = config or UpstreamConfig()
        self.lib: ModuleType = importlib.import_module(library_of(transport))
        self.transport = self._pool = self._apool = transport
        self._extensions = {"timeout": timeouts(config)}
        self._errors = errors_of(self.lib)

    def _request(self, request: Request) -> Any:
        check_request(request)
        body = request.body
        size = content_length(request.method, body)
        headers = request.headers
        if size is not None:
            # Stated here: httpx states no length for an empty body of a method
            # other than POST, PUT and PATCH.
            headers = [*headers, (b"content-length", b"%d" % size)]
        bounds = request.timeout
        return self.lib.Request(
            request.method,
            request.url,
            headers=headers,
            content=body if size is not None else None,
            extensions=self._extensions if bounds is None else bounds.extensions,
        )

    @staticmethod
    def _head(resp: Any) -> tuple[int, list[tuple[bytes, bytes]]]:
        return resp.status_code, _lower(resp.headers.raw)

    def close(self) -> None:
        self.transport.close()

    async def aclose(self) -> None:
        await self.transport.aclose()
