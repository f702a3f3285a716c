"""
Driving a flow
==============

The core's flows (:mod:`meshkit.core.forward`) yield attempts and receive their
results. What to do with each attempt (send it, read an error body, close the
response, run a prefill leg beside it, wait out a hold) is written once, as the
step generator :func:`flow_steps`: it yields I/O *operations* and receives their
outcomes (httpx's ``auth_flow`` pattern, one level up). :func:`run_sync` and
:func:`run_async` are the only loops that perform them, one blocking, one
awaiting; a front end's own steps (the client transports') yield the same
operations and embed a flow with ``yield from flow_steps(flow)``.

An operation that raises is thrown into the steps at its ``yield``; a cancellation
(the client left) lands the same way, and the steps close what they opened and
*abandon* the leases the flow held (released without a verdict: a client's
disconnect never counts against a worker's breaker). A response stays open until
the flow moves on (the steps close it) or returns its attempt (the caller relays
it); a body the attempt asked for (``read_body``) is read, bounded, into the flow.
A :class:`~meshkit.core.forward.Hold` is waited out holding no lease.

The drivers take a generator's end as one more yielded step, :class:`Ended`
(:func:`ended`), not as the StopIteration its ``return`` raises: in the compiled
build that exception costs a traceback each time, twice per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Generator, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from meshkit.core.credentials import served_headers
from meshkit.core.forward import (
    RETRYABLE_STATUS,
    Attempt,
    AttemptResult,
    ForwardFlow,
    Hold,
    LocalResponse,
    Pair,
    PairResult,
    answered,
)
from meshkit.errors import UpstreamError, body_over
from meshkit.upstream.base import AsyncExchange, SyncExchange, UpstreamFailure

__all__ = [
    "Answered",
    "AsyncExchange",
    "FlowEnd",
    "Relayed",
    "Steps",
    "SyncExchange",
    "UpstreamFailure",
    "aread_body",
    "drive_async",
    "drive_sync",
    "flow_steps",
    "read_body",
    "run_async",
    "run_sync",
]

X = TypeVar("X")
T = TypeVar("T")
Y = TypeVar("Y")
S = TypeVar("S")

# The operations (the first item of what steps yield; the second is the argument):
SEND: Final = 0  # an attempt -> its exchange (raises UpstreamFailure)
READ: Final = 1  # (exchange, limit) -> at most limit bytes of its body (raises UpstreamFailure)
CLOSE: Final = 2  # an exchange -> None
WAIT: Final = 3  # a Hold -> whether the worker became ready
SLEEP: Final = 4  # seconds -> None
LEG: Final = 5  # an attempt -> a handle on it running beside (sent, its body read whole)
JOIN: Final = 6  # a handle -> the leg's AttemptResult
CANCEL: Final = 7  # a handle -> None
BODY: Final = 8  # (a request body's chunks, limit) -> the body (413 past limit)
PREPARE: Final = 9  # (mesh, match, body, headers, query[, within_s]) -> the RequestView

Op = tuple[int, Any]
Steps = Generator[Op, Any, T]


class Relayed(Generic[X]):
    """A worker's response to relay; the caller now owns the attempt's lease."""

    # A plain class: mypyc does not build generic dataclasses.
    __slots__ = ("attempt", "exchange")

    def __init__(self, attempt: Attempt, exchange: X) -> None:
        self.attempt = attempt
        self.exchange = exchange


@dataclass(slots=True)
class Answered:
    """Bytes to answer with: captured from a worker (``attempt`` set, its lease
    still held) or built by meshkit (a merged listing, a local answer)."""

    attempt: Attempt | None
    local: LocalResponse


FlowEnd = Relayed[X] | Answered


class Ended(Generic[X]):
    """The last step :func:`ended` yields: the generator's return value."""

    __slots__ = ("value",)

    def __init__(self, value: X) -> None:
        self.value = value


def ended(gen: Generator[Y, S, X]) -> Generator[Y | Ended[X], S, None]:
    """``gen``'s steps, then its return value as one more step, :class:`Ended`.

    A compiled generator that returns to a caller of its ``send`` raises
    StopIteration, and mypyc builds a traceback for it on the way (~2,000
    instructions, ~0.7 µs: twice per proxied request); one compiled generator that
    *yields from* another takes the value without an exception. The caller never
    resumes it after :class:`Ended` (nor closes it: a close throws GeneratorExit).
    """
    value = yield from gen
    yield Ended(value)


