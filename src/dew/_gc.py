"""Keeping Python's cyclic garbage collector off large data while it is built and used.

A full collection walks every object the collector tracks. A replay's trace holds hundreds of
thousands of them (its sessions, calls and events), so while the trace is read, every full
collection that the allocations set off walks all that was read so far, and while it is replayed,
every one walks the whole trace again: together about a quarter of a replay's time, for garbage
the trace does not hold (its records refer to no cycle).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block, for code that builds many objects and makes no
    cyclic garbage; collection resumes after it, as it was. The collector is the process's, so
    other threads go without it meanwhile: keep the block to one bounded piece of work."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Leave every object alive as the block starts out of the collections inside it
    (`gc.freeze`); they are collectable again after it (`gc.unfreeze`), garbage among them
    included, so nothing is collected first (a full collection, the walk this avoids). Objects
    made inside are collected as usual, and once more as the block ends, while the others are
    still out of the walk: garbage cycles the block left (a replay's scheduler and source refer
    to each other, and through the source to its trace) are freed then, not by the next full
    collection, which would walk everything, at the process's exit if not before. Where
    something else froze objects already (a gateway serving in this process), the block
    changes nothing, so as not to unfreeze them."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()
