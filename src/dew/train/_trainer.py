"""The Trainer: one jitted update per packed batch a Rollout returns, logged and checkpointed."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

import jax
import numpy as np
import optax

from dew._checks import check_int
from dew.data import Batch, Dataset
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import SchedulerRecord
from dew.train._checkpoint import Checkpoint, Variables, load_checkpoint, save_checkpoint

METRICS = "metrics.jsonl"
"""The metrics log's file name in a run folder: one JSON line per step."""


@runtime_checkable
class Rollout(Protocol):
    """Where the trainer's training rows come from: rollouts of a task batch, packed.

    `RolloutScheduler` is one. A rollout that also has a `last_record` attribute (a
    `SchedulerRecord`, as the scheduler does) has that record's fields logged beside the loss.
    """

    def __call__(self, batch: Batch, variables: Variables, updates: int) -> Batch:
        """Roll out `batch`'s tasks and return their packed rows.

        Args:
            batch: the task batch the trainer reads from the stream, handed over in stream order.
            variables: the trainer's current weights (pushed to the engines, and the proximal
                policy the rows are rescored under).
            updates: optimizer updates applied so far.

        Returns:
            `[rows, width]` arrays under at least the keys `GRPOObjective.loss` reads.
        """
        ...


def _json_number(value: Any) -> float | int | None:
    """A metric as JSON holds it: ints stay ints, non-finite floats become null."""
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, int | np.integer):
        return int(value)
    number = float(value)
    return number if math.isfinite(number) else None


def record_fields(record: SchedulerRecord) -> dict[str, float | int | None]:
    """A SchedulerRecord as flat metrics: its fields, `resubmitted/<cause>`, and its metrics under
    their own names (`reward/mean`, `latency/p90`, ...); `updates` is left to the trainer."""
    fields: dict[str, Any] = {
        "version": record.version,
        "lag": record.lag,
        "groups": record.groups,
        "cancelled": record.cancelled,
        "abandoned": record.abandoned,
        "cut": record.cut,
        "waited": record.waited,
    }
    fields |= {f"resubmitted/{cause}": count for cause, count in record.resubmitted.items()}
    fields |= dict(record.metrics)
    return {name: _json_number(value) for name, value in fields.items()}


# Each objective's jitted step per optimizer, so trainers that share both (a trainer resumed in
# the same process, a notebook's second run) compile it once.
_UPDATE_FNS: weakref.WeakKeyDictionary[GRPOObjective, dict] = weakref.WeakKeyDictionary()


def _update_fn(objective: GRPOObjective, optimizer: optax.GradientTransformation) -> Callable:
    steps = _UPDATE_FNS.setdefault(objective, {})
    if optimizer not in steps:
        steps[optimizer] = objective.update_fn(optimizer)
    return steps[optimizer]


