"""What still runs of a process group, and a process group run in slow motion: for the tests
that stop a vLLM server's whole group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
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


_SLICER = """
import os, signal, sys, time
running, stopped, parent = float(sys.argv[1]), float(sys.argv[2]), os.getppid()
groups = [int(group) for group in sys.argv[3:]]
try:  # woken on time to stop the servers however loaded the machine (where one may ask it)
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
except PermissionError:
    pass
while os.getppid() == parent:  # a slicer whose test died ends, leaving the servers running
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    if not sys.stdout.closed:  # the servers' first stop: the test goes on
        print("stopped", flush=True)
        sys.stdout.close()
    time.sleep(stopped)
    for group in groups:
        os.killpg(group, signal.SIGCONT)
    time.sleep(running)
"""


@contextlib.contextmanager
def slow_motion(groups: list[int], running: float = 0.005, stopped: float = 0.05) -> Iterator[None]:
    """Run the process groups `groups` (vLLM servers) in slices while the body runs: `running`
    seconds, then stopped (SIGSTOP) for `stopped` seconds; running freely again after it.

    A tiny model's server draws a call's hundreds of tokens in a few hundred ms, so a test that
    reads a call's progress to act in the middle of it (a push while it runs) races the
    servers: under a loaded machine they had drawn every token by the client's first read. In
    slices, what the servers do between two of the test's reads is bounded by the CPU a slice
    gives them, whatever the machine's load, and their work for the test's own requests (a
    pause, a push) takes slices in the same way. The slices are cut by a process of its own:
    cut by the test's trio loop, a slice lasted as long as the loop was busy (two calls drew
    all their 100 tokens in one), and by a thread, as long as another thread held the GIL (an
    old call drew all its 240 tokens while a push wrote its adapter). That process runs at a
    real-time priority where the system allows it (root): at a normal one, on a machine
    loaded by the suite's other worker, a slice may last until the scheduler next runs it,
    and a whole-suite run saw an old call draw all its 240 tokens before a new call came."""
    command = [sys.executable, "-c", _SLICER, str(running), str(stopped), *map(str, groups)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as slicer:
        try:
            if slicer.stdout.readline() != "stopped\n":
                raise RuntimeError(f"the slow-motion process ended with {slicer.wait()}")
            yield
        finally:
            slicer.kill()
            slicer.wait()  # before the servers go on: it stops them no more
            signal_all(groups, signal.SIGCONT)
