"""TensorBoard: each step's metrics line as scalars, through the optional tensorboardX package."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from typing import Any


class TensorBoard:
    """Writes each step's numeric metrics as TensorBoard scalars (an `on_step` callback).

    Each number of a metrics line but `step` and `updates` becomes the scalar of its name at
    global step `updates`; non-finite numbers and None are left out (TensorBoard has no gap).
    Needs the optional `tensorboardX` package (`pip install 'dew[tensorboard]'`).

    Args:
        logdir: the folder the event file goes to.

    Raises:
        ImportError: naming the extra to install when tensorboardX is missing.
    """

    def __init__(self, logdir: str | os.PathLike):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "TensorBoard needs the tensorboardX package: pip install 'dew[tensorboard]'"
            ) from error
        self._writer = SummaryWriter(logdir=os.fspath(logdir))

    def __call__(self, line: Mapping[str, Any]) -> None:
        """Write `line`'s numbers at its `updates`, and flush them to the event file."""
        updates = line["updates"]
        for name, value in line.items():
            if name in ("step", "updates") or isinstance(value, bool):
                continue
            if isinstance(value, numbers.Real) and math.isfinite(value):
                self._writer.add_scalar(name, float(value), global_step=updates)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
