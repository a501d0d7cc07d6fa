"""Ctrl-C in `dew train`: the first press stops the run after the step in progress, with its
checkpoint; the second stops it at once; later ones are ignored while it exits."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

INTERRUPTED = 128 + signal.SIGINT
"""`dew train`'s exit status when Ctrl-C stopped it (the shell's convention for SIGINT)."""


class _Interrupted(Exception):
    """Raised by `_CtrlC.after`'s callback once a step has ended after a Ctrl-C: `train` saves
    that step's checkpoint and lets it through.

    Args:
        updates: the updates of the step that ended.
    """

    def __init__(self, updates: int):
        super().__init__(f"interrupted after {updates} updates")
        self.updates = updates


class _CtrlC:
    """Ctrl-C for `dew train`, as a context: the first press stops the run after the step in
    progress, with that step's checkpoint; the second stops it at once (KeyboardInterrupt);
    later ones are ignored while it cleans up and exits, so none lands in an atexit callback.

    A KeyboardInterrupt at an arbitrary moment could land between the update of the weights
    and that of the step count, so the first press only asks; the step's end answers (`after`).

    Args:
        terminate: take a SIGTERM (what `kill`, a job scheduler or a container's stop send) as
            a press too: by default it would end the process at once, with no `finally` block
            run, and the processes the run started (a harness's commands) left behind.
    """

    def __init__(self, *, terminate: bool = False):
        self.presses = 0
        self._signals = (signal.SIGINT, signal.SIGTERM) if terminate else (signal.SIGINT,)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _CtrlC:
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, self._press)
        # A pool's launcher starts its processes with both blocked (`dew._launch.run_pool`):
        # one sent while this process started is delivered here, a press from now on.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        return self

    def __exit__(self, *exc_info) -> None:
        # The handlers before it come back: `dew.cli.main` may run in a process that goes on
        # (a notebook, a test), whose later Ctrl-C must work, and whose child processes would
        # inherit an ignored SIGINT. The `dew` command ignores a press once it is on its way
        # out (`dew._command`).
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _press(self, signum, frame) -> None:
        self.presses += 1
        if self.presses > 1:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            raise KeyboardInterrupt
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        _say(
            f"dew train: {name}: stopping after the step in progress, with its checkpoint "
            f"({name} again stops at once)"
        )

    def after(
        self,
        on_step: Callable[[Mapping[str, Any]], None],
        steps: int,
        *,
        agree: Callable[[bool], bool] | None = None,
    ):
        """`on_step`, then, after a press, stop the run: the step is logged and complete. The
        last of `steps` ends the run anyway, which then finishes as usual (curves and all).

        Args:
            agree: in a pool, whether any process was pressed, given this one's answer: a
                collective every process makes after each step, so that all stop after the
                same step even where the presses reach them on either side of its end.
        """

        def step_ended(line: Mapping[str, Any]) -> None:
            on_step(line)
            if line["updates"] >= steps:
                return
            pressed = self.presses > 0
            if agree is not None:
                pressed = agree(pressed)
            if pressed:
                raise _Interrupted(line["updates"])

        return step_ended


def any_process(pressed: bool) -> bool:
    """Whether any process of the jax.distributed pool says True (a collective)."""
    return bool(multihost_utils.process_allgather(np.int32(pressed)).any())


def _say(text: str) -> None:
    """Write a line to standard error from a signal handler: straight to its file descriptor,
    as the buffered stream may be mid-write in the code the handler interrupted."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without one (a test's capture)
        print(text, file=sys.stderr, flush=True)
        return
    os.write(fd, (text + "\n").encode())
