"""dew._gc: the garbage collector paused while a trace is read and frozen while it is replayed,
and left as it was found."""

from __future__ import annotations

import gc
import weakref

import pytest

from _gateway import ScriptedEngine
from dew import _gc
from dew.gateway import Gateway


class _Node:
    """An object that can sit in a reference cycle and be watched by a weak reference."""

    def __init__(self):
        self.other = None


def _walked(thing) -> bool:
    """Whether the collector's generations hold `thing` (frozen objects are in none of them)."""
    return any(tracked is thing for tracked in gc.get_objects())


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_freed():
    """This file's tests are of the freezes themselves: they run under none, where conftest.py's
    fixture of this name holds one of `dew._gc`'s over each other file."""
    yield


@pytest.fixture(autouse=True)
def _collector_as_found():
    # Each test starts with nothing frozen and leaves nothing frozen.
    assert _gc._freezes["held"] == 0
    gc.unfreeze()
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.parametrize("enabled", [True, False])
def test_paused_turns_collection_off_inside_and_back_as_it_was(enabled):
    if not enabled:
        gc.disable()
    with _gc.paused():
        assert not gc.isenabled()
    assert gc.isenabled() is enabled


def test_paused_turns_collection_back_on_after_an_error():
    with pytest.raises(RuntimeError), _gc.paused():
        raise RuntimeError("reading failed")
    assert gc.isenabled()


def test_frozen_keeps_what_was_alive_out_of_the_walk_and_frees_the_blocks_cycles():
    before = _Node()
    with _gc.frozen():
        assert gc.get_freeze_count() > 0
        assert not _walked(before)
        inside = _Node()
        inside.other = _Node()
        inside.other.other = inside  # a cycle that only a collection frees
        watch = weakref.ref(inside)
        del inside
    # Collected as the block ended, while the others were still out of the walk.
    assert watch() is None
    assert gc.get_freeze_count() == 0
    assert _walked(before)


def test_frozen_leaves_objects_someone_else_froze_frozen():
    theirs = _Node()
    gc.freeze()
    with _gc.frozen():
        pass
    # Still frozen (the count itself may drop: frozen objects are freed when unreferenced).
    assert gc.get_freeze_count() > 0 and not _walked(theirs)


def test_frozen_unfreezes_after_an_error():
    with pytest.raises(RuntimeError), _gc.frozen():
        raise RuntimeError("replay failed")
    assert gc.get_freeze_count() == 0


def _cycle() -> weakref.ref:
    """A reference cycle no name holds, which only a collection frees: a weak reference to it."""
    node = _Node()
    node.other = _Node()
    node.other.other = node
    return weakref.ref(node)


def test_collected_frees_the_blocks_cycles_without_walking_what_was_alive_before():
    before = _Node()
    with _gc.collected():
        assert not _walked(before)
        watch = _cycle()
    assert watch() is None
    assert gc.get_freeze_count() == 0 and _walked(before)


def test_collected_under_someone_elses_freeze_frees_the_blocks_cycles_and_keeps_theirs():
    theirs = _Node()
    gc.freeze()
    with _gc.collected():
        watch = _cycle()
    assert watch() is None
    assert gc.get_freeze_count() > 0 and not _walked(theirs)


def test_collected_frees_the_blocks_cycles_after_an_error():
    with pytest.raises(RuntimeError), _gc.collected():
        watch = _cycle()
        raise RuntimeError("evaluation failed")
    assert watch() is None
    assert gc.get_freeze_count() == 0


def test_frozen_while_serving_frees_the_garbage_just_made_before_it_freezes():
    watch = _cycle()
    with _gc.frozen_while_serving():
        assert watch() is None


@pytest.mark.medium
def test_frozen_while_serving_holds_the_freeze_until_the_last_server_stops():
    # Not `== frozen` below: a frozen object can still be freed by its reference count, and
    # another thread's were while a full suite ran (the count fell by 2 of 1.5 M). Objects made
    # between the two servers would be frozen by a second freeze: the count would grow by them.
    with _gc.frozen_while_serving():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made = [[] for _ in range(1000)]
        with _gc.frozen_while_serving():
            assert 0 < gc.get_freeze_count() <= frozen  # the second server froze nothing more
        assert 0 < gc.get_freeze_count() <= frozen  # nor did it unfreeze as it stopped
        del made
    assert gc.get_freeze_count() == 0
    # And after a server stopped, a replay's freeze is its own again.
    with _gc.frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.medium
