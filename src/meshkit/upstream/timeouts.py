"""
A client's own timeouts
=======================

A client transport's request carries its library's ``timeout`` extension (the
SDK's ``timeout=``, or the client's default). Its attempts are bound by the tighter
of it and ``[upstream]``'s: ``[upstream]`` stays the operator's bound, a client can
only shorten it. :func:`client_timeouts` turns the extension into the
:class:`~meshkit.core.requests.Timeouts` every attempt of the request carries, once
per request; None when the client's are no tighter (the common case: the clients
then read one attribute and go on as before).

* ``connect``: the smaller of the client's ``connect`` and ``pool``, against
  ``connect_timeout_s``, which bounds the wait for a pooled connection and the
  connect together in meshkit's clients (httpcore gets it for both too);
* ``read`` and ``write``: against ``read_timeout_s``, meshkit's bound on both;
* a value that is None or ``<= 0`` is unbounded on that side.

The transports also hold the prepare pool's wait and work to ``connect``
(:meth:`~meshkit.prepare.pool.PreparePool.submit`'s ``within_s``): a wait before
any worker, as the wait for a pooled connection is.

A bound of the client's that fires is the client giving up, as it would on a
direct connection: the upstream clients raise :class:`ClientTimeout`, not
:class:`~meshkit.upstream.base.UpstreamFailure`. The flow then abandons the lease
(no verdict: an impatient client must not open a healthy worker's breaker), never
moves the request, and the transport raises its library's ``ConnectTimeout``,
``ReadTimeout`` or ``WriteTimeout``. A pool wait that runs out stays
``Failure.POOL`` (the worker is busy: another may take the request).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshkit.config import UpstreamConfig
from meshkit.core.forward import Failure
from meshkit.core.requests import ClientTimeout, Timeouts
from meshkit.upstream.base import UpstreamFailure

__all__ = ["ClientTimeout", "broken", "client_timeouts", "connect_bound", "silent", "timed_out"]


def _bound(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _tighter(client: float | None, operator: float) -> float | None:
    """``client`` when it is tighter than ``operator`` (``<= 0``: unbounded)."""
    if client is None or (operator > 0 and client >= operator):
        return None
    return client


def client_timeouts(config: UpstreamConfig, ext: Mapping[str, Any]) -> Timeouts | None:
    """The bounds a request with the ``timeout`` extension ``ext`` carries; None
    when ``[upstream]``'s are as tight on every side."""
    connect, pool = _bound(ext.get("connect")), _bound(ext.get("pool"))
    if connect is None or (pool is not None and pool < connect):
        connect = pool
    op_connect, op_read = config.connect_timeout_s, config.read_timeout_s
    mine_connect = _tighter(connect, op_connect)
    mine_read = _tighter(_bound(ext.get("read")), op_read)
    mine_write = _tighter(_bound(ext.get("write")), op_read)
    if mine_connect is None and mine_read is None and mine_write is None:
        return None
    default_connect = op_connect if op_connect > 0 else None
    default_read = op_read if op_read > 0 else None
    c = default_connect if mine_connect is None else mine_connect
    r = default_read if mine_read is None else mine_read
    w = default_read if mine_write is None else mine_write
    timeout = {"connect": c, "pool": c, "read": r, "write": w}
    return Timeouts(mine_connect, mine_read, mine_write, {"timeout": timeout})


def connect_bound(config: UpstreamConfig, bounds: Timeouts | None) -> tuple[float, bool]:
    """The bound on the wait for a connection and the connect (``<= 0``: none), and
    whether it is the client's own."""
    mine = None if bounds is None else bounds.connect
    return (config.connect_timeout_s, False) if mine is None else (mine, True)


def silent(client_bound: bool) -> Exception:
    """What a body the worker left silent past a read bound raises: past the
    client's own bound (``client_bound``) the client gave up, else the worker timed
    out (every upstream client decides it here)."""
    return ClientTimeout("read") if client_bound else UpstreamFailure(Failure.TIMEOUT)


#: httpcore's and httpx's timeout classes -> the phase they time
_PHASES = {"ConnectTimeout": "connect", "ReadTimeout": "read", "WriteTimeout": "write"}


def timed_out(exc: BaseException, bounds: Timeouts) -> ClientTimeout | None:
    """``exc`` (an httpcore or httpx error) as the client's own timeout, when it is
    one and that phase was bound by the client (else None: map it as usual)."""
    phase = _PHASES.get(type(exc).__name__)
    if phase is None or getattr(bounds, phase) is None:
        return None
    return ClientTimeout(phase)


def broken(exc: BaseException, bounds: Timeouts | None) -> Exception:
    """What a body that failed with ``exc`` (an httpcore or httpx error) raises: the
    worker's silence past a read bound is a timeout (the client's own, or
    ``Failure.TIMEOUT``), anything else ``Failure.PROTOCOL``."""
    if type(exc).__name__ != "ReadTimeout":
        return UpstreamFailure(Failure.PROTOCOL)
    return silent(bounds is not None and bounds.read is not None)
