"""proxy.core.asgi.Deadline, infertap's asyncio.timeout for a deadline that never moves: the same
answer as asyncio.timeout's in each case that tells them apart (the block ends, the deadline runs
out, the task is cancelled from outside, both at once, nested deadlines), on uvloop and on
asyncio's own loop. Driven by the loop's turns, not by how long anything takes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import uvloop

from proxy.core.asgi import Deadline, current_task

Limit = Callable[[float], AbstractAsyncContextManager[Any]]
LIMITS: dict[str, Limit] = {"asyncio.timeout": asyncio.timeout, "Deadline": Deadline}
NEVER = 3600.0  # a deadline that does not run out within a test
NOW = 0.0  # one that runs out at the loop's next turn


async def _ends(limit: Limit) -> str:
    async with limit(NEVER):
        await asyncio.sleep(0)
    return "ended"


async def _runs_out(limit: Limit) -> str:
    async with limit(NOW):
        await asyncio.sleep(NEVER)
    return "ended"


async def _cancelled_from_outside(limit: Limit) -> str:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().call_soon(task.cancel)
    async with limit(NEVER):
        await asyncio.sleep(NEVER)
    return "ended"


async def _runs_out_and_cancelled(limit: Limit) -> str:
    task = asyncio.current_task()
    assert task is not None
    async with limit(NOW):
        asyncio.get_running_loop().call_soon(task.cancel)  # a second cancellation, not the deadline's
        await asyncio.sleep(NEVER)
    return "ended"


async def _inner_runs_out(limit: Limit) -> str:
    async with limit(NEVER):
        try:
            async with limit(NOW):
                await asyncio.sleep(NEVER)
        except TimeoutError:
            await asyncio.sleep(0)  # the outer one goes on, uncancelled
            return "inner ran out"
    return "ended"


async def _outer_runs_out(limit: Limit) -> str:
    async with limit(NOW):
        async with limit(NEVER):
            await asyncio.sleep(NEVER)
    return "ended"


async def _raises_inside(limit: Limit) -> str:
    async with limit(NEVER):
        raise KeyError("the body's own")


CASES: dict[str, Callable[[Limit], Coroutine[Any, Any, str]]] = {
    "ends": _ends,
    "runs out": _runs_out,
    "cancelled from outside": _cancelled_from_outside,
    "runs out and cancelled": _runs_out_and_cancelled,
    "inner runs out": _inner_runs_out,
    "outer runs out": _outer_runs_out,
    "raises inside": _raises_inside,
}


def _outcome(run: Callable[[Coroutine[Any, Any, Any]], Any], case: str, limit: Limit) -> tuple[str, int]:
    async def main() -> tuple[str, int]:
        task = asyncio.create_task(CASES[case](limit))
        try:
            result = await task
        except BaseException as e:  # noqa: BLE001 (the outcome is the exception's type)
            result = type(e).__name__
        return result, task.cancelling()

    return run(main())  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_deadline_answers_as_asyncio_timeout(
    case: str, run: Callable[[Coroutine[Any, Any, Any]], Any]
) -> None:
    expected = _outcome(run, case, LIMITS["asyncio.timeout"])
    assert _outcome(run, case, LIMITS["Deadline"]) == expected
    assert expected[0] != "ended" or case == "ends"  # each case tells something apart


def test_current_task_follows_the_running_loop() -> None:
    """It keeps the loop it found: a later loop (a test's own, a worker's) is found anew."""
    seen = []

    async def main() -> None:
        task = current_task()
        assert task is asyncio.current_task()
        seen.append(task)

    asyncio.run(main())
    uvloop.run(main())
    asyncio.run(main())
    assert len(set(map(id, seen))) == 3
    with pytest.raises(RuntimeError):
        current_task()


def test_current_task_is_this_threads_while_another_threads_loop_runs_a_task() -> None:
    """Two loops in two threads, as the tests' servers run: while a task of the other thread's loop
    is running, current_task() here is still this thread's task. (It kept the loop it last found,
    and answered with the other thread's task: that task's deadline timer then went onto the other
    loop from this thread, and its cancellation to the wrong request; found by a failing CI run.)"""
    inside = threading.Event()
    release = threading.Event()
    theirs: list[asyncio.Task[Any]] = []

    async def busy() -> None:
        theirs.append(current_task())
        inside.set()
        release.wait(30)  # blocks inside the task's step: it stays its loop's current task

    other = threading.Thread(target=lambda: asyncio.run(busy()))
    other.start()
    try:
        assert inside.wait(30)

        async def mine() -> tuple[asyncio.Task[Any], asyncio.Task[Any] | None]:
            return current_task(), asyncio.current_task()

        found, expected = uvloop.run(mine())
        assert found is expected
        assert found is not theirs[0]
    finally:
        release.set()
        other.join(30)
