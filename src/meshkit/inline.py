"""
Coroutines stepped where their bytes arrive
===========================================

A proxied request waits twice: for its client's bytes, then for the worker's
answer. Under an asyncio Task each wait ends in the loop: a future is made and
resolved, its done callback becomes a handle, the loop runs it in its next idle
phase, and the task's step machinery runs around the coroutine (uvloop's handles,
its idle callback, the GIL taken back for it, the task bookkeeping). Both waits end
in a protocol's ``data_received``, so :class:`Inline` resumes the coroutine right
there, once that callback has finished with its own state: 8 % fewer instructions
per one-client request (141.2K to 129.9K, completions 1 KiB; ``benchmarks/RESULTS.md``,
"Requests stepped where their bytes arrive").

Only a wait on the Inline itself (``await inline``: the built-in server's wait for
the next request, the fast upstream's waits for a head and for body bytes) is
resumed that way: its owner hands the value over with :meth:`Inline.give` and
calls :meth:`Inline.step` (at the end of its callback) or :meth:`Inline.wake`
(anywhere else). No future is made for it, and none is resolved. Any other future
the coroutine awaits (a connection being made, a pool slot, the prepare pool, a
sleep, a write waiting to drain) hands the coroutine to an asyncio Task once that
future is done, and it runs on there as it always did: a slow path keeps the loop's
exact semantics, and only the common path is stepped here.

While it steps, an Inline is the loop's current task, with a Task's ``cancel``,
``uncancel`` and ``cancelling`` (forwarded to the Task after a hand-over), so
``asyncio.timeout`` and a cancellation's bookkeeping work on either side of it.
A step never runs inside a task: one asked for there goes through the loop. The
request path's own code runs inline; code that is not meshkit's (the gateway's ASGI
app, httpcore under anyio) is reached through :func:`in_task`.
"""

from __future__ import annotations

import asyncio
from asyncio import tasks
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Final

__all__ = ["CURRENT", "Inline", "at_once", "in_task", "stepping"]

# asyncio's current-task registry (C functions): typed to take any task-like object
_enter_task: Final[Callable[[asyncio.AbstractEventLoop, Any], None]] = tasks._enter_task
_leave_task: Final[Callable[[asyncio.AbstractEventLoop, Any], None]] = tasks._leave_task

# states
_READY: Final = 0  # parked (or not started): step() resumes it once given its value
_RUNNING: Final = 1
_WAITING: Final = 2  # on a future: handed to a Task when it is done
_ADOPTED: Final = 3  # a Task runs it now
_DONE: Final = 4


class _Current:
    """The Inline stepping right now, in whichever thread (a compiled attribute read,
    not a global or thread-local lookup): read it through :func:`stepping`."""

    __slots__ = ("busy", "inline")

    def __init__(self) -> None:
        self.inline: Inline | None = None
        #: requests the built-in server is answering (all its connections)
        self.busy = 0


#: ``CURRENT.inline``: the Inline whose step is running, None in a Task or a callback.
#: One for the process: another thread's loop (the lifecycle's, another gateway's)
#: may step its own Inline while this one runs, so a reader checks the loop.
CURRENT: Final = _Current()


def at_once(running: int = 1) -> bool:
    """Whether a wake-up steps its Inline at the end of the callback that brought it
    (else on the loop's next turn, still with no future or Task): only while the
    server answers no more than ``running`` requests (the woken one's own included
    once it runs). With several in flight, stepping each inside its callback
    interleaves whole requests with the loop's reads, which cost more CPU per
    request than the loop running the woken ones together (16 clients: 1.2x the CPU
    of Tasks; ``benchmarks/RESULTS.md``)."""
    return CURRENT.busy <= running


def stepping(loop: asyncio.AbstractEventLoop) -> Inline | None:
    """The Inline stepping on ``loop`` now; None in a Task (or when another thread's
    step overwrote the slot: the caller then waits as a Task would, which hands
    the coroutine over, a slower path and never a wrong one)."""
    inline = CURRENT.inline
    if inline is not None and inline.loop is loop:
        return inline
    return None


