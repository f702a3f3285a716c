"""meshkit.inline: a coroutine stepped from callbacks, handed to a Task for the rest.

On asyncio's own loop and on uvloop (the gateway's): what a Task would do must hold
on both sides of the hand-over (current task, cancellation and its count,
``asyncio.timeout``), and a step must never run inside a task or resume a
coroutine that was not given its value.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop

from meshkit.inline import CURRENT, Inline, at_once, in_task, stepping

Loop = asyncio.AbstractEventLoop


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> Iterator[Loop]:
    lp = asyncio.new_event_loop() if request.param == "asyncio" else uvloop.new_event_loop()
    yield lp
    lp.close()


def run(loop: Loop, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    loop.run_until_complete(asyncio.wait_for(body(), 5.0))


async def parked() -> Any:
    """What a protocol's waiter does: wait on the Inline stepping this coroutine."""
    inline = CURRENT.inline
    assert inline is not None
    return await inline


def test_a_parked_wait_resumes_in_step_itself_with_no_task(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro() -> None:
        seen.append(asyncio.current_task())
        seen.append(await parked())
        seen.append(asyncio.current_task())
        seen.append(await parked())

    async def body() -> None:
        before = asyncio.all_tasks()
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)  # from a callback, as data_received would
        await asyncio.sleep(0.01)
        assert seen == [inline]
        assert asyncio.all_tasks() == before  # no Task was made
        stepped = loop.create_future()

        def give_and_step(value: int) -> None:
            inline.give(value)
            inline.step()
            stepped.set_result(list(seen))  # what ran inside step() itself

        loop.call_soon(give_and_step, 7)
        assert await stepped == [inline, 7, inline]
        assert not inline.done()
        inline.give(8)
        inline.wake()  # through the loop
        await inline.finished()
        assert seen == [inline, 7, inline, 8]
        assert asyncio.all_tasks() == before
        assert CURRENT.inline is None

    run(loop, body)


def test_an_early_or_stale_step_does_not_resume(loop: Loop) -> None:
    resumed: list[int] = []

    async def coro() -> None:
        resumed.append(await parked())

    async def body() -> None:
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await asyncio.sleep(0)
        for _ in range(3):
            loop.call_soon(inline.step)  # nothing was given: nothing happens
        await asyncio.sleep(0.01)
        assert resumed == []
        assert not inline.done()
        inline.give(1)
        inline.wake()
        await inline.finished()
        assert resumed == [1]
        loop.call_soon(inline.step)  # after the end: nothing either
        await asyncio.sleep(0)

    run(loop, body)


def test_any_other_wait_hands_the_coroutine_to_a_task(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro() -> None:
        seen.append(asyncio.current_task())
        await asyncio.sleep(0.01)  # a future: a Task takes over when it is done
        seen.append(asyncio.current_task())
        await in_task()  # already in one: at once
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


def test_in_task_hands_over_at_once(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro() -> None:
        await in_task()
        seen.append(asyncio.current_task())

    async def body() -> None:
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await inline.finished()
        assert isinstance(seen[0], asyncio.Task)

    run(loop, body)


def test_a_cancel_while_parked_raises_at_the_await_and_uncancels_like_a_task(
    loop: Loop,
) -> None:
    seen: list[Any] = []

    async def coro() -> None:
        try:
            await parked()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            seen.append(task.cancelling())
            seen.append(task.uncancel())
        seen.append("went on")

    async def body() -> None:
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await asyncio.sleep(0)
        assert inline.cancel()
        await inline.finished()
        assert seen == [1, 0, "went on"]
        assert not inline.cancel()  # done: nothing to cancel

    run(loop, body)


def test_a_cancel_after_the_value_was_given_still_lands(loop: Loop) -> None:
    seen: list[Any] = []

    async def coro() -> None:
        try:
            seen.append(await parked())
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def body() -> None:
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await asyncio.sleep(0)
        inline.give(3)  # its step not yet run
        inline.wake()
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
            async with asyncio.timeout(0.02):  # asks for the current task: the Inline
                await asyncio.sleep(10)  # handed to a Task here
        except TimeoutError:
            seen.append("timed out")
        task = asyncio.current_task()
        assert task is not None
        seen.append(task.cancelling())

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


def test_another_threads_step_is_not_taken_for_this_loops(loop: Loop) -> None:
    """CURRENT is one slot for the process: the lifecycle's loop (another thread)
    asking while the gateway's Inline steps must not see it as its own."""
    seen: list[Any] = []
    other = asyncio.new_event_loop()

    async def coro() -> None:
        seen.append(stepping(loop))
        seen.append(stepping(other))
        CURRENT.inline = None  # another thread's step ended meanwhile
        await in_task()  # still handed over: decided per loop
        seen.append(asyncio.current_task())

    async def body() -> None:
        inline = Inline(loop, coro())
        loop.call_soon(inline.step)
        await inline.finished()
        assert seen[0] is inline
        assert seen[1] is None
        assert isinstance(seen[2], asyncio.Task)

    try:
        run(loop, body)
    finally:
        other.close()


def test_wake_ups_are_stepped_at_once_only_while_one_request_runs() -> None:
    """The built-in server counts its running requests in CURRENT.busy: a request
    about to start is stepped in its callback only when none runs, a running one
    only while it is alone (with more, the loop runs the woken ones together)."""
    before = CURRENT.busy
    try:
        CURRENT.busy = 0
        assert at_once(0) and at_once()
        CURRENT.busy = 1
        assert not at_once(0) and at_once()
        CURRENT.busy = 2
        assert not at_once()
    finally:
        CURRENT.busy = before
