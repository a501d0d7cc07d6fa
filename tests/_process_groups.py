"""What still runs of a process group, and a process group run in slow motion: for the tests
that stop a vLLM server's whole group."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def running_in_group(group: int) -> list[int]:
    """The processes of process group `group` that have not exited: its zombies, which wait
    for the system to reap them once their parent is gone, are not counted."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # The fields after the command's closing parenthesis: state, ppid, pgrp, ...
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == group and state not in ("Z", "X"):
                running.append(int(stat.parent.name))
    return running


def left_running(group: int, seconds: float = 30.0) -> list[int]:
    """The processes of `group` still running after up to `seconds`: a group's processes
    other than its leader end moments after it (they exit once their parent is gone)."""
    deadline = time.monotonic() + seconds
    while (running := running_in_group(group)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def signal_all(groups: list[int], number: int) -> None:
    """Send a signal to every process of the process groups `groups`."""
    for group in groups:
        os.killpg(group, number)


@contextlib.contextmanager
def slow_motion(groups: list[int], running: float = 0.005, stopped: float = 0.05) -> Iterator[None]:
    """Run the process groups `groups` (vLLM servers) in slices while the body runs: `running`
    seconds, then stopped (SIGSTOP) for `stopped` seconds; running freely again after it.

    A tiny model's server draws a call's hundreds of tokens in a few hundred ms, so a test that
    reads a call's progress to act in the middle of it (a push while it runs) races the
    servers: under a loaded machine they had drawn every token by the client's first read. In
    slices, what the servers do between two of the test's reads is bounded by the CPU a slice
    gives them, whatever the machine's load, and their work for the test's own requests (a
    pause, a push) takes slices in the same way. The slices are cut by a thread of their own,
    so that the test's trio loop, busy for a while (a call's first request), cannot stretch
    one (it did: two calls drew all their 100 tokens in a slice cut by a trio task)."""
    done = threading.Event()

    def slice_until_done() -> None:
        while not done.is_set():
            signal_all(groups, signal.SIGSTOP)
            done.wait(stopped)
            signal_all(groups, signal.SIGCONT)
            time.sleep(running)

    slicer = threading.Thread(target=slice_until_done, name="slow motion", daemon=True)
    slicer.start()
    try:
        yield
    finally:
        done.set()
        slicer.join()
        signal_all(groups, signal.SIGCONT)
