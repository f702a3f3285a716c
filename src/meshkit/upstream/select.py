"""
Choosing the client
===================

The one place that decides which client sends a request. Every front end (the
ASGI and WSGI middleware, the client transports, the gateway) and the lifecycle
probes get their upstream here:

* ``http://`` workers: the fast clients, :class:`~meshkit.upstream.blocking.BlockingUpstream`
  (threads) and :class:`~meshkit.upstream.fast.FastUpstream` (asyncio);
* ``https://`` workers, and, async, every request under an event loop that is not
  asyncio's (trio): :class:`~meshkit.upstream.httpcore_pools.HttpcoreUpstream`,
  the httpcore of ``lib`` (httpx: ``httpcore``, httpx2: ``httpcore2``), which
  imports it on its first request;
* an ``inner`` transport given: every request through it
  (:class:`~meshkit.upstream.inner.InnerUpstream`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from meshkit.config import UpstreamConfig
from meshkit.upstream.base import AsyncUpstream, SyncUpstream
from meshkit.upstream.blocking import BlockingUpstream
from meshkit.upstream.fast import FastUpstream
from meshkit.upstream.httpcore_pools import HttpcoreUpstream
from meshkit.upstream.inner import InnerUpstream

__all__ = ["async_upstream", "sync_upstream"]


def sync_upstream(
    config: UpstreamConfig, *, inner: Any = None, lib: ModuleType | None = None
) -> SyncUpstream:
    """The upstream for threads (see the module documentation)."""
    if inner is not None:
        return InnerUpstream(inner, config)
    return BlockingUpstream(config, fallback=HttpcoreUpstream(config, lib))


def async_upstream(
    config: UpstreamConfig, *, inner: Any = None, lib: ModuleType | None = None
) -> AsyncUpstream:
    """The upstream for an event loop (see the module documentation)."""
    if inner is not None:
        return InnerUpstream(inner, config)
    return FastUpstream(config, fallback=HttpcoreUpstream(config, lib))
