"""What a Trainer keeps in its run folder beside the checkpoints' arrays: the metrics log
(`METRICS`) and the other logs a run appends to, whose lengths each checkpoint keeps and a resumed
trainer cuts them back to (`check_log_lengths` refuses a log now shorter than that); what a
checkpoint stores of the variables (a LoRA model's adapter alone); and, in a pool, the check that
every process read the same checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from jax.experimental import multihost_utils

from dew.models.hf.lora import LoRAModel
from dew.train._checkpoint import Checkpoint, Variables

METRICS = "metrics.jsonl"
"""The metrics log's file name in a run folder: one JSON line per step."""


def _stored(model: Any, variables: Variables) -> Variables:
    """What a checkpoint keeps of `variables`: a LoRA model's adapter alone (its frozen base is
    the checkpoint folder's, which a resumed run loads again), else all of them."""
    if isinstance(model, LoRAModel):
        return {"adapter": variables["adapter"]}
    return variables


def _restored(model: Any, variables: Variables, stored: Variables) -> Variables:
    """The variables of a checkpoint's `stored` ones (`_stored`): a LoRA model's adapter
    beside the base it was given, else `stored`."""
    if isinstance(model, LoRAModel):
        return {**variables, "adapter": stored["adapter"]}
    return stored


def measure_logs(directory: Path, lengths: dict[str, int | None]) -> None:
    """Note in `lengths` the lengths of the logs it names after a step: the lengths that go
    with the trainer's state."""
    for name in lengths:
        path = directory / name
        lengths[name] = path.stat().st_size if path.exists() else 0


def cut_logs(directory: Path, lengths: Mapping[str, int | None]) -> None:
    """Cut the logs back to `lengths`, the lengths that go with the trainer's state; a log of
    unknown length (None) is left whole."""
    for name, length in lengths.items():
        path = directory / name
        if length is not None and path.exists():
            with open(path, "r+b") as log:
                log.truncate(length)


@contextlib.contextmanager
def metrics_log(
    directory: Path, logged: int, lengths: Mapping[str, int | None]
) -> Iterator[BinaryIO]:
    """The metrics log, cut back to `logged` bytes (the length that goes with the trainer's
    state), and the other logs cut back to `lengths` with it."""
    directory.mkdir(parents=True, exist_ok=True)
    cut_logs(directory, lengths)
    path = directory / METRICS
    path.touch()
    with open(path, "r+b") as log:
        log.truncate(logged)
        log.seek(logged)
        yield log


def check_log_lengths(
    directory: Path, metadata: Mapping[str, Any], logs: Mapping[str, Any] | None = None
) -> None:
    """Refuse to resume from a checkpoint whose logs in `directory` (the metrics log, and those
    of `logs`, by default every one its `metadata` measured) are now shorter than it measured
    them: cutting them back to its lengths would pad them with NUL bytes, mid-line.

    Raises:
        ValueError: naming the log, its length and the checkpoint's.
    """
    kept = metadata.get("log_bytes") or {}
    lengths = {METRICS: metadata.get("metrics_bytes", 0)}
    lengths |= {name: kept.get(name) for name in (kept if logs is None else logs)}
    for name, length in lengths.items():
        path = directory / name
        size = path.stat().st_size if path.exists() else 0
        if not isinstance(length, int) or size >= length:
            continue
        if name != METRICS and not path.exists():
            continue  # a log the run no longer keeps (--samples 0 on resume)
        raise ValueError(
            f"{path} is {size} bytes, shorter than the {length} its checkpoint goes with: it "
            "was cut short or replaced since; restore it, or train a new run in another folder"
        )


def _same_checkpoint(checkpoint: Checkpoint | None) -> None:
    """Refuse, on every process of the pool, checkpoints that differ between the processes."""
    mine = (-1, -1) if checkpoint is None else (checkpoint.updates, checkpoint.position)
    every = multihost_utils.process_allgather(np.array(mine, np.int32))
    differing = np.flatnonzero((every != every[0]).any(axis=1)).tolist()
    if differing:
        read = ", ".join(f"process {i}: {tuple(every[i].tolist())}" for i in differing)
        raise ValueError(
            f"the pool's processes read different checkpoints (updates, position): process 0 "
            f"read {tuple(every[0].tolist())}, {read}; every process must read the same run "
            f"folder ((-1, -1) is none)"
        )
