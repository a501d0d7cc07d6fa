"""Small trio helpers shared by dew's modules."""

from __future__ import annotations

import contextlib
from types import TracebackType


async def exit_unwrapped(
    stack: contextlib.AsyncExitStack,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    traceback: TracebackType | None,
) -> bool:
    """Exit `stack`, which holds a nursery, letting a lone exception out as itself.

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
        if len(group.exceptions) != 1:
            raise
        if group.exceptions[0] is exc:
            return False
        raise group.exceptions[0] from None
