"""Small trio helpers shared by dew's modules."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def lone_exception() -> Iterator[None]:
    """Let a nursery's exception group that holds one exception out as that exception, and a
    KeyboardInterrupt or SystemExit anywhere in a group out as itself, once.

    A nursery wraps even a lone error of the caller's block; callers of dew's context managers
    want their own exception back, as they raised it.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if (stop := stop_in(group)) is not None:
            raise stop from None
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
