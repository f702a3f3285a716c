"""
Worker addresses for Envoy
==========================

Envoy's ORIGINAL_DST cluster takes the destination as an ``IP:port`` literal: a
worker configured by host name is looked up here (the system resolver), and the
answer kept ``extproc.resolve_ttl_s`` in a cache of at most
``extproc.resolve_max`` names, so a request costs no lookup.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict

__all__ = ["EndpointResolver", "endpoint"]


def endpoint(ip: str, port: int) -> str:
    """``IP:port`` as Envoy parses it (``[v6]:port``)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class EndpointResolver:
    """``await resolver(host, port)`` → ``"IP:port"``; raises OSError when the name
    does not resolve (in ``timeout_s``)."""

    def __init__(self, *, ttl_s: float, max_entries: int, timeout_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max(1, max_entries)
        self.timeout_s = timeout_s
        self._cache: OrderedDict[str, tuple[float, str]] = OrderedDict()

    async def __call__(self, host: str, port: int) -> str:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            return endpoint(host, port)
        now = time.monotonic()
        hit = self._cache.get(host)
        if hit is not None and hit[0] > now:
            return endpoint(hit[1], port)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise OSError(f"looking up {host} timed out") from None
        ip = str(infos[0][4][0])
        self._cache[host] = (now + self.ttl_s, ip)
        self._cache.move_to_end(host)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return endpoint(ip, port)
