"""The preparation pool at each of its bounds (no wall-clock assertions)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, cast

import pytest

from meshkit.core.requests import ClientTimeout
from meshkit.errors import (
    ConfigError,
    InvalidRequest,
    PoolUnavailable,
    PrepareQueueFull,
    PrepareTimeout,
    RequestTooLarge,
)
from meshkit.prepare.pool import (
    Job,
    JobCancelled,
    PoolConfig,
    PreparePool,
    current_worker_index,
    default_workers,
)

MakePool = Callable[..., PreparePool]
WaitUntil = Callable[..., None]


def sample(pool: PreparePool, name: str, **labels: str) -> float:
    value = pool.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


class Blocker:
    """A job that signals it started and then waits to be released."""

    def __init__(self, result: Any = "released") -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.result = result

    def __call__(self) -> Any:
        self.started.set()
        assert self.release.wait(30), "blocker never released"
        return self.result


def occupy(pool: PreparePool, wait_until: WaitUntil) -> list[Blocker]:
    """Make every worker busy with a blocker; return the blockers."""
    blockers = [Blocker() for _ in range(pool.workers)]
    for blocker in blockers:
        pool.submit(blocker)
    wait_until(lambda: all(b.started.is_set() for b in blockers))
    return blockers


def release(blockers: list[Blocker]) -> None:
    for blocker in blockers:
        blocker.release.set()


# -- configuration ---------------------------------------------------------------


def test_default_workers_is_half_the_cpus_at_least_one() -> None:
    assert default_workers() >= 1
    assert PoolConfig().resolved_workers == default_workers()
    assert PoolConfig(workers=3).resolved_workers == 3


@pytest.mark.parametrize(
    "kwargs",
    [{"workers": 0}, {"timeout_ms": 0}, {"queue_capacity": -1}, {"workers_per_tokenizer": 0}],
)
def test_invalid_config_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        PoolConfig(**kwargs)


def test_threads_are_named_and_counted(make_pool: MakePool) -> None:
    pool = make_pool(workers=3)
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("meshkit-prepare-"))
    assert {"meshkit-prepare-0", "meshkit-prepare-1", "meshkit-prepare-2"} <= set(names)
    assert pool.live_workers == 3
    assert pool.healthy
    assert sample(pool, "mesh_prepare_live_workers") == 3


# -- running ------------------------------------------------------------------------


def test_run_returns_the_value_and_counts_success(make_pool: MakePool) -> None:
    pool = make_pool(workers=2)
    assert pool.run(lambda: 6 * 7) == 42
    assert pool.outcomes["success"] == 1
    assert sample(pool, "mesh_prepare_run_seconds_count") == 1
    assert sample(pool, "mesh_prepare_queue_seconds_count") == 1


def test_jobs_run_on_pool_threads(make_pool: MakePool) -> None:
    pool = make_pool(workers=2)
    index = pool.run(current_worker_index)
    assert index in (0, 1)
    assert current_worker_index() is None


def test_run_async_awaits_the_value(make_pool: MakePool) -> None:
    pool = make_pool(workers=1)

    async def main() -> str:
        return await pool.run_async(lambda: threading.current_thread().name)

    assert asyncio.run(main()) == "meshkit-prepare-0"


def test_a_failing_job_propagates_its_exception_unchanged(make_pool: MakePool) -> None:
    pool = make_pool(workers=1)
    error = ValueError("bad")

    def fail() -> None:
        raise error

    with pytest.raises(ValueError, match="bad") as info:
        pool.run(fail)
    assert info.value is error
    assert pool.outcomes["failed"] == 1
    assert pool.metrics.error_count("failed") == 1


def test_a_mesh_error_from_a_job_is_counted_under_its_code(make_pool: MakePool) -> None:
    pool = make_pool(workers=1)

    def invalid() -> None:
        raise InvalidRequest("nope")

    def too_large() -> None:
        raise RequestTooLarge("big")

    with pytest.raises(InvalidRequest):
        pool.run(invalid)

    async def main() -> None:
        await pool.run_async(too_large)

    with pytest.raises(RequestTooLarge):
        asyncio.run(main())
    assert pool.outcomes["failed"] == 2
    assert pool.metrics.error_count("invalid_request") == 1
    assert pool.metrics.error_count("too_large") == 1


def test_run_from_a_pool_thread_runs_inline(make_pool: MakePool) -> None:
    # One worker: waiting for a sibling would deadlock.
    pool = make_pool(workers=1)
    assert pool.run(lambda: pool.run(lambda: "nested")) == "nested"


def test_done_callbacks_fire_once(make_pool: MakePool, wait_until: WaitUntil) -> None:
    pool = make_pool(workers=1)
    seen: list[Job[int]] = []
    job = pool.submit(lambda: 1)
    job.add_done_callback(seen.append)
    assert job.result() == 1
    wait_until(lambda: len(seen) == 1)
    job.add_done_callback(seen.append)  # already settled: called at once
    assert seen == [job, job]


# -- 503: queue full ----------------------------------------------------------------


def test_queue_full_is_refused_at_once_with_a_retry_hint(
    make_pool: MakePool, wait_until: WaitUntil
) -> None:
    pool = make_pool(workers=2, queue_capacity=3)
    blockers = occupy(pool, wait_until)
    queued = [pool.submit(cast(Callable[[], int], lambda i=i: i)) for i in range(3)]
    assert pool.queued == 3
    assert sample(pool, "mesh_prepare_queued_jobs") == 3
    assert sample(pool, "mesh_prepare_dispatched_jobs") == 5
    assert sample(pool, "mesh_prepare_busy_workers") == 2
    with pytest.raises(PrepareQueueFull) as info:
        pool.submit(lambda: "one too many")
    assert info.value.status == 503
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    assert any(k == b"retry-after-ms" for k, _ in info.value.headers())
    assert pool.metrics.error_count("queue_full") == 1
    release(blockers)
    assert [j.result() for j in queued] == [0, 1, 2]
    # The refused job was never accepted: it has no outcome.
    wait_until(lambda: pool.running == 0)
    assert sum(pool.outcomes.values()) == 5


# -- 504: in the queue, and while running ------------------------------------------


def test_a_job_overdue_in_the_queue_never_runs(
    make_pool: MakePool, clock: Any, wait_until: WaitUntil
) -> None:
    pool = make_pool(clock, workers=1, queue_timeout_ms=1000, timeout_ms=5000)
    blockers = occupy(pool, wait_until)
    ran = threading.Event()
    job = pool.submit(ran.set)
    clock.advance(0.999)
    assert pool.expire_overdue() == 0
    clock.advance(0.002)
    assert pool.expire_overdue() == 1
    assert job.outcome == "timeout"
    with pytest.raises(PrepareTimeout) as info:
        job.result()
    assert info.value.status == 504
    assert pool.queued == 0
    release(blockers)
    wait_until(lambda: pool.running == 0)
    assert not ran.is_set()
    assert pool.outcomes["timeout"] == 1
    assert pool.metrics.error_count("timeout") == 1


def test_a_waiting_caller_gets_504_when_its_job_expires_in_the_queue(
    make_pool: MakePool, clock: Any, wait_until: WaitUntil
) -> None:
    pool = make_pool(clock, workers=1, queue_timeout_ms=1000)
    blockers = occupy(pool, wait_until)
    ran = threading.Event()
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            pool.run(ran.set)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    wait_until(lambda: pool.queued == 1)
    clock.advance(2)
    pool.expire_overdue()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PrepareTimeout)
    release(blockers)
    wait_until(lambda: pool.running == 0)
    assert not ran.is_set()


def test_the_worker_skips_a_job_found_overdue_at_dequeue(
    make_pool: MakePool, clock: Any, wait_until: WaitUntil
) -> None:
    pool = make_pool(clock, workers=1, queue_timeout_ms=1000)
    blockers = occupy(pool, wait_until)
    ran = threading.Event()
    job = pool.submit(ran.set)
    clock.advance(2)  # nobody calls expire_overdue: the worker notices
    release(blockers)
    wait_until(job.done)
    assert job.outcome == "timeout"
    assert not ran.is_set()
    assert not job.started


def test_a_job_running_past_its_deadline_answers_504_and_is_counted_once(
    make_pool: MakePool, clock: Any, wait_until: WaitUntil
) -> None:
    pool = make_pool(clock, workers=1, queue_timeout_ms=1000, timeout_ms=5000)
    blocker = Blocker(result="late")
    job = pool.submit(blocker)
    wait_until(blocker.started.is_set)
    clock.advance(4.9)
    assert pool.expire_overdue() == 0
    clock.advance(0.2)
    assert pool.expire_overdue() == 1
    with pytest.raises(PrepareTimeout):
        job.result()
    assert pool.running == 1  # the thread still finishes the job in the background
    blocker.release.set()
    wait_until(lambda: pool.running == 0)
    assert job.outcome == "timeout"
    assert pool.outcomes == {"success": 0, "timeout": 1, "cancelled": 0, "failed": 0}
    assert pool.metrics.error_count("timeout") == 1
    assert pool.run(lambda: "still works") == "still works"


def test_a_clients_own_bound_ends_a_queued_and_a_running_job_as_its_timeout(
    make_pool: MakePool, clock: Any, wait_until: WaitUntil
) -> None:
    pool = make_pool(clock, workers=1, queue_timeout_ms=1000, timeout_ms=5000)
    blockers = occupy(pool, wait_until)
    ran = threading.Event()
    queued = pool.submit(ran.set, within_s=0.5)
    looser = pool.submit(ran.set, within_s=10.0)  # the pool's bound is tighter
    clock.advance(0.4)
    assert pool.expire_overdue() == 0
    clock.advance(0.2)
    assert pool.expire_overdue() == 1
    with pytest.raises(ClientTimeout) as info:
        queued.result()
    assert info.value.phase == "pool"
    clock.advance(0.5)
    assert pool.expire_overdue() == 1
    with pytest.raises(PrepareTimeout):
        looser.result()
    release(blockers)
    wait_until(lambda: pool.running == 0)
    assert not ran.is_set()
    # Running: the client's bound ends the wait, the thread finishes in the background.
    blocker = Blocker(result="late")
    running = pool.submit(blocker, within_s=1.0)
    wait_until(blocker.started.is_set)
    clock.advance(1.1)
    assert pool.expire_overdue() == 1
    with pytest.raises(ClientTimeout):
        running.result()
    blocker.release.set()
    wait_until(lambda: pool.running == 0)
    assert pool.outcomes["timeout"] == 3
    # No bound, or one <= 0, is the pool's alone.
    assert pool.run(lambda: "ok", within_s=0) == "ok"
    assert pool.run(lambda: "ok", within_s=None) == "ok"


def test_a_job_past_its_clients_bound_at_dequeue_never_runs(
    make_pool: MakePool, clock: Any, wait_until: WaitUntil
) -> None:
    pool = make_pool(clock, workers=1, queue_timeout_ms=1000)
    blockers = occupy(pool, wait_until)
    ran = threading.Event()
    job = pool.submit(ran.set, within_s=0.5)
    clock.advance(0.6)  # nobody calls expire_overdue: the worker notices
    release(blockers)
    wait_until(job.done)
    assert not ran.is_set()
    with pytest.raises(ClientTimeout):
        job.result()


def test_tiny_real_deadline_with_run(make_pool: MakePool) -> None:
    pool = make_pool(workers=1, queue_timeout_ms=20, timeout_ms=20)
    blocker = Blocker()
    try:
        with pytest.raises(PrepareTimeout):
            pool.run(blocker)
    finally:
        blocker.release.set()
    assert pool.outcomes["timeout"] == 1


def test_tiny_real_deadline_with_run_async(make_pool: MakePool) -> None:
    pool = make_pool(workers=1, queue_timeout_ms=20, timeout_ms=20)
    blocker = Blocker()

    async def main() -> None:
        await pool.run_async(blocker)

    try:
        with pytest.raises(PrepareTimeout):
            asyncio.run(main())
    finally:
        blocker.release.set()
    assert pool.outcomes["timeout"] == 1


# -- cancellation -----------------------------------------------------------------


def test_cancelling_the_awaiting_task_before_start_means_the_job_never_runs(
    make_pool: MakePool, wait_until: WaitUntil
) -> None:
    pool = make_pool(workers=1)
    blockers = occupy(pool, wait_until)
    ran = threading.Event()

    async def main() -> None:
        task = asyncio.create_task(pool.run_async(ran.set))
        while pool.queued == 0:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert pool.queued == 0
    release(blockers)
    wait_until(lambda: pool.running == 0)
    assert not ran.is_set()
    assert pool.outcomes["cancelled"] == 1
    assert pool.metrics.error_count("cancelled") == 1
    assert sum(pool.outcomes.values()) == 2  # the blocker succeeded


def test_cancelling_while_running_discards_the_result(
    make_pool: MakePool, wait_until: WaitUntil
) -> None:
    pool = make_pool(workers=1)
    blocker = Blocker()

    async def main() -> None:
        task = asyncio.create_task(pool.run_async(blocker))
        while not blocker.started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    blocker.release.set()
    wait_until(lambda: pool.running == 0)
    assert pool.outcomes == {"success": 0, "timeout": 0, "cancelled": 1, "failed": 0}


def test_job_cancel_settles_once(make_pool: MakePool, wait_until: WaitUntil) -> None:
    pool = make_pool(workers=1)
    blockers = occupy(pool, wait_until)
    job = pool.submit(lambda: "never")
    assert job.cancel()
    assert not job.cancel()
    with pytest.raises(JobCancelled):
        job.result()
    release(blockers)
    wait_until(lambda: pool.running == 0)
    assert pool.outcomes["cancelled"] == 1


# -- shutdown -----------------------------------------------------------------------


def test_shutdown_with_a_stuck_job_returns_after_the_grace(
    make_pool: MakePool, wait_until: WaitUntil
) -> None:
    pool = make_pool(workers=1, shutdown_grace_ms=50)
    stuck = Blocker()
    running = pool.submit(stuck)
    wait_until(stuck.started.is_set)
    ran = threading.Event()
    queued = pool.submit(ran.set)
    try:
        done = threading.Thread(target=pool.shutdown)
        done.start()
        done.join(10)  # bounded by the grace, not by the stuck job
        assert not done.is_alive()
        assert not pool.healthy
        with pytest.raises(PoolUnavailable):
            queued.result()
        with pytest.raises(PoolUnavailable):
            running.result()
        with pytest.raises(PoolUnavailable):
            pool.submit(lambda: None)
        assert pool.outcomes["cancelled"] == 2
        assert pool.metrics.error_count("unavailable") == 3
    finally:
        stuck.release.set()
    assert not ran.is_set()


def test_shutdown_waits_for_running_jobs_within_the_grace(make_pool: MakePool) -> None:
    pool = make_pool(workers=2, shutdown_grace_ms=10_000)
    jobs = [pool.submit(cast(Callable[[], int], lambda i=i: i)) for i in range(2)]
    for job in jobs:
        job.result()
    pool.shutdown(wait=True)
    assert pool.live_workers == 0
    assert pool.failure is None  # shut down, not failed
    pool.shutdown()  # idempotent


# -- pool failure -------------------------------------------------------------------


def test_a_killed_worker_makes_the_pool_unhealthy(make_pool: MakePool) -> None:
    pool = make_pool(workers=2)
    name = pool.kill_worker_for_testing()
    assert name.startswith("meshkit-prepare-")
    assert not pool.healthy
    assert pool.live_workers == 1
    assert sample(pool, "mesh_prepare_live_workers") == 1
    assert pool.failure is not None and name in pool.failure
    with pytest.raises(PoolUnavailable) as info:
        pool.submit(lambda: None)
    assert info.value.status == 503
    assert pool.metrics.error_count("unavailable") == 1


def test_a_base_exception_escaping_a_job_kills_its_worker(
    make_pool: MakePool, wait_until: WaitUntil
) -> None:
    pool = make_pool(workers=1)

    def exit_thread() -> None:
        raise SystemExit(3)

    blocker = Blocker()
    first = pool.submit(blocker)
    wait_until(blocker.started.is_set)
    killer = pool.submit(exit_thread)
    behind = pool.submit(lambda: "never")
    blocker.release.set()
    assert first.result() == "released"
    with pytest.raises(PoolUnavailable) as info:
        killer.result()
    assert isinstance(info.value.__cause__, SystemExit)
    # The last worker is gone: what was queued behind is cancelled, not left hanging.
    with pytest.raises(PoolUnavailable):
        behind.result()
    wait_until(lambda: pool.live_workers == 0)
    assert not pool.healthy
    assert pool.outcomes == {"success": 1, "timeout": 0, "cancelled": 1, "failed": 1}
