"""Small trio helpers shared by dew's modules."""

from __future__ import annotations

import contextlib
import contextvars
import queue
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import trio

# Exceptions that ask the program to stop: they come out as themselves, once, whatever nursery
# groups they crossed, since nobody writes `except*` for them.
STOPS = (KeyboardInterrupt, SystemExit)


def stop_in(error: BaseException | None) -> BaseException | None:
    """The first KeyboardInterrupt or SystemExit in an exception or its nested groups, or None."""
    if isinstance(error, STOPS):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            if (stop := stop_in(inner)) is not None:
                return stop
    return None


async def exit_unwrapped(
    stack: contextlib.AsyncExitStack,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    traceback: TracebackType | None,
) -> bool:
    """Exit `stack`, which holds a nursery, letting a lone exception out as itself, and a
    KeyboardInterrupt or SystemExit anywhere in its groups out as itself, once.

    A nursery wraps even a lone error of the caller's block in an exception group; callers of
    dew's async context managers (the scheduler, the rollout server, the replay source) want
    their own exception back as they raised it, and a lone error of the nursery's tasks as
    itself. The caller's own exception is left for `async with` to re-raise, so its traceback
    and context stay whole; a group of two or more is raised as it is.

    Args:
        stack: the context manager's exit stack, entered in its `__aenter__`.
        exc_type, exc, traceback: what `__aexit__` was given.

    Returns:
        whether `stack` swallowed the caller's exception (as `__aexit__` returns it).
    """
    try:
        return bool(await stack.__aexit__(exc_type, exc, traceback))
    except BaseExceptionGroup as group:
        if (stop := stop_in(group)) is not None:
            if stop is exc:
                return False
            raise stop from None
        if len(group.exceptions) != 1:
            raise
        if group.exceptions[0] is exc:
            return False
        raise group.exceptions[0] from None


_SLICE = 0.25
"""How long `run_from_thread`'s caller waits at a time (seconds): a Python signal handler, such
as `dew train`'s for Ctrl-C and SIGTERM, runs between slices."""


def run_from_thread(
    afn: Callable[..., Awaitable[Any]], *args: Any, trio_token: trio.lowlevel.TrioToken
) -> Any:
    """`trio.from_thread.run(afn, *args, trio_token=trio_token)`, whose caller waits in slices.

    trio's version waits on a lock with no timeout. Python runs signal handlers in the main
    thread only, and a process's signal that Linux hands to another thread (it may, where the
    main thread already has one pending, or to a thread whose id `kill` named) interrupts no
    wait of the main one: a trainer waiting on a batch that never came did not answer a SIGTERM
    for as long as it waited. Waiting in slices, its handler runs within `_SLICE` seconds.

    Raises what `afn` raises, `trio.RunFinishedError` where the run has ended, and
    `trio.Cancelled` where it ends while `afn` runs, as trio's does.
    """
    done: queue.SimpleQueue = queue.SimpleQueue()

    async def call() -> None:
        try:
            done.put((True, await afn(*args)))
        except BaseException as error:  # the caller's thread raises it
            done.put((False, error))

    def spawn() -> None:
        try:
            trio.lowlevel.spawn_system_task(call, name=afn, context=context)
        except RuntimeError:  # the system nursery is closed: the run is ending
            done.put((False, trio.RunFinishedError("the trio run has ended")))

    context = contextvars.copy_context()
    trio_token.run_sync_soon(spawn)
    while True:
        try:
            ok, value = done.get(timeout=_SLICE)
        except queue.Empty:
            continue
        if ok:
            return value
        raise value
