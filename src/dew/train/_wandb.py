"""Weights & Biases: a run's config and each step's metrics line, through the optional wandb
package, offline by default (no network needed; `wandb sync` uploads the folder later)."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

WANDB_MODES = ("offline", "online")
"""Where a W&B run goes: files under the run folder only, or W&B's servers as well."""


class WandbLog:
    """Logs a run to Weights & Biases (an `on_step` callback): its config once, then each
    metrics line's numbers at step `updates`.

    Non-finite numbers and None are left out, as TensorBoard's are (a chart has no gap for
    them), and so are booleans. Needs the optional `wandb` package (`pip install
    'dew[wandb]'`). Offline, the run is written to `directory/wandb/offline-run-*/`, which
    `wandb sync` uploads once there is a network.

    Args:
        project: the W&B project.
        directory: the folder W&B's own `wandb/` folder goes in (the run folder).
        config: the run's settings, logged as the W&B run's config.
        name: the W&B run's display name.
        mode: one of `WANDB_MODES`.

    Raises:
        ImportError: naming the extra to install when wandb is missing.
        ValueError: a mode not in `WANDB_MODES`, naming it.
    """

    def __init__(
        self,
        project: str,
        directory: str | os.PathLike,
        config: Mapping[str, Any],
        *,
        name: str | None = None,
        mode: str = "offline",
    ):
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode must be one of {WANDB_MODES}, got {mode!r}")
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "--wandb needs the wandb package: pip install 'dew[wandb]'"
            ) from error
        # console="off": dew's own lines stay on the terminal as they are, not captured twice.
        self._run = wandb.init(
            project=project,
            dir=os.fspath(directory),
            config=dict(config),
            name=name,
            mode=mode,
            settings=wandb.Settings(console="off", silent=True),
        )

    def __call__(self, line: Mapping[str, Any]) -> None:
        """Log `line`'s finite numbers at step `updates`."""
        numbers_of = {
            name: float(value)
            for name, value in line.items()
            if name not in ("step", "updates")
            and not isinstance(value, bool)
            and isinstance(value, numbers.Real)
            and math.isfinite(value)
        }
        self._run.log(numbers_of, step=int(line["updates"]))

    def close(self) -> None:
        """Finish the W&B run: its files are complete once this returns."""
        self._run.finish()
