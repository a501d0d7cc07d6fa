"""The processes dew starts end with the dew process that started them, on every exit path.

Whatever dew starts (an agent harness's command, a pool's trainer processes, an engine's server)
must not outlive the run: a harness left running keeps calling a gateway that is gone, a server
keeps its accelerator. Each exit path has its guard:

- an orderly end, an exception, Ctrl-C: the code that started a process stops it in a
  `finally` (it knows how: a harness's group is killed, a pool's processes get SIGTERM first);
- SIGTERM: `terminate_as_interrupt` (or `dew train`'s own handler) turns it into the same
  orderly stop as Ctrl-C, where Python's default would end the process without a `finally`;
- a crash (`kill -9`, a segfault, `os._exit`), where nothing in the process runs any more: a
  watchdog process, one per dew process, holds the read end of a pipe whose write end only the
  dew process holds. The kernel closes it when the dew process dies however it dies; the
  watchdog then reads the end of the pipe and kills every group still registered with it.

How to start a process so that it ends with the run (a new kind of process follows this too):

    process = subprocess.Popen(command, start_new_session=True)  # or trio's open_process
    with watched(process.pid):
        try:
            ...  # use it
        finally:
            ...  # stop it: kill_group(process.pid), or SIGTERM then SIGKILL, and wait for it

`start_new_session=True` puts the process in a group of its own (so a terminal's Ctrl-C reaches
dew alone, which stops its processes in order, and `kill_group` reaches what the process
started); `watched` registers the group with the watchdog for the time it runs. A worker process
that a library starts (`concurrent.futures`' pools) cannot be registered by its pid: give the
pool `initializer=end_with_parent, initargs=(os.getpid(),)` instead, and the kernel kills each
worker when dew dies.

The watchdog's pipe is not inherited by the processes started with `subprocess` or trio (their
descriptors close on exec); a process forked without exec (multiprocessing's "fork" context)
would keep it open, and the watchdog would then wait for that process to end too.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

GRACE = 2.0
"""Seconds the watchdog gives a group between SIGTERM and SIGKILL."""

# The watchdog: reads `+PGID` and `-PGID` lines until the pipe ends (the dew process is gone,
# or exits), then stops the groups still registered, SIGTERM first. Run with -I -S: it needs
# nothing but the standard library's built-in modules, and starts in milliseconds.
_WATCHDOG = f"""
import os, signal, sys, time
groups = set()
for line in sys.stdin.buffer:
    (groups.add if line[:1] == b"+" else groups.discard)(int(line[1:]))
def alive(group):
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
for sig in (signal.SIGTERM, signal.SIGKILL):
    for group in list(groups):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            groups.discard(group)
    ends = time.monotonic() + {GRACE}
    while groups and time.monotonic() < ends:
        time.sleep(0.05)
        groups = set(filter(alive, groups))
"""


class _Watchdog:
    """The watchdog process of this dew process and the groups registered with it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.groups: set[int] = set()
        self.process: subprocess.Popen | None = None
        self.owner = 0  # the pid that started it: a forked child needs a watchdog of its own

    def send(self, line: str) -> None:
        with self.lock:
            for attempt in range(2):
                self._start()
                try:
                    os.write(self.process.stdin.fileno(), line.encode())
                    return
                except BrokenPipeError:  # it was killed: a new one takes every group over
                    self.process = None
                    if attempt:
                        raise

    def _start(self) -> None:
        if self.process is not None and self.owner == os.getpid():
            return
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Out of dew's group: a Ctrl-C to dew's group must not stop it first.
            start_new_session=True,
        )
        self.owner = os.getpid()
        for group in self.groups:
            os.write(self.process.stdin.fileno(), f"+{group}\n".encode())

    def close(self) -> None:
        """At exit: end the pipe, and wait for the watchdog to stop what is left."""
        with self.lock:
            if self.process is None or self.owner != os.getpid():
                return
            self.process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=3 * GRACE)


_WATCHDOG_PROCESS = _Watchdog()
atexit.register(_WATCHDOG_PROCESS.close)


def watch(group: int) -> None:
    """Register process group `group` (a process started with `start_new_session=True`: its
    pid): should this process die before `unwatch(group)`, the watchdog kills the group."""
    with _WATCHDOG_PROCESS.lock:
        _WATCHDOG_PROCESS.groups.add(group)
    _WATCHDOG_PROCESS.send(f"+{group}\n")


def unwatch(group: int) -> None:
    """Take `group` off the watchdog's list: it has ended (or was stopped and waited for)."""
    with _WATCHDOG_PROCESS.lock:
        _WATCHDOG_PROCESS.groups.discard(group)
    _WATCHDOG_PROCESS.send(f"-{group}\n")


@contextlib.contextmanager
def watched(group: int) -> Iterator[None]:
    """`watch(group)` for the block; the block must stop the group before it ends."""
    watch(group)
    try:
        yield
    finally:
        unwatch(group)


def watchdog_pid() -> int | None:
    """The watchdog's pid, None before anything was watched (for tests and diagnostics)."""
    process = _WATCHDOG_PROCESS.process
    return None if process is None or _WATCHDOG_PROCESS.owner != os.getpid() else process.pid


def kill_group(group: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to process group `group`, if any process of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def end_with_parent(parent: int) -> None:
    """Have the kernel kill this process when the thread that started it ends (Linux's
    PR_SET_PDEATHSIG): a worker's initializer, with the pid of the process that starts the
    workers (`initargs=(os.getpid(),)`) and from its main thread. Elsewhere than Linux it does
    nothing.

    Raises:
        OSError: when the kernel refuses.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    # A parent that died before the call above sends nothing: this worker is on its own.
    if os.getppid() != parent:
        os._exit(1)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside, a SIGTERM raises KeyboardInterrupt as Ctrl-C does, so the process stops in order
    (its `finally` blocks stop what it started) rather than at once (main thread only; in
    another thread the block runs unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
