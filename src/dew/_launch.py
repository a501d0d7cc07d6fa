"""Run a pool of local processes as one: logs per process, the first failure stops them all.

`dew train --processes N` starts N trainer processes on this machine with `run_pool`. The pool
lives and dies together: the first process to fail (a non-zero exit, or a signal such as a
`kill -9`) is named, every other process is stopped (given a few seconds to stop by itself
first, saying why), and the pool's exit status is that first failure's. An interrupt (Ctrl-C)
or a SIGTERM to the launcher stops every process too; with `graceful`, the first interrupt is
passed on to each process as a Ctrl-C of its own (`dew train`'s stop the pool after the step in
progress, with its checkpoint), and only a second one stops them at once.

With `graceful`, the processes start with SIGINT and SIGTERM blocked, and each unblocks them once it
can stop after a step (`dew train`'s `_CtrlC`): an interrupt passed on while a process still starts
waits for it there. Delivered at once, it would land anywhere in the start-up: where a callback
ignores exceptions (jax's garbage-collection hook swallows the KeyboardInterrupt, and that process
then trained to its last step), or in one process and not the next, which would then wait for it in
`jax.distributed.initialize`.

Each process runs in a session of its own, so a terminal's Ctrl-C reaches the launcher alone and
the launcher stops the processes in a known order, rather than each racing to unwind on its own.
Should the launcher itself die (`kill -9`), its watchdog stops them (`dew._processes`).
"""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, TextIO

from dew._processes import kill_group, terminate_as_interrupt, unwatch, watch

# Seconds a stopped process has to exit after SIGTERM before it is killed.
GRACE = 5.0


def run_pool(
    commands: Sequence[Sequence[str]],
    logs: Sequence[Path],
    *,
    echo: TextIO | None = None,
    env: Mapping[str, str] | None = None,
    report: TextIO | None = None,
    grace: float = GRACE,
    graceful: bool = False,
) -> int:
    """Run one process per command until every one has ended; return the pool's exit status.

    Args:
        commands: each process's argv, process i's at index i.
        logs: where each process's standard output and error go, written as they come and
            appended to what the files hold (a resumed pool's logs follow the earlier run's,
            whose end says why it stopped).
        echo: where process 0's output is also copied, line by line (the run's one console).
        env: the processes' environment (the launcher's when None).
        report: where the launcher says which process failed and what it stops.
        grace: seconds a stopped process has between SIGTERM and SIGKILL.
        graceful: on the first interrupt, send each process SIGINT (to it alone, not to what
            it started) and wait for them to end by themselves; a second interrupt stops them.
            The processes start with SIGINT and SIGTERM blocked: each must unblock them when it
            is ready to take one (`signal.pthread_sigmask`), as `dew train` does.

    Returns:
        0 when every process exits 0; else the first failure's exit status (128 + the signal
        for a process a signal ended); 130 after an interrupt or SIGTERM to the launcher.

    Raises:
        ValueError: unless there is one log per command and at least one command.
    """
    if not commands or len(logs) != len(commands):
        raise ValueError(
            f"run_pool needs one log per command and at least one command, got "
            f"{len(commands)} commands and {len(logs)} logs"
        )
    ended: queue.Queue[int] = queue.Queue()
    processes: list[subprocess.Popen] = []
    waiters: list[threading.Thread] = []
    with contextlib.ExitStack() as stack, terminate_as_interrupt():
        try:
            # An interrupt or SIGTERM while the processes start is taken once all have started
            # (it was held back meanwhile): each process gets it, none is left unstarted.
            with _interrupts_held() if graceful else contextlib.nullcontext():
                for index, (command, log) in enumerate(zip(commands, logs, strict=True)):
                    file = stack.enter_context(open(log, "ab"))
                    process, waiter = _start(index, command, file, echo, env, ended)
                    # Stopped below; should the launcher die, the watchdog stops it.
                    stack.callback(unwatch, process.pid)
                    processes.append(process)
                    waiters.append(waiter)
            return _watch(processes, ended, report, grace)
        except KeyboardInterrupt:
            if graceful:
                _pass_on_interrupt(processes, ended, report)
            else:
                _say(report, f"interrupted: stopping {_names(range(len(processes)))}")
            _stop(processes, grace)
            return 130
        finally:
            _stop(processes, grace)
            for waiter in waiters:
                waiter.join()


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell shows it: 128 + the signal for a process a signal ended."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """How a process ended, in words: `exit status 3`, `killed by SIGKILL`."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def _start(
    index: int,
    command: Sequence[str],
    log: BinaryIO,
    echo: TextIO | None,
    env: Mapping[str, str] | None,
    ended: queue.Queue[int],
) -> tuple[subprocess.Popen, threading.Thread]:
    """Start process `index`, and the thread that puts its index on `ended` when it exits (so
    the order of `ended` is the order the processes ended in), which ends with it."""
    piped = echo is not None and index == 0
    process = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE if piped else log,
        stderr=subprocess.STDOUT,
        env=None if env is None else dict(env),
        start_new_session=True,
    )
    watch(process.pid)

    def wait() -> None:
        if piped:
            with process.stdout:
                for line in process.stdout:
                    log.write(line)
                    log.flush()
                    echo.write(line.decode(errors="replace"))
                    echo.flush()
        process.wait()
        ended.put(index)

    waiter = threading.Thread(target=wait, name=f"dew-pool-{index}", daemon=True)
    waiter.start()
    return process, waiter


