"""What `dew train` prints while it trains."""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO


class Progress:
    """What `dew train` shows while it trains: a bar redrawn in place on a terminal, else a plain
    line every `total / lines` steps.

    Each line shows the step, the mean reward of the last 10 steps, and this step's lag, trainer
    wait and resubmissions.

    Args:
        total: the steps the run ends at.
        out: where to write (standard output when None).
        tty: whether to redraw in place (when None, whether `out` is a terminal).
        lines: about how many plain lines a whole run prints.
    """

    def __init__(
        self, total: int, *, out: TextIO | None = None, tty: bool | None = None, lines: int = 20
    ):
        self.total = total
        self.out = sys.stdout if out is None else out
        self.tty = self.out.isatty() if tty is None else tty
        self.every = max(1, total // lines)
        self.window: collections.deque[float] = collections.deque(maxlen=10)
        self.started = time.perf_counter()

    def __call__(self, line: Mapping[str, Any]) -> None:
        reward = line.get("reward/mean")
        if reward is not None:
            self.window.append(reward)
        updates = line["updates"]
        resubmitted = sum(v or 0 for k, v in line.items() if k.startswith("resubmitted/"))
        mean = sum(self.window) / len(self.window) if self.window else float("nan")
        text = (
            f"step {updates}/{self.total}  reward {mean:.3f}  lag {line.get('lag', 0)}  "
            f"waited {line.get('waited') or 0.0:.3f}s  resubmitted {resubmitted}  "
            f"{time.perf_counter() - self.started:.0f}s"
        )
        if self.tty:
            filled = round(20 * updates / self.total)
            bar = "#" * filled + "." * (20 - filled)
            self.out.write(f"\r[{bar}] {text}\x1b[K")
            if updates == self.total:
                self.out.write("\n")
        elif updates % self.every == 0 or updates == self.total:
            self.out.write(text + "\n")
        self.out.flush()
