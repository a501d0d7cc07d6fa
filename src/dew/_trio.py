"""Small trio helpers shared by dew's modules."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def lone_exception() -> Iterator[None]:
    """Let a nursery's exception group that holds one exception out as that exception.

    A nursery wraps even a lone error of the caller's block; callers of dew's context managers
    want their own exception back, as they raised it.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