def _watch(
    processes: list[subprocess.Popen], ended: queue.Queue[int], report: TextIO | None, grace: float
) -> int:
    """Wait for every process; on the first failure name it and stop the others."""
    status = 0
    for _ in processes:
        # A timeout keeps the main thread responsive to Ctrl-C while it waits.
        index = _next(ended)
        code = processes[index].returncode
        if code != 0 and status == 0:
            status = exit_status(code)
            running = [i for i, p in enumerate(processes) if p.poll() is None]
            stopping = f"; stopping {_names(running)}" if running else ""
            _say(report, f"process {index} failed first ({describe_exit(code)}){stopping}")
            # The others lose it in their next collective and stop by themselves, each saying
            # why: they get `grace` seconds to, before they are stopped.
            _stop(processes, grace, patience=grace, report=report)
    return status


def _pass_on_interrupt(
    processes: list[subprocess.Popen], ended: queue.Queue[int], report: TextIO | None
) -> None:
    """Send each running process SIGINT and wait until all have ended; a second interrupt ends
    the wait (the caller then stops what is left)."""
    _say(report, "interrupted: the pool stops after its step in progress (Ctrl-C again: at once)")
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGINT)
    try:
        while any(process.poll() is None for process in processes):
            with contextlib.suppress(queue.Empty):
                ended.get(timeout=0.5)
    except KeyboardInterrupt:
        running = [i for i, process in enumerate(processes) if process.poll() is None]
        _say(report, f"interrupted again: stopping {_names(running)}")


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread for the block: the processes it starts inherit
    the blocked signals (through exec), and one that arrives meanwhile is delivered when the
    block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _next(ended: queue.Queue[int]) -> int:
    while True:
        with contextlib.suppress(queue.Empty):
            return ended.get(timeout=0.5)


def _stop(
    processes: list[subprocess.Popen],
    grace: float,
    *,
    patience: float = 0.0,
    report: TextIO | None = None,
) -> None:
    """Wait `patience` seconds for the running processes to end, then SIGTERM every running
    process's session, then SIGKILL what is left after `grace`; with a `report`, say which
    processes outlived `patience` (they did not stop by themselves, as they should have)."""
    ends = time.monotonic() + patience
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, ends - time.monotonic()))
    running = [index for index, process in enumerate(processes) if process.poll() is None]
    if running and patience:
        _say(report, f"{_names(running)} still running after {patience:g}s: sending SIGTERM")
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        running = [p for p in processes if p.poll() is None]
        for process in running:
            kill_group(process.pid, sig)
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait)


def _names(indices) -> str:
    indices = list(indices)
    if len(indices) == 1:
        return f"process {indices[0]}"
    return f"processes {', '.join(map(str, indices))}"


def _say(report: TextIO | None, text: str) -> None:
    if report is not None:
        report.write(f"dew: {text}\n")
        report.flush()
