"""meshkit.inline: a coroutine stepped from callbacks, handed to a Task for the rest.

On asyncio's own loop and on uvloop (the gateway's): what a Task would do must hold
on both sides of the hand-over (current task, cancellation and its count,
``asyncio.timeout``), and a step must never run inside a task or resume a
coroutine whose future is not done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop

from meshkit.inline import CURRENT, Inline

Loop = asyncio.AbstractEventLoop


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> Iterator[Loop]:
    lp = asyncio.new_event_loop() if request.param == "asyncio" else uvloop.new_event_loop()
    yield lp
    lp.close()


def run(loop: Loop, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    loop.run_until_complete(asyncio.wait_for(body(), 5.0))


def test_a_parked_wait_resumes_in_step_itself_with_no_task(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro(fut: asyncio.Future[int]) -> None:
        seen.append(asyncio.current_task())
        assert CURRENT.inline is not None
        CURRENT.inline.park(fut)
        seen.append(await fut)
        seen.append(asyncio.current_task())

    async def body() -> None:
        before = asyncio.all_tasks()
        fut: asyncio.Future[int] = loop.create_future()
        # Stepped from a callback, as a protocol's data_received would.
        inline = Inline(loop, coro(fut))
        loop.call_soon(inline.step)
        await asyncio.sleep(0.01)
        assert seen == [inline]
        assert asyncio.all_tasks() == before  # no Task was made
        fut.set_result(7)
        stepped = loop.create_future()

        def resolve_and_step() -> None:
            inline.step()
            stepped.set_result(list(seen))  # what ran inside step() itself

        loop.call_soon(resolve_and_step)
        assert await stepped == [inline, 7, inline]
        assert inline.done()
        assert CURRENT.inline is None
        await inline.finished()

    run(loop, body)


def test_an_early_or_stale_step_does_not_resume(loop: Loop) -> None:
    resumed: list[int] = []

    async def coro(fut: asyncio.Future[int]) -> None:
        assert CURRENT.inline is not None
        CURRENT.inline.park(fut)
        resumed.append(await fut)

    async def body() -> None:
        fut: asyncio.Future[int] = loop.create_future()
        inline = Inline(loop, coro(fut))
        loop.call_soon(inline.step)
        await asyncio.sleep(0)
        for _ in range(3):
            loop.call_soon(inline.step)  # the future is not done: nothing happens
        await asyncio.sleep(0.01)
        assert resumed == []
        assert not inline.done()
        fut.set_result(1)
        inline.wake()  # through the loop
        await inline.finished()
        assert resumed == [1]
        loop.call_soon(inline.step)  # after the end: nothing either
        await asyncio.sleep(0)

    run(loop, body)


def test_any_other_wait_hands_the_coroutine_to_a_task(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro() -> None:
        seen.append(asyncio.current_task())
        await asyncio.sleep(0.01)  # not parked: a Task takes over when it is done
        seen.append(asyncio.current_task())
        await asyncio.sleep(0)
        seen.append("end")

    async def body() -> None:
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await inline.finished()
        assert seen[0] is inline
        assert isinstance(seen[1], asyncio.Task)
        assert seen[2] == "end"
        assert inline.done()

    run(loop, body)


def test_a_cancel_while_parked_raises_at_the_await_and_uncancels_like_a_task(
    loop: Loop,
) -> None:
    seen: list[Any] = []

    async def coro(fut: asyncio.Future[int]) -> None:
        assert CURRENT.inline is not None
        CURRENT.inline.park(fut)
        try:
            await fut
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            seen.append(task.cancelling())
            seen.append(task.uncancel())
        seen.append("went on")

    async def body() -> None:
        fut: asyncio.Future[int] = loop.create_future()
        inline = Inline(loop, coro(fut))
        loop.call_soon(inline.step)
        await asyncio.sleep(0)
        assert inline.cancel()
        await inline.finished()
        assert seen == [1, 0, "went on"]
        assert fut.cancelled()
        assert not inline.cancel()  # done: nothing to cancel

    run(loop, body)


def test_a_cancel_after_the_future_is_done_still_lands(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro(fut: asyncio.Future[int]) -> None:
        assert CURRENT.inline is not None
        CURRENT.inline.park(fut)
        try:
            seen.append(await fut)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def body() -> None:
        fut: asyncio.Future[int] = loop.create_future()
        inline = Inline(loop, coro(fut))
        loop.call_soon(inline.step)
        await asyncio.sleep(0)
        fut.set_result(3)  # resolved, its step not yet run
        inline.cancel()
        await inline.finished()
        assert seen == ["cancelled"]

    run(loop, body)


def test_a_cancel_while_waiting_for_the_hand_over_reaches_the_task(loop: Loop) -> None:
    seen: list[Any] = []
    started = asyncio.Event()

    async def coro() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert isinstance(task, asyncio.Task)
            seen.append(task.cancelling())
            raise

    async def body() -> None:
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await started.wait()
        assert not inline.done()
        assert inline.cancelling() == 0
        inline.cancel()
        await inline.finished()
        assert seen == [1]

    run(loop, body)


def test_a_timeout_entered_inline_expires_after_the_hand_over(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro() -> None:
        try:
            async with asyncio.timeout(0.02):  # asks the current task: the Inline
                await asyncio.sleep(10)  # handed to a Task here
        except TimeoutError:
            seen.append("timed out")
        seen.append(asyncio.current_task().cancelling())  # type: ignore[union-attr]

    async def body() -> None:
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await inline.finished()
        assert seen == ["timed out", 0]

    run(loop, body)


def test_a_step_asked_for_inside_a_task_runs_on_the_loop_instead(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro() -> None:
        seen.append(asyncio.current_task())

    async def body() -> None:
        me = asyncio.current_task()
        inline = Inline(loop, coro())
        inline.step()  # inside this task: not here
        assert seen == []
        assert asyncio.current_task() is me
        await inline.finished()
        assert seen == [inline]

    run(loop, body)


def test_an_error_ends_it_and_reaches_the_loops_handler(loop: Loop) -> None:
    caught: list[dict[str, Any]] = []

    async def coro() -> None:
        raise ValueError("boom")

    async def body() -> None:
        loop.set_exception_handler(lambda _, ctx: caught.append(ctx))
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await inline.finished()
        assert inline.done()
        assert isinstance(caught[0]["exception"], ValueError)

    run(loop, body)