class Inline:
    """A coroutine stepped from protocol callbacks (see the module docstring)."""

    __slots__ = (
        "_cancels",
        "_coro",
        "_finished",
        "_given",
        "_must_cancel",
        "_parked",
        "_state",
        "_task",
        "_value",
        "_waited",
        "loop",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> None:
        self.loop = loop
        self._coro = coro
        self._state = _READY
        self._parked = False  # in `await self`, until give()
        self._given = False
        self._value: Any = None
        self._waited: asyncio.Future[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._cancels = 0
        self._must_cancel = False
        self._finished: asyncio.Future[None] | None = None

    def __await__(self) -> Generator[Any, None, Any]:
        """Wait, parked here, for what the owner will :meth:`give` (only the
        coroutine this steps awaits it: ``CURRENT.inline`` is this object)."""
        self._parked = True
        self._given = False
        yield self
        value = self._value
        self._value = None
        return value

    def give(self, value: Any) -> None:
        """What the parked ``await`` returns; resume it with :meth:`step` (at the end
        of the owner's callback) or :meth:`wake` (anywhere else)."""
        self._value = value
        self._given = True

    def step(self) -> None:
        """Run the coroutine to its next wait, if it was given its value (a wake-up
        that is early or stale does nothing). Never inside a task."""
        if self._state != _READY or (self._parked and not self._given and not self._must_cancel):
            return
        loop = self.loop
        if stepping(loop) is not None:
            loop.call_soon(self.step)  # asked for inside another's step
            return
        try:
            _enter_task(loop, self)
        except RuntimeError:
            loop.call_soon(self.step)  # asked for inside a task
            return
        self._state = _RUNNING
        self._parked = False
        CURRENT.inline = self
        coro = self._coro
        try:
            if self._must_cancel:
                self._must_cancel = False
                waited = coro.throw(asyncio.CancelledError())
            else:
                waited = coro.send(None)
        except (StopIteration, asyncio.CancelledError):
            self._end()
            return
        except (KeyboardInterrupt, SystemExit):
            self._end()
            raise
        except BaseException as exc:
            self._end()
            loop.call_exception_handler(
                {"message": "unexpected error in a request", "exception": exc}
            )
            return
        finally:
            CURRENT.inline = None
            _leave_task(loop, self)
        if waited is self:
            self._state = _READY
            if self._must_cancel:
                loop.call_soon(self.step)
            return
        self._parked = False
        self._state = _WAITING
        if waited is None:  # a bare yield (asyncio.sleep(0)): the loop's next turn
            loop.call_soon(self._adopt, None)
            return
        self._waited = waited
        if self._must_cancel:
            waited.cancel()
        waited.add_done_callback(self._adopt)

    def wake(self) -> None:
        """:meth:`step` on the loop's next turn (for owners that are not at the end
        of a protocol callback: a timer, ``connection_lost``)."""
        self.loop.call_soon(self.step)

    # -- the hand-over -------------------------------------------------------------

    def _adopt(self, _: object) -> None:
        # The coroutine waits in a future's __await__; resumed after that future is
        # done, it takes the result (or the exception) as a Task would have given it.
        self._waited = None
        task = self._task = self.loop.create_task(self._coro)
        self._state = _ADOPTED
        if self._must_cancel:
            self._must_cancel = False
            task.cancel()
        task.add_done_callback(self._task_done)

    def _task_done(self, _: object) -> None:
        self._end()

    def _end(self) -> None:
        self._state = _DONE
        self._parked = False
        self._value = None
        finished = self._finished
        if finished is not None and not finished.done():
            finished.set_result(None)

    # -- what a Task offers (asyncio.current_task() is this object while it steps) --

    def done(self) -> bool:
        return self._state == _DONE

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop

    def cancel(self, msg: Any = None) -> bool:
        state = self._state
        if state == _DONE:
            return False
        task = self._task
        if task is not None:
            return task.cancel(msg)
        self._cancels += 1
        self._must_cancel = True  # thrown in at the next step, as a Task does
        if state == _READY:
            self.loop.call_soon(self.step)
        elif state == _WAITING:
            waited = self._waited
            if waited is not None:
                waited.cancel()
        return True

    def uncancel(self) -> int:
        task = self._task
        if task is not None:
            return task.uncancel()
        if self._cancels > 0:
            self._cancels -= 1
        return self._cancels

    def cancelling(self) -> int:
        task = self._task
        if task is not None:
            return task.cancelling()
        return self._cancels

    def finished(self) -> asyncio.Future[None]:
        """A future done when the coroutine has ended (here or in its Task)."""
        finished = self._finished
        if finished is None:
            finished = self._finished = self.loop.create_future()
            if self._state == _DONE:
                finished.set_result(None)
        return finished


async def in_task() -> None:
    """Go on in an asyncio Task (at once when already in one). Code that is not
    meshkit's runs there: anyio, under httpcore and the frameworks, keeps state per
    task (by weak reference) that an Inline does not have."""
    try:
        task = asyncio.current_task()  # per loop, unlike CURRENT
    except RuntimeError:
        return  # no asyncio loop runs (trio): no Inline either
    if isinstance(task, Inline):
        await asyncio.sleep(0)  # a bare yield: handed over on the loop's next turn
