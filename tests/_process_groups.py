"""What still runs of a process group: for the tests that stop a vLLM server's whole group."""

from __future__ import annotations

import contextlib
import time
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
