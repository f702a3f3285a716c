"""
Driving a flow
==============

The forward and fan-out flows (:mod:`meshkit.core.forward`) yield attempts and
receive results. These two drivers, one async and one sync, are the only loops
that run them; each front end supplies a ``send`` that performs one attempt (its
upstream's ``send``/``asend``, :mod:`meshkit.upstream.base`) and returns an
exchange (status, headers, body access).

A response stays open until the flow either moves on (the driver closes it) or
returns its attempt (the caller relays it). When the attempt asked for its body
(``read_body``), the driver reads it (bounded) and hands it to the flow; the
caller then relays those captured bytes.

A :class:`~meshkit.core.forward.Hold` step (the only workers are waking) is
waited out here, holding no lease: the async driver awaits a future the lifecycle
resolves from its own thread (``loop.call_soon_threadsafe``), so a client that
disconnects cancels the wait at once and is never forwarded; the sync driver
waits on a condition. Either sends back whether the worker became ready.

When the driver gives up on an attempt because of an error or a cancellation
(the client left), its lease is *abandoned*: released without blaming the
worker, so a client's disconnect never counts against a worker's breaker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshkit.core.credentials import response_headers
from meshkit.core.forward import (
    Attempt,
    AttemptResult,
    ForwardFlow,
    Hold,
    Lease,
    LocalResponse,
    Pair,
    PairResult,
)
from meshkit.upstream.base import AsyncExchange, SyncExchange, UpstreamFailure

__all__ = [
    "Answered",
    "AsyncExchange",
    "Final",
    "Relayed",
    "SyncExchange",
    "UpstreamFailure",
    "drive_async",
    "drive_sync",
]

#: error and listing bodies read into memory are bounded (a worker is not trusted)
MAX_CAPTURED_BODY = 1024 * 1024


X = TypeVar("X")


@dataclass(slots=True)
class Relayed(Generic[X]):
    """A worker's response to relay; the caller now owns the attempt's lease."""

    attempt: Attempt
    exchange: X


@dataclass(slots=True)
class Answered:
    """Bytes to answer with: captured from a worker (``attempt`` set, its lease
    still held) or built by meshkit (a merged listing, a local answer)."""

    attempt: Attempt | None
    local: LocalResponse


Final = Relayed[X] | Answered


def _result(
    attempt: Attempt, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None
) -> tuple[AttemptResult, LocalResponse | None]:
    if body is None:
        return AttemptResult(status=status), None
    captured = LocalResponse(
        status,
        tuple((k, v) for k, v in response_headers(headers) if k != b"content-length"),
        body,
    )
    return AttemptResult(status=status, headers=captured.headers, body=body), captured


def _wants_body(attempt: Attempt, status: int) -> bool:
    mode = attempt.read_body
    return mode == "always" or (mode == "errors" and status >= 400)


def _first(flow: ForwardFlow) -> Attempt | Hold | Pair | Answered:
    """The flow's first step; a flow that answers locally returns before any attempt."""
    try:
        return next(flow)
    except StopIteration as stop:
        final = stop.value
        if not isinstance(final, LocalResponse):  # pragma: no cover - flow contract
            raise RuntimeError("a flow returned an attempt it never yielded") from None
        return Answered(None, final)


def _abandon(lease: Lease) -> None:
    # Mesh leases can be released without a verdict on the worker; a plain Lease
    # (tests, third-party placers) is released as a failed attempt, as before.
    abandon = getattr(lease, "abandon", None)
    if abandon is not None:
        abandon()
    else:
        lease.release(ok=False)


def _advance(
    flow: ForwardFlow, result: AttemptResult, exchange: X | None, captured: LocalResponse | None
) -> tuple[Attempt | Hold | Pair | Final[X], bool]:
    """Send ``result`` into the flow: the next attempt or what to relay, and
    whether the current exchange must be closed."""
    try:
        nxt = flow.send(result)
    except StopIteration as stop:
        final: Attempt | LocalResponse = stop.value
        if isinstance(final, LocalResponse):
            return Answered(None, final), True
        if captured is not None:
            return Answered(final, captured), True
        if exchange is None:  # pragma: no cover - a flow returns only answered attempts
            raise RuntimeError("the flow returned an attempt that got no response") from None
        return Relayed(final, exchange), False
    return nxt, True


