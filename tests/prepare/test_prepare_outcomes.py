"""Every accepted job settles exactly once, whatever the mix and the interleaving."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkit.errors import InvalidRequest, PrepareTimeout
from meshkit.prepare.pool import Job, JobCancelled, PoolConfig, PreparePool

KINDS = ("ok", "fail", "mesh_fail", "slow", "cancel", "async", "async_cancel")


class Boom(Exception):
    pass


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _settle_all(pool: PreparePool, jobs: list[Job[Any]]) -> list[tuple[str, Any]]:
    seen = []
    for job in jobs:
        try:
            seen.append(("value", job.result()))
        except BaseException as exc:
            seen.append(("error", exc))
    end = time.monotonic() + 10
    while pool.running and time.monotonic() < end:  # abandoned jobs finishing
        time.sleep(0.001)
    assert pool.running == 0
    return seen


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=30),
    submitters=st.integers(1, 4),
    workers=st.integers(1, 3),
    expire=st.booleans(),
)
def test_each_job_is_counted_exactly_once(
    kinds: list[str], submitters: int, workers: int, expire: bool
) -> None:
    clock = _Clock()
    pool = PreparePool(
        PoolConfig(workers=workers, queue_capacity=1000, queue_timeout_ms=1000, timeout_ms=2000),
        clock=clock,
    )
    gate = threading.Event()
    ran: Counter[int] = Counter()
    lock = threading.Lock()
    jobs: dict[int, Job[Any]] = {}
    async_results: dict[int, tuple[str, Any]] = {}
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever)
    loop_thread.start()

    def body(i: int, kind: str) -> Any:
        with lock:
            ran[i] += 1
        if kind == "fail":
            raise Boom(i)
        if kind == "mesh_fail":
            raise InvalidRequest(f"job {i}")
        if kind == "slow":
            gate.wait(30)
        return i

    async def awaited(i: int, kind: str) -> None:
        task = asyncio.ensure_future(pool.run_async(lambda: body(i, "slow")))
        if kind == "async_cancel":
            await asyncio.sleep(0)
            task.cancel()
        try:
            async_results[i] = ("value", await task)
        except asyncio.CancelledError:
            async_results[i] = ("cancelled", None)
        except Exception as exc:
            async_results[i] = ("error", exc)

    futures = []

    def submit_share(share: list[tuple[int, str]]) -> None:
        for i, kind in share:
            if kind in ("async", "async_cancel"):
                futures.append(asyncio.run_coroutine_threadsafe(awaited(i, kind), loop))
                continue
            job = pool.submit(cast(Callable[[], Any], lambda i=i, kind=kind: body(i, kind)))
            with lock:
                jobs[i] = job
            if kind == "cancel":
                job.cancel()

    numbered = list(enumerate(kinds))
    threads = [
        threading.Thread(target=submit_share, args=(numbered[k::submitters],))
        for k in range(submitters)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        n_async = sum(k in ("async", "async_cancel") for k in kinds)
        end = time.monotonic() + 10
        while len(futures) < n_async and time.monotonic() < end:
            time.sleep(0.001)
        # Let the async submissions reach the pool before deciding deadlines.
        end = time.monotonic() + 10
        while (
            sum(pool.outcomes.values()) + pool.queued + pool.running < len(kinds)
            and time.monotonic() < end
        ):
            time.sleep(0.001)
        if expire:
            clock.now += 5  # past every deadline: whatever has not settled times out
            pool.expire_overdue()
        gate.set()
        settled = _settle_all(pool, [jobs[i] for i in sorted(jobs)])
        for fut in futures:
            fut.result(10)
    finally:
        gate.set()
        pool.shutdown(wait=True)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        loop.close()

    # Exactly once: the pool's tally is the sum of the jobs' own outcomes.
    outcomes = pool.outcomes
    assert sum(outcomes.values()) == len(kinds)
    sync_outcomes = Counter(job.outcome for job in jobs.values())
    assert None not in sync_outcomes
    assert outcomes["timeout"] == pool.metrics.error_count("timeout")
    assert outcomes["cancelled"] == pool.metrics.error_count("cancelled")
    assert outcomes["failed"] == pool.metrics.error_count("failed") + pool.metrics.error_count(
        "invalid_request"
    )
    # Each job ran at most once, and what its caller saw matches its outcome.
    assert all(count == 1 for count in ran.values())
    for (kind_, value), i in zip(settled, sorted(jobs), strict=True):
        job = jobs[i]
        if job.outcome == "success":
            assert kind_ == "value" and value == i
            assert ran[i] == 1
        elif job.outcome == "failed":
            assert isinstance(value, Boom | InvalidRequest)
        elif job.outcome == "timeout":
            assert isinstance(value, PrepareTimeout)
        else:
            assert isinstance(value, JobCancelled)
            assert kinds[i] == "cancel"
    for i, (kind_, value) in async_results.items():
        if kind_ == "cancelled":
            assert kinds[i] == "async_cancel"
        elif kind_ == "error":
            assert isinstance(value, PrepareTimeout)
        else:
            assert value == i
    assert len(async_results) == sum(k in ("async", "async_cancel") for k in kinds)
    assert outcomes["cancelled"] <= sum(k in ("cancel", "async_cancel") for k in kinds)
