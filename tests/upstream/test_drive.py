"""The flow driver's own contract: how a generator's end reaches the loops, and
what is closed when an operation fails (meshkit.upstream.drive)."""

from __future__ import annotations

from collections.abc import Generator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from meshkit.core.forward import Attempt, AttemptResult, Failure
from meshkit.core.requests import LocalResponse
from meshkit.core.workers import Candidate, Worker
from meshkit.errors import UpstreamError
from meshkit.upstream.base import SyncExchange, UpstreamFailure
from meshkit.upstream.drive import (
    CLOSE,
    SEND,
    Answered,
    Ended,
    Relayed,
    ended,
    flow_steps,
    run_sync,
)


def test_ended_passes_every_step_and_send_then_yields_the_return_value() -> None:
    seen: list[Any] = []

    def gen() -> Generator[str, int, str]:
        seen.append((yield "a"))
        seen.append((yield "b"))
        return "end"

    steps = ended(gen())
    assert next(steps) == "a"
    assert steps.send(1) == "b"
    last = steps.send(2)
    assert isinstance(last, Ended)
    assert last.value == "end"
    assert seen == [1, 2]


def test_ended_throws_into_the_generator_it_wraps() -> None:
    def gen() -> Generator[str, None, str]:
        try:
            yield "a"
        except KeyError:
            return "handled"
        return "not thrown"

    steps = ended(gen())
    next(steps)
    last = steps.throw(KeyError("x"))
    assert isinstance(last, Ended)
    assert last.value == "handled"


def test_run_sync_returns_what_the_steps_return_and_throws_op_errors_into_them() -> None:
    def steps() -> Generator[tuple[int, Any], Any, str]:
        try:
            yield (SEND, "first")
        except UpstreamFailure as exc:
            got = yield (SEND, f"second after {exc.failure.name}")
            return f"done with {got}"
        return "first answered"

    calls: list[str] = []

    def send(arg: Any) -> Any:
        calls.append(arg)
        if len(calls) == 1:
            raise UpstreamFailure(Failure.CONNECT)
        return "exchange"

    assert run_sync(steps(), send) == "done with exchange"
    assert calls == ["first", "second after CONNECT"]


class _Lease:
    def __init__(self, candidate: Candidate) -> None:
        self.candidate = candidate
        self.started = 0.0
        self.abandoned = 0

    def release(self, *, ok: bool, status: int | None = None) -> None:
        pytest.fail("the driver never gives a verdict on a lease")

    def abandon(self) -> None:
        self.abandoned += 1


def _attempt() -> Any:
    cand = Candidate(Worker("http://127.0.0.1:9"))
    return Attempt(0, cand, _Lease(cand), "POST", cand.worker.url + "/v1/completions", [], b"{}")


def test_a_flow_answered_before_any_attempt_is_answered_locally() -> None:
    local = LocalResponse(200, (), b"{}")

    def flow() -> Generator[Any, AttemptResult, Any]:
        return local
        yield  # a generator

    got = run_sync(flow_steps(flow()), lambda a: pytest.fail("nothing is sent"))
    assert isinstance(got, Answered)
    assert got.attempt is None
    assert got.local is local


def test_the_last_attempt_is_relayed_open_and_earlier_ones_are_closed() -> None:
    first, second = _attempt(), _attempt()
    leases = [first.lease, second.lease]
    closed: list[Any] = []

    def flow() -> Generator[Any, AttemptResult, Any]:
        result = yield first
        assert result.status == 503
        yield second
        return second

    exchanges = iter(
        [SimpleNamespace(status=503, headers=[]), SimpleNamespace(status=200, headers=[])]
    )
    steps = flow_steps(flow())
    op, arg = next(steps)
    outcomes = []
    while True:
        try:
            if op == SEND:
                op, arg = steps.send(next(exchanges))
            elif op == CLOSE:
                closed.append(arg)
                op, arg = steps.send(None)
            else:  # pragma: no cover
                pytest.fail(f"unexpected op {op}")
        except StopIteration as stop:
            outcomes.append(stop.value)
            break
    (got,) = outcomes
    assert isinstance(got, Relayed)
    assert got.attempt is second
    assert got.exchange.status == 200
    assert [e.status for e in closed] == [503]  # the relayed one stays open
    assert [lease.abandoned for lease in leases] == [0, 0]


def test_an_op_that_fails_closes_the_flow_and_abandons_the_attempt_in_flight() -> None:
    attempt = _attempt()
    finished: list[str] = []

    def flow() -> Generator[Any, AttemptResult, Any]:
        try:
            yield attempt
            return attempt
        finally:
            finished.append("flow closed")

    def send(_: Any) -> Any:
        raise KeyboardInterrupt  # not an UpstreamFailure: the flow cannot handle it

    with pytest.raises(KeyboardInterrupt):
        run_sync(flow_steps(flow()), send)
    assert finished == ["flow closed"]
    assert attempt.lease.abandoned == 1