def test_frozen_while_serving_leaves_a_freeze_made_before_it_as_it_was():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with _gc.frozen_while_serving():
            pass
        # Not unfrozen (the count would be 0) nor frozen again (it would grow by what was made
        # since). Not `== before`: a frozen object can still be freed by its reference count,
        # and another thread's were while a full suite ran (the count fell by 2 of 1.8 M).
        assert 0 < gc.get_freeze_count() <= before
    finally:
        gc.unfreeze()  # the rest of this process's tests run as they would alone


def test_under_a_freeze_of_dews_no_block_counts_the_frozen_objects(monkeypatch):
    """Counting them (`gc.get_freeze_count`) walks every frozen object: 0.1-0.2 CPU-s in a test
    worker under its file's freeze, asked twice by each replay (the cut-trace test replays 536
    times: 156 CPU-s). Under a freeze dew made, each block knows one is in force without it,
    and leaves it in force."""
    with _gc.frozen():
        frozen = gc.get_freeze_count()

        def counted():
            raise AssertionError("the frozen objects were counted")

        monkeypatch.setattr(gc, "get_freeze_count", counted)
        with _gc.frozen(), _gc.collected(), _gc.frozen_while_serving():
            watch = _cycle()
        assert watch() is None  # collected as `collected` ended
        monkeypatch.undo()
        assert 0 < gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0 and _gc._freezes["held"] == 0


def _gateway(engine, **kwargs) -> Gateway:
    return Gateway(engine, max_context=4096, max_tokens=256, announce=False, **kwargs)


@pytest.mark.medium
async def test_serving_moves_the_objects_alive_then_out_of_the_collectors_reach():
    # A full collection walks every object the cyclic collector tracks, and with jax imported
    # that stalls every request in flight for tens of milliseconds: the p99 of
    # benchmarks/gateway.py. Frozen objects are not walked, while the gateway serves: after
    # it, they are the collector's again (before, they stayed frozen for the process's life,
    # and every later replay in it ran four times slower).
    async with _gateway(ScriptedEngine(["a"]), freeze_gc=False):
        assert gc.get_freeze_count() == 0
    async with _gateway(ScriptedEngine(["a"])):
        # The imported modules at least: jax's alone are hundreds of thousands of objects.
        assert gc.get_freeze_count() > 100_000
        async with _gateway(ScriptedEngine(["b"])):  # a second gateway beside it
            assert gc.get_freeze_count() > 100_000
        assert gc.get_freeze_count() > 100_000  # the first still serves
    assert gc.get_freeze_count() == 0


_LARGE_BLOCK_PROBE = """
import ctypes, sys
from dew._gc import map_large_blocks_apart

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "apart":
    map_large_blocks_apart()
libc.free(libc.malloc(8 << 20))  # glibc raises its own bound to this block's size
mapped = libc.mallinfo2().hblks
block = libc.malloc(4 << 20)
print(libc.mallinfo2().hblks - mapped)
libc.free(block)
"""


@pytest.mark.parametrize("setting", ["default", "apart"])
def test_a_runs_weights_are_mapped_apart_from_the_heap_once_asked(setting):
    """glibc raises the size from which it maps a block apart to that of each such block freed:
    after an 8 MiB block came and went, a 4 MiB one (a layer's weights) is carved out of the
    heap, where it stays resident once freed until a trim. After `map_large_blocks_apart` every
    block of 1 MiB and more is mapped apart, and unmapped when freed. (In a process of its own:
    the setting holds for the rest of the process.)"""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        assert _gc._mallopt() is None
        return
    probe = [sys.executable, "-c", _LARGE_BLOCK_PROBE, setting]
    mapped = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    assert mapped == ("1" if setting == "apart" else "0")
