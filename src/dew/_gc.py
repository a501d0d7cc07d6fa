"""Keeping Python's cyclic garbage collector off large data while it is built and used.

A full collection walks every object the collector tracks. A replay's trace holds hundreds of
thousands of them (its sessions, calls and events), so while the trace is read, every full
collection that the allocations set off walks all that was read so far, and while it is replayed,
every one walks the whole trace again: together about a quarter of a replay's time, for garbage
the trace does not hold (its records refer to no cycle).

And handing the C heap's freed pages back to the operating system (`return_freed_memory`),
which a training run's compilations leave resident, and keeping a run's weights out of that heap
(`map_large_blocks_apart`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import threading
from collections.abc import Iterator

# The servers in this process that hold a freeze (`frozen_while_serving`), and whether the
# first of them froze (it did not where the process had frozen objects already); and how many
# of this module's freezes are in force (`frozen`'s and the servers').
_serving = {"count": 0, "froze": False}
_freezes = {"held": 0}
_lock = threading.RLock()  # re-entered by a finalizer a collection under it runs


def _frozen_now() -> bool:
    """Whether objects are frozen: by a freeze of this module's (counted, free to ask), else by
    someone else's. `gc.get_freeze_count` walks every frozen object to count them: free where
    none are, 0.1-0.2 CPU-s under a freeze of a process that imported torch, transformers and
    vLLM beside dew (a test worker under its file's freeze, `collected`), where the replay test
    of 536 replays spent 156 CPU-s in it. So it is asked only where dew holds no freeze."""
    return _freezes["held"] > 0 or gc.get_freeze_count() > 0


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
    with _lock:
        froze = not _frozen_now()
        if froze:
            gc.freeze()
            _freezes["held"] += 1
    if not froze:
        yield
        return
    try:
        yield
    finally:
        gc.collect()
        with _lock:
            gc.unfreeze()
            _freezes["held"] -= 1


@contextlib.contextmanager
def collected() -> Iterator[None]:
    """Free the garbage cycles the block leaves as it ends, in a collection that walks only what
    was made since it began (`frozen`), or since a freeze made before it where there is one (a
    gateway serving in this process): never every object of the process, as a full collection
    does. For short-lived data that only the collector frees (an evaluation's engine, left in
    cycles by its trio runs): a full collection walked every module, function and array of a
    process that had imported torch and transformers beside dew, 0.4-0.5 CPU-s each time."""
    if not _frozen_now():
        with frozen():
            yield
        return
    try:
        yield
    finally:
        gc.collect()


@contextlib.contextmanager
def frozen_while_serving() -> Iterator[None]:
    """For a server in this process (the gateway): keep every object alive as the first one
    starts out of the collector's reach while it serves (`gc.freeze`), so that no full collection
    walks the imported modules, the model and the compiled functions while requests wait on it.
    The young generations are collected first, not all three: a full collection walked every
    object of the process at each start (0.4-0.5 CPU-s where torch and transformers were
    imported beside dew; nine of the test files start 108 gateways), and older garbage it
    would have freed is held while they serve, as everything frozen with it is.
    They are collectable again when the last such server stops (`gc.unfreeze`): a freeze kept
    after it stopped left garbage cycles among them never freed, and made `frozen` a no-op for
    every later replay in the process, whose full collections then walked all that was made
    since (a replay test ran four times slower after a gateway test in the same process).
    Where the process had frozen objects before the first server, it is left as it was."""
    with _lock:
        if _serving["count"] == 0 and not _frozen_now():
            gc.collect(1)
            gc.freeze()
            _serving["froze"] = True
            _freezes["held"] += 1
        _serving["count"] += 1
    try:
        yield
    finally:
        with _lock:
            _serving["count"] -= 1
            if _serving["count"] == 0 and _serving["froze"]:
                gc.unfreeze()
                _serving["froze"] = False
                _freezes["held"] -= 1


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the operating system (glibc's `malloc_trim(0)`);
    nothing where the C library has no such call.

    XLA's compiler allocates and frees many small blocks while it compiles a program, and glibc
    keeps what was freed in its arenas, resident: after SmolLM2-135M's update compiled, 0.40 GiB
    of the process's 1.00 GiB was such free memory (0.60 after the trim). A training step's
    buffers are allocated apart from it (mapped afresh), so it stood on top of every step's
    peak. A trim takes milliseconds; memory freed again after it needs no other call.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# glibc's `mallopt` parameter for the size from which a block is mapped apart (malloc.h).
_M_MMAP_THRESHOLD = -3
LARGE_BLOCK = 2**20
"""The size from which `map_large_blocks_apart` has a block mapped apart: 1 MiB."""


@functools.cache
def _mallopt():
    """glibc's `mallopt`, or None where the C library has none (macOS, musl)."""
    return getattr(ctypes.CDLL(None), "mallopt", None)


def map_large_blocks_apart() -> None:
    """Have the C heap map every block of `LARGE_BLOCK` bytes or more apart from itself and
    unmap it when it is freed (glibc's `mallopt(M_MMAP_THRESHOLD)`); nothing where the C library
    has no such call. For the rest of the process.

    glibc maps blocks of 128 KiB and more apart at first, but raises that bound to the size of
    each such block freed, up to 32 MiB, so after a run's first large arrays come and go, its
    weights of a few MiB a tensor (a layer's params: SmolLM2-135M's 0.4 to 3.5 MiB) are carved
    out of the heap. Freed there (the engine's copy replaced at each push, an evaluation's
    engine, a compilation's buffers), they leave holes that stay resident until a trim and that
    later allocations fill in pieces; and the XLA compilations that reuse them stand on top.
    Mapped apart, an array's pages go back to the system when it is freed. A fixed bound also
    ends glibc's raising of it. Measured on the README's SmolLM2-135M command at 64 new tokens
    cut to 15 layers (docs/checkpoints.md, "At 64 new tokens"): the heap held 0.42 GiB where it
    held up to 1.8.
    """
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK)