def _result(
    exchange: Any, body: bytes | None, truncated: bool
) -> tuple[AttemptResult, LocalResponse | None]:
    status = exchange.status
    if body is None:
        return answered(status), None
    headers = tuple((k, v) for k, v in served_headers(exchange.headers) if k != b"content-length")
    captured = LocalResponse(status, headers, body)
    return AttemptResult(status=status, headers=headers, body=body, truncated=truncated), captured


def _wants_body(attempt: Attempt, status: int) -> bool:
    mode = attempt.read_body
    return mode == "always" or (mode == "errors" and status >= 400)


def _captured(exchange: Any, limit: int) -> Steps[tuple[AttemptResult, LocalResponse | None]]:
    """The body an attempt asked for, captured: at most ``limit`` bytes (a longer one
    is cut there and marked ``truncated``; one cut short by the worker is empty)."""
    try:
        body = yield (READ, (exchange, limit + 1))
    except UpstreamFailure:
        body = b""
    if len(body) > limit:
        return _result(exchange, body[:limit], True)
    return _result(exchange, body, False)


def leg_steps(attempt: Attempt) -> Steps[AttemptResult]:
    """One leg sent and its whole (bounded) body read: what runs beside a decode leg."""
    try:
        exchange = yield (SEND, attempt)
    except UpstreamFailure as exc:
        return AttemptResult.failed(exc.failure)
    # The close is yielded after the handler, not in a finally: see flow_steps.
    error: BaseException | None = None
    try:
        result = (yield from _captured(exchange, attempt.read_limit))[0]
    except BaseException as exc:
        error = exc
    yield (CLOSE, exchange)
    if error is not None:
        raise error
    return result


def flow_steps(flow: ForwardFlow) -> Steps[FlowEnd[Any]]:
    """Run ``flow`` to its end (see the module docstring)."""
    attempt: Attempt | None = None
    exchange: Any = None
    companion: Attempt | None = None
    other: Any = None
    steps = ended(flow)
    done = False
    try:
        step = next(steps)
        if isinstance(step, Ended):  # answered locally, before any attempt
            done = True
            local = step.value
            assert isinstance(local, LocalResponse)  # a flow returns only attempts it sent
            return Answered(None, local)
        while True:
            if isinstance(step, Hold):
                ready = yield (WAIT, step)
                result: AttemptResult = AttemptResult.held(ready)
                exchange = captured = None
            else:
                if isinstance(step, Pair):
                    companion, step = step.prefill, step.decode
                attempt, exchange, captured = step, None, None  # held: released on errors
                if companion is not None:
                    # The prefill leg runs beside the decode leg (SGLang needs both
                    # sides connected for the KV handover); its body is read whole.
                    other = yield (LEG, companion)
                if attempt.delay_s > 0:
                    yield (SLEEP, attempt.delay_s)
                try:
                    exchange = yield (SEND, attempt)
                except UpstreamFailure as exc:
                    result = AttemptResult.failed(exc.failure)
                else:
                    status = exchange.status
                    if _wants_body(attempt, status):
                        result, captured = yield from _captured(exchange, attempt.read_limit)
                    elif status in RETRYABLE_STATUS:
                        # its head: the flow reads the worker's x-should-retry in it
                        result = AttemptResult(status=status, headers=tuple(exchange.headers))
                    else:
                        result = answered(status)
                if companion is not None:
                    prefill = yield (JOIN, other)
                    companion = other = None
                    result = PairResult(
                        status=result.status,
                        failure=result.failure,
                        headers=result.headers,
                        body=result.body,
                        truncated=result.truncated,
                        prefill=prefill,
                    )
            step = steps.send(result)
            if isinstance(step, Ended):
                done = True
                final: Attempt | LocalResponse = step.value
                if isinstance(final, LocalResponse):
                    answer: FlowEnd[Any] = Answered(None, final)
                elif final.answer is not None:
                    answer = Answered(final, final.answer)  # the flow rewrote it
                elif captured is not None:
                    if result.truncated:
                        raise UpstreamError(
                            "a worker's answer is over bounds.max_captured_body_bytes "
                            f"({final.read_limit} bytes)"
                        )
                    answer = Answered(final, captured)
                else:
                    answer, exchange = Relayed(final, exchange), None  # the caller's now
                if exchange is not None:
                    yield (CLOSE, exchange)
                return answer
            if exchange is not None:
                yield (CLOSE, exchange)
                exchange = None
    except BaseException as exc:
        # The flow owns its leases until it returns; an error or a cancellation
        # in between must not leak the current attempt's. Released first: the
        # cancel and close below are I/O, which may raise or be cancelled again.
        if attempt is not None:
            attempt.lease.abandon()
        if companion is not None:
            companion.lease.abandon()
        error = exc
    finally:
        if not done:
            steps.close()
    # Not inside the handler: a compiled generator that yields there (entered by
    # throw(), resumed by send()) crashed the interpreter that delegated to it
    # (an async transport's request cancelled during a SGLang pair).
    if other is not None:
        yield (CANCEL, other)
    if exchange is not None:
        yield (CLOSE, exchange)
    raise error