class Trainer:
    """Trains `variables` with `optimizer` on the rows a Rollout packs; logs and checkpoints.

    The trainer's state is its attributes `variables`, `opt_state`, `updates` (optimizer updates
    applied) and `position` (the stream index of the next batch to hand over), plus `elapsed`,
    its training seconds across resumes.

    With a `directory`, each step appends one JSON line of flat metrics to
    `directory/metrics.jsonl` — `step` (the updates before it), `updates` (after it), `position`
    (the batch it trained), the seconds it took (`seconds/step`, `seconds/rollout`,
    `seconds/update`, and `elapsed`), the rollout's record (`record_fields`) and the loss metrics
    — and every `checkpoint_every` updates saves a checkpoint to `directory/checkpoints`, which
    keeps the metrics log's length: `resume` cuts the log back to it, so the log of a resumed run
    has each step exactly once.

    Args:
        objective: the loss; its `update_fn(optimizer)` is the jitted step.
        optimizer: an optax transformation (its state starts at `optimizer.init(variables)`).
        variables: the initial weights.
        directory: the run's folder for metrics and checkpoints; None keeps neither.
        checkpoint_every: updates between checkpoints (needs a directory); None saves none.
        on_step: called with each step's metrics line, after it is written.

    Raises:
        ValueError: naming the argument that is out of bounds.
    """

    def __init__(
        self,
        objective: GRPOObjective,
        optimizer: optax.GradientTransformation,
        variables: Variables,
        *,
        directory: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        on_step: Callable[[Mapping[str, Any]], None] | None = None,
    ):
        if checkpoint_every is not None:
            check_int("checkpoint_every", checkpoint_every, low=1)
            if directory is None:
                raise ValueError("checkpoint_every needs a directory to write checkpoints to")
        self.objective = objective
        self.optimizer = optimizer
        self.directory = None if directory is None else Path(directory)
        self.checkpoint_every = checkpoint_every
        self.on_step = on_step
        self.variables = variables
        self.opt_state = optimizer.init(variables)
        self.updates = 0
        self.position = 0
        self.elapsed = 0.0
        self._update = _update_fn(objective, optimizer)
        # The metrics log's length that goes with the state above: the next run cuts it there.
        self._logged_bytes = 0

    @property
    def checkpoints(self) -> Path | None:
        """Where the checkpoints go: `directory/checkpoints`."""
        return None if self.directory is None else self.directory / "checkpoints"

    def resume(self) -> Checkpoint | None:
        """Restore the latest checkpoint of the directory, if there is one.

        Returns:
            The checkpoint restored, or None (the state stays as it was).

        Raises:
            ValueError: when the checkpoint does not fit this trainer's variables or optimizer.
        """
        if self.checkpoints is None:
            return None
        checkpoint = load_checkpoint(self.checkpoints, self.variables, self.opt_state)
        if checkpoint is not None:
            self.variables, self.opt_state = checkpoint.variables, checkpoint.opt_state
            self.updates, self.position = checkpoint.updates, checkpoint.position
            self.elapsed = float(checkpoint.metadata.get("elapsed", 0.0))
            self._logged_bytes = int(checkpoint.metadata.get("metrics_bytes", 0))
        return checkpoint

    def save(self) -> Path:
        """Checkpoint the trainer's state now.

        Returns:
            The commit record's path.

        Raises:
            ValueError: without a directory.
        """
        if self.checkpoints is None:
            raise ValueError("the trainer has no directory to save checkpoints to")
        metadata = {"metrics_bytes": self._logged_bytes, "elapsed": self.elapsed}
        checkpoint = Checkpoint(
            self.variables, self.opt_state, self.updates, self.position, metadata
        )
        return save_checkpoint(self.checkpoints, checkpoint)

    def run(self, rollout: Rollout, dataset: Dataset, *, steps: int, ahead: int = 1) -> None:
        """Train until `updates` reaches `steps` or the dataset's stream ends.

        Opens `dataset.stream(position)` (for a scheduler's `tasks()` stream, this cancels what an
        earlier stream left in flight) and reads it `ahead` batches beyond the batch it hands
        over, never past the batch of the last step. With checkpoints on, the last state is
        saved too.

        Args:
            rollout: packs each batch's rollouts.
            dataset: the task stream (a scheduler's `tasks(dataset)`).
            steps: the `updates` count to stop at.
            ahead: batches read beyond the one handed over; at least the scheduler's `ahead`,
                or it submits fewer batches early than it could.

        Raises:
            ValueError: naming the argument out of bounds.
        """
        steps = check_int("steps", steps, low=0)
        ahead = check_int("ahead", ahead, low=0)
        stream = dataset.stream(self.position)
        read: collections.deque[Batch] = collections.deque()
        with contextlib.ExitStack() as stack:
            stack.callback(getattr(stream, "close", lambda: None))
            log = stack.enter_context(self._metrics_log())
            while self.updates < steps:
                wanted = min(ahead + 1, steps - self.updates)
                while len(read) < wanted:
                    batch = next(stream, None)
                    if batch is None:
                        break
                    read.append(batch)
                if not read:
                    break
                self._step(rollout, read.popleft(), log)
            if self.checkpoint_every is not None and self.updates % self.checkpoint_every:
                self.save()

    def _step(self, rollout: Rollout, batch: Batch, log: BinaryIO | None) -> None:
        """Train on one batch: roll it out, update, log the line, checkpoint when due."""
        started = time.perf_counter()
        packed = rollout(batch, self.variables, self.updates)
        rolled = time.perf_counter()
        self.variables, self.opt_state, metrics = self._update(
            self.variables, self.opt_state, packed
        )
        metrics = jax.device_get(metrics)
        finished = time.perf_counter()
        self.elapsed += finished - started
        line: dict[str, Any] = {
            "step": self.updates,
            "updates": self.updates + 1,
            "position": self.position,
            "elapsed": self.elapsed,
            "seconds/step": finished - started,
            "seconds/rollout": rolled - started,
            "seconds/update": finished - rolled,
        }
        record = getattr(rollout, "last_record", None)
        if isinstance(record, SchedulerRecord):
            line |= record_fields(record)
        line |= {name: _json_number(value) for name, value in metrics.items()}
        self.updates += 1
        self.position += 1
        if log is not None:
            log.write(json.dumps(line, allow_nan=False).encode() + b"\n")
            log.flush()
            self._logged_bytes = log.tell()
        if self.on_step is not None:
            self.on_step(line)
        if self.checkpoint_every is not None and self.updates % self.checkpoint_every == 0:
            self.save()

    @contextlib.contextmanager
    def _metrics_log(self) -> Iterator[BinaryIO | None]:
        """The metrics log, cut back to the length that goes with the trainer's state."""
        if self.directory is None:
            yield None
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / METRICS
        path.touch()
        with open(path, "r+b") as log:
            log.truncate(self._logged_bytes)
            log.seek(self._logged_bytes)
            yield log