class _Body:
    """An exchange whose body is ``body``, read up to the limit asked (the part of
    ``SyncExchange`` the driver uses here: the tests cast it to one)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.headers = [(b"content-type", b"application/json")]
        self.body = body
        self.asked: list[int] = []
        self.closed = False

    def read(self, limit: int) -> bytes:
        self.asked.append(limit)
        return self.body[:limit]

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("size", "truncated"), [(99, False), (100, False), (101, True), (5000, True)]
)
def test_a_captured_body_is_bounded_and_says_when_it_was_cut(size: int, truncated: bool) -> None:
    attempt = _attempt()
    attempt.read_body, attempt.read_limit = "always", 100
    seen: list[AttemptResult] = []

    def flow() -> Generator[Any, AttemptResult, Any]:
        seen.append((yield attempt))
        return LocalResponse(200, (), b"done")  # the flow answers; it read the body

    exchange = _Body(200, b"x" * size)
    got = run_sync(flow_steps(flow()), lambda a: cast(SyncExchange, exchange))
    assert isinstance(got, Answered) and got.local.body == b"done"
    (result,) = seen
    assert exchange.asked == [101]  # one byte past the bound tells a cut body apart
    assert result.truncated is truncated
    assert result.body == b"x" * min(size, 100)
    assert exchange.closed


def test_a_cut_capture_is_never_relayed_as_the_answer() -> None:
    attempt = _attempt()
    attempt.read_body, attempt.read_limit = "always", 100

    def flow() -> Generator[Any, AttemptResult, Any]:
        yield attempt
        return attempt  # its captured body would be the answer

    with pytest.raises(UpstreamError, match=r"bounds\.max_captured_body_bytes \(100 bytes\)"):
        run_sync(flow_steps(flow()), lambda a: cast(SyncExchange, _Body(400, b"e" * 101)))
    assert attempt.lease.abandoned == 1
    whole = _attempt()
    whole.read_body, whole.read_limit = "always", 100

    def flow2() -> Generator[Any, AttemptResult, Any]:
        yield whole
        return whole

    got = run_sync(flow_steps(flow2()), lambda a: cast(SyncExchange, _Body(400, b"e" * 100)))
    assert isinstance(got, Answered) and got.attempt is whole and got.local.body == b"e" * 100


def test_a_flow_can_answer_with_its_attempt_and_a_body_it_rewrote() -> None:
    attempt = _attempt()
    lease = attempt.lease
    attempt.read_body, attempt.read_limit = "always", 100

    def flow() -> Generator[Any, AttemptResult, Any]:
        result = yield attempt
        attempt.answer = LocalResponse(200, (), (result.body or b"") + b"!")
        return attempt

    got = run_sync(flow_steps(flow()), lambda a: cast(SyncExchange, _Body(200, b"{}")))
    assert isinstance(got, Answered)
    assert got.attempt is attempt  # its lease is the caller's: accounted and released
    assert got.local.body == b"{}!"
    assert lease.abandoned == 0


def test_a_pair_result_says_when_the_decode_body_was_cut() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from meshkit.core.forward import Pair, PairResult

    prefill, decode = _attempt(), _attempt()
    for leg in (prefill, decode):
        leg.read_body, leg.read_limit = "always", 100
    bodies = {id(prefill): b"p" * 10, id(decode): b"d" * 101}
    seen: list[AttemptResult] = []

    def flow() -> Generator[Any, AttemptResult, Any]:
        seen.append((yield Pair(prefill, decode)))
        return LocalResponse(200, (), b"done")

    with ThreadPoolExecutor(1) as pool:
        run_sync(
            flow_steps(flow()),
            lambda a: cast(SyncExchange, _Body(200, bodies[id(a)])),
            lambda: pool,
        )
    (result,) = seen
    assert isinstance(result, PairResult)
    assert result.truncated and result.body == b"d" * 100
    assert result.prefill is not None and not result.prefill.truncated
    assert result.prefill.body == b"p" * 10


def test_a_pair_whose_prefill_leg_cannot_start_abandons_both_legs() -> None:
    """Starting the prefill leg beside the decode leg may raise (the leg threads
    shut down): the decode leg's lease is held by then and goes back too."""
    from concurrent.futures import ThreadPoolExecutor

    from meshkit.core.forward import Pair

    prefill, decode = _attempt(), _attempt()

    def flow() -> Generator[Any, AttemptResult, Any]:
        yield Pair(prefill, decode)
        return LocalResponse(200, (), b"done")  # pragma: no cover - the leg fails first

    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    with pytest.raises(RuntimeError):
        run_sync(flow_steps(flow()), lambda a: pytest.fail("nothing is sent"), lambda: pool)
    assert (prefill.lease.abandoned, decode.lease.abandoned) == (1, 1)