async def drive_async(
    flow: ForwardFlow,
    send: Callable[[Attempt], Awaitable[AsyncExchange]],
) -> Final[AsyncExchange]:
    """Run ``flow`` to its end with an async ``send``."""
    attempt: Attempt | None = None
    exchange: AsyncExchange | None = None
    companion: Attempt | None = None
    try:
        step: Attempt | Hold | Pair | Final[AsyncExchange] = _first(flow)
        while isinstance(step, Attempt | Hold | Pair):
            if isinstance(step, Hold):
                # No lease is held while waiting; a cancellation lands here.
                ready = await step.waiter.wait_async(step.deadline_s)
                step, _ = _advance(flow, AttemptResult.held(ready), None, None)
                continue
            companion = None
            if isinstance(step, Pair):
                # The prefill leg runs beside the decode leg (SGLang needs both
                # sides connected for the KV handover); its body is read whole.
                companion = step.prefill
                other = asyncio.ensure_future(_leg_async(send, step.prefill))
                step = step.decode
            attempt, exchange = step, None
            if attempt.delay_s > 0:
                await asyncio.sleep(attempt.delay_s)
            captured = None
            try:
                exchange = await send(attempt)
            except UpstreamFailure as exc:
                result = AttemptResult.failed(exc.failure)
            else:
                body = None
                if _wants_body(attempt, exchange.status):
                    body = await _read_async(exchange)
                result, captured = _result(attempt, exchange.status, exchange.headers, body)
            if companion is not None:
                result = _paired(result, await other)
            step, done_with = _advance(flow, result, exchange, captured)
            companion = None
            if done_with and exchange is not None:
                await exchange.aclose()
        return step
    except BaseException:
        # The flow owns leases until it returns; an error or a cancellation in
        # between must not leak the current attempt's.
        if exchange is not None:
            await exchange.aclose()
        if attempt is not None:
            _abandon(attempt.lease)
        if companion is not None:
            other.cancel()
            _abandon(companion.lease)
        raise
    finally:
        flow.close()


def drive_sync(
    flow: ForwardFlow,
    send: Callable[[Attempt], SyncExchange],
    sleep: Callable[[float], None] = time.sleep,
) -> Final[SyncExchange]:
    """Run ``flow`` to its end with a blocking ``send``."""
    attempt: Attempt | None = None
    exchange: SyncExchange | None = None
    companion: Attempt | None = None
    try:
        step: Attempt | Hold | Pair | Final[SyncExchange] = _first(flow)
        while isinstance(step, Attempt | Hold | Pair):
            if isinstance(step, Hold):
                ready = step.waiter.wait_sync(step.deadline_s)
                step, _ = _advance(flow, AttemptResult.held(ready), None, None)
                continue
            companion = None
            if isinstance(step, Pair):
                companion = step.prefill
                pending = _legs().submit(_leg_sync, send, step.prefill)
                step = step.decode
            attempt, exchange = step, None
            if attempt.delay_s > 0:
                sleep(attempt.delay_s)
            captured = None
            try:
                exchange = send(attempt)
            except UpstreamFailure as exc:
                result = AttemptResult.failed(exc.failure)
            else:
                body = None
                if _wants_body(attempt, exchange.status):
                    body = _read_sync(exchange)
                result, captured = _result(attempt, exchange.status, exchange.headers, body)
            if companion is not None:
                result = _paired(result, pending.result())
            step, done_with = _advance(flow, result, exchange, captured)
            companion = None
            if done_with and exchange is not None:
                exchange.close()
        return step
    except BaseException:
        if exchange is not None:
            exchange.close()
        if attempt is not None:
            _abandon(attempt.lease)
        if companion is not None:
            _abandon(companion.lease)
        raise
    finally:
        flow.close()


def _paired(decode: AttemptResult, prefill: AttemptResult) -> PairResult:
    return PairResult(
        status=decode.status,
        failure=decode.failure,
        headers=decode.headers,
        body=decode.body,
        prefill=prefill,
    )


async def _leg_async(
    send: Callable[[Attempt], Awaitable[AsyncExchange]], attempt: Attempt
) -> AttemptResult:
    """Send one leg and read its whole (bounded) body."""
    try:
        exchange = await send(attempt)
    except UpstreamFailure as exc:
        return AttemptResult.failed(exc.failure)
    try:
        body = await _read_async(exchange)
    finally:
        await exchange.aclose()
    return _result(attempt, exchange.status, exchange.headers, body)[0]


def _leg_sync(send: Callable[[Attempt], SyncExchange], attempt: Attempt) -> AttemptResult:
    try:
        exchange = send(attempt)
    except UpstreamFailure as exc:
        return AttemptResult.failed(exc.failure)
    try:
        body = _read_sync(exchange)
    finally:
        exchange.close()
    return _result(attempt, exchange.status, exchange.headers, body)[0]


_LEGS: ThreadPoolExecutor | None = None


def _legs() -> ThreadPoolExecutor:
    """Threads for the prefill legs of sync callers (bounded; created on first use)."""
    global _LEGS
    if _LEGS is None:
        _LEGS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="meshkit-pd-leg")
    return _LEGS


async def _read_async(exchange: AsyncExchange) -> bytes:
    try:
        return await exchange.read(MAX_CAPTURED_BODY)
    except UpstreamFailure:
        return b""


def _read_sync(exchange: SyncExchange) -> bytes:
    try:
        return exchange.read(MAX_CAPTURED_BODY)
    except UpstreamFailure:
        return b""