# -- the two loops ----------------------------------------------------------------------


def read_body(chunks: Iterable[bytes], limit: int) -> bytes:
    """A request body read piece by piece, refused (413) as soon as it is over
    ``limit`` (never buffered whole first)."""
    parts: list[bytes] = []
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise body_over(limit)
        parts.append(chunk)
    return b"".join(parts)


async def aread_body(chunks: AsyncIterable[bytes], limit: int) -> bytes:
    """:func:`read_body` for an async body."""
    parts: list[bytes] = []
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise body_over(limit)
        parts.append(chunk)
    return b"".join(parts)


def run_sync(
    steps: Steps[T],
    send: Callable[[Attempt], SyncExchange],
    legs: Callable[[], Executor] | None = None,
) -> T:
    """Perform ``steps``' operations with blocking calls; ``legs`` gives the threads
    a prefill leg runs on."""
    result: Any = None
    error: BaseException | None = None
    until = ended(steps)
    while True:
        step = until.send(result) if error is None else until.throw(error)
        if isinstance(step, Ended):
            return step.value
        op, arg = step
        result = error = None
        try:
            if op == SEND:
                result = send(arg)
            elif op == CLOSE:
                arg.close()
            elif op == READ:
                result = arg[0].read(arg[1])
            elif op == PREPARE:
                result = arg[0].prepare(*arg[1:])
            elif op == BODY:
                result = read_body(*arg)
            elif op == WAIT:
                result = arg.waiter.wait_sync(arg.deadline_s)
            elif op == SLEEP:
                time.sleep(arg)
            elif op == LEG:
                if legs is None:  # pragma: no cover - front ends with PD pass legs
                    raise RuntimeError("a prefill leg needs threads (legs=)")
                result = legs().submit(run_sync, leg_steps(arg), send)
            elif op == JOIN:
                result = arg.result()
            elif op == CANCEL:
                arg.cancel()
        except BaseException as exc:
            error = exc


async def run_async(steps: Steps[T], send: Callable[[Attempt], Awaitable[AsyncExchange]]) -> T:
    """Perform ``steps``' operations, awaiting each."""
    result: Any = None
    error: BaseException | None = None
    until = ended(steps)
    while True:
        step = until.send(result) if error is None else until.throw(error)
        if isinstance(step, Ended):
            return step.value
        op, arg = step
        result = error = None
        try:
            if op == SEND:
                result = await send(arg)
            elif op == CLOSE:
                await arg.aclose()
            elif op == READ:
                result = await arg[0].read(arg[1])
            elif op == PREPARE:
                result = await arg[0].prepare_async(*arg[1:])
            elif op == BODY:
                result = await aread_body(*arg)
            elif op == WAIT:
                result = await arg.waiter.wait_async(arg.deadline_s)
            elif op == SLEEP:
                await asyncio.sleep(arg)
            elif op == LEG:
                result = asyncio.ensure_future(run_async(leg_steps(arg), send))
            elif op == JOIN:
                result = await arg
            elif op == CANCEL:
                arg.cancel()
        except BaseException as exc:
            error = exc


def drive_sync(
    flow: ForwardFlow,
    send: Callable[[Attempt], SyncExchange],
    legs: Callable[[], Executor] | None = None,
) -> FlowEnd[SyncExchange]:
    """Run ``flow`` to its end with a blocking ``send``."""
    return run_sync(flow_steps(flow), send, legs)


def drive_async(
    flow: ForwardFlow, send: Callable[[Attempt], Awaitable[AsyncExchange]]
) -> Awaitable[FlowEnd[AsyncExchange]]:
    """Run ``flow`` to its end with an async ``send`` (await it)."""
    return run_async(flow_steps(flow), send)
