"""exit_unwrapped: what leaves an async context manager that runs a nursery."""

from __future__ import annotations

import contextlib

import pytest
import trio

from dew._trio import exit_unwrapped


class Serving:
    """The shape of dew's async context managers: a nursery of their own, entered in
    `__aenter__`, its tasks running beside the caller's block."""

    def __init__(self, *tasks):
        self.tasks = tasks

    async def __aenter__(self):
        self.stack = contextlib.AsyncExitStack()
        nursery = await self.stack.enter_async_context(trio.open_nursery())
        for task in self.tasks:
            nursery.start_soon(task)
        return nursery

    async def __aexit__(self, *exc_info):
        return await exit_unwrapped(self.stack, *exc_info)


async def fail(message: str, after: float = 0) -> None:
    # Without a checkpoint before it, an error cannot be pre-empted by another's cancellation.
    if after:
        await trio.sleep(after)
    raise RuntimeError(message)


async def test_the_callers_own_error_leaves_whole(autojump_clock):
    with pytest.raises(ValueError) as raised:
        async with Serving() as nursery:
            nursery.start_soon(trio.sleep_forever)
            try:
                raise KeyError("first")
            except KeyError:
                raise ValueError("mine") from None
    assert str(raised.value) == "mine"
    # Left to `async with` to re-raise: what it was raised from is not rewritten.
    assert raised.value.__suppress_context__
    assert isinstance(raised.value.__context__, KeyError)


async def test_an_error_raised_during_another_keeps_its_context(autojump_clock):
    with pytest.raises(ValueError) as raised:
        async with Serving():
            try:
                raise KeyError("first")
            except KeyError:
                raise ValueError("second")  # noqa: B904 (the context is what is checked)
    assert isinstance(raised.value.__context__, KeyError)
    assert not raised.value.__suppress_context__


async def test_a_lone_error_of_a_task_leaves_as_itself(autojump_clock):
    with pytest.raises(RuntimeError, match="^engine broke$"):
        async with Serving(lambda: fail("engine broke", after=1)):
            await trio.sleep_forever()


async def test_two_errors_leave_as_their_group(autojump_clock):
    with pytest.raises(BaseExceptionGroup) as raised:
        async with Serving(lambda: fail("a"), lambda: fail("b")):
            await trio.sleep_forever()
    assert sorted(str(e) for e in raised.value.exceptions) == ["a", "b"]


async def test_a_clean_exit_is_clean(autojump_clock):
    async with Serving() as nursery:
        nursery.start_soon(trio.sleep, 1)
    assert trio.current_time() == 1
