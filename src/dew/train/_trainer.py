"""The Trainer: a packed batch a Rollout returns trained by jitted updates (one by default, or
several passes over minibatches of its rows), logged and checkpointed."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

import jax
import numpy as np
import optax

from dew import _pool_guard
from dew._arrays import copy_tree
from dew._checks import check_int, check_number
from dew._gc import return_freed_memory
from dew.data import Batch, Dataset
from dew.objectives.rl._step_layout import LaidOutStep
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import SchedulerRecord
from dew.parallel import local_copy, pool_fields
from dew.train._checkpoint import (
    COMMIT,
    Checkpoint,
    Variables,
    is_sharded,
    load_checkpoint,
    save_checkpoint,
)
from dew.train._step_lines import (
    RunTally,
    call_errors,
    check_adapter_gradient,
    check_finite,
    check_measured,
    combined_updates,
    json_number,
    record_fields,
)
from dew.train._trainer_files import (
    METRICS,  # noqa: F401 (dew.train, _run and _folders take it from here)
    _restored,
    _same_checkpoint,
    _stored,
    check_log_lengths,
    cut_logs,
    measure_logs,
    metrics_log,
)
from dew.train._update import _apart, _state_beside, _update_fn

logger = logging.getLogger("dew.train")


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


class Trainer:
    """Trains `variables` with `optimizer` on the rows a Rollout packs; logs and checkpoints.

    The trainer's state is its attributes `variables`, `opt_state`, `updates` (the steps
    trained: each one packed batch, and the version of the weights it leaves) and `position`
    (the stream index of the next batch to hand over), plus `elapsed`, its training seconds
    across resumes, and `optimizer_updates`, the optimizer's updates applied. Each update
    consumes the arrays of `variables` and `opt_state` for the new ones' (buffer donation: an
    update never holds the old weights and Adam's moments beside the new): an array read from
    them is good until the next step. The variables it is given are copied first, so the
    caller's own stay good.

    A step trains its batch by `ppo_epochs` passes, each over `minibatches` minibatches of the
    batch's rows: `ppo_epochs` x `minibatches` optimizer updates (1 x 1 by default: one update
    a step, and then `updates` counts optimizer updates too). The rollout rescores the batch
    once, under the weights before the step's first update (the proximal policy, as decoupled
    PPO defines it), so from the second update on the ratio current / proximal departs from 1
    and the clip acts; the next step's call pushes the weights the step's last update left,
    once. A version, `max_lag`, the scheduler's lag, `steps`, `checkpoint_every`, `measure`
    and each line's `step` and `updates` count steps; the optimizer's own count (a learning-
    rate schedule, `reference_sync`) counts its updates. A pass deals the rows out in an order
    drawn from (`shuffle_seed`, the batch's position, the pass), so a resumed run trains as an
    uninterrupted one; with one minibatch a pass trains the batch as it came.

    In a pool of `jax.distributed` processes, every process runs its own trainer over its own
    rows of each global batch (`dew.parallel.ProcessRows`), and the update is one jitted step
    over the pool's batch (`dew.parallel.DataParallelUpdate`): JAX reduces the gradients across
    the pool, so the variables and optimizer state stay equal on every process. The processes
    step in lockstep, so one `position` is every process's data position. Process 0 alone writes
    the metrics log, one line a step for the pool (`dew.parallel.pool_fields`), and the
    checkpoints; `resume` restores every process from them, which the pool's processes must
    all read (one folder, shared), and a pool of another size may resume them: each process
    reads its rows of the same global batches from the checkpoint's position on. Variables
    sharded over a mesh that spans the pool's processes (`dew train --model --mesh` in a pool)
    stay so: the step is the objective's own over them and the pool's batch, which the rollout
    hands over as one array over the mesh (`dew.models.hf.sharding.ShardedRollout`), and every
    process writes its shards of each checkpoint.

    With a `directory`, each step appends one JSON line of flat metrics to `directory/metrics.jsonl`
    — `step` (the updates before it), `updates` (after it), `position` (the batch it trained), the
    seconds it took (`seconds/step`, `seconds/rollout`, `seconds/update`, and `elapsed`), the
    rollout's record (`record_fields`) and the loss metrics (a step of several updates:
    `combined_updates`'s, each metric's mean over them and the last one's, with `optimizer_updates`
    after it) — and every `checkpoint_every` updates saves a checkpoint to `directory/checkpoints`,
    which keeps the metrics log's length: `resume` cuts the log back to it, so the log of a resumed
    run has each step exactly once. The files named in `logs` get the same care: a checkpoint keeps
    their lengths too, and the next run cuts them back, so what a step appended to them in `on_step`
    past the checkpoint is gone when that step trains again. Checkpoints fall between steps only,
    never between a step's updates.

    Args:
        objective: the loss; its `update_fn(optimizer)` is the jitted step.
        optimizer: an optax transformation (its state starts at `optimizer.init(variables)`).
        variables: the initial weights.
        directory: the run's folder for metrics and checkpoints; None keeps neither.
        checkpoint_every: updates between checkpoints (needs a directory); None saves none.
        on_step: called with each step's metrics line, after it is written.
        measure: called after each update with the updates count; the keys it returns join
            the step's line before it is written and handed to `on_step`, measured at that
            update (`dew train`'s held-out evaluation, `eval/...`, every `--eval-every`).
        deadline: in a pool, seconds a step may take: past it the process stops, naming the
            processes behind the others (one that hangs), so every process stops rather than
            wait forever in a collective; None waits as long as it takes.
        logs: file names in `directory` that `on_step` appends to, once a step (a run's
            `samples.jsonl`, `eval.jsonl`), kept in step with the checkpoints as the metrics
            log is.
        metadata: JSON values kept with each checkpoint beside the trainer's own (`dew train`
            keeps the run's config there, the one place `--resume` takes it from).
        learning_rate: the optimizer's learning rate as a function of the update count (an
            optax schedule), for the record: each line's `learning_rate` is the one its update
            stepped with. None leaves it out.
        keep_checkpoints: how many checkpoints `directory/checkpoints` keeps, the newest and
            those before it (`save_checkpoint`'s `keep`; `read_kept` lists the earlier ones);
            `resume` reads the newest.
        ppo_epochs: passes over each batch's rows a step trains (verl's `ppo_epochs`, TRL's
            `num_iterations`).
        minibatches: the minibatches a pass splits the batch's rows into, one update each; it
            must divide every batch's rows (a batch it does not is refused at its step).
        shuffle_seed: seeds the order a pass deals the rows into minibatches in.
        dropout_seed: seeds a stochastic model's training forward (a LoRA adapter's dropout,
            `dew.models.Model`): the optimizer's update n draws with the key
            `fold_in(key(dropout_seed), n)`, so a resumed run draws what an uninterrupted
            one did. Unused by any other model.

    A run whose every step had no token to train on (every group abandoned, cut or failed)
    raises NothingTrained at its end, naming what became of the groups and the errors behind.

    A step whose loss or gradient is not finite stops the run with a FloatingPointError naming
    the step, before its line or any checkpoint is written; the update left the weights as they
    were (`GRPOObjective.update_fn`), so NaN never reaches them.

    Raises:
        ValueError: naming the argument that is out of bounds; naming `ppo_epochs`,
            `minibatches` and the objective's `proximal` when a step of several updates meets
            `proximal="current"` (whose ratio would stay 1 at every update: the clip would
            never act); naming `minibatches` for variables sharded over a mesh that spans the
            pool's processes, whose batch is one array over the pool.
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
        measure: Callable[[int], Mapping[str, Any]] | None = None,
        deadline: float | None = None,
        logs: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
        learning_rate: Callable[[int], Any] | None = None,
        keep_checkpoints: int = 1,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        shuffle_seed: int = 0,
        dropout_seed: int = 0,
    ):
        if isinstance(logs, str) or not all(isinstance(name, str) for name in logs):
            raise ValueError(f"logs must be a sequence of file names, got {logs!r}")
        if logs and directory is None:
            raise ValueError("logs needs a directory that holds them")
        if checkpoint_every is not None:
            check_int("checkpoint_every", checkpoint_every, low=1)
            if directory is None:
                raise ValueError("checkpoint_every needs a directory to write checkpoints to")
        self.objective = objective
        self.optimizer = optimizer
        self.directory = None if directory is None else Path(directory)
        self.checkpoint_every = checkpoint_every
        if measure is not None and not callable(measure):
            raise ValueError(
                f"measure must be a callable (updates -> a mapping of metrics), got {measure!r}"
            )
        self.on_step = on_step
        self.measure = measure
        self.metadata = dict(metadata or {})
        self.learning_rate = learning_rate
        self.keep_checkpoints = check_int("keep_checkpoints", keep_checkpoints, low=1)
        self.ppo_epochs = check_int("ppo_epochs", ppo_epochs, low=1)
        self.minibatches = check_int("minibatches", minibatches, low=1)
        self.shuffle_seed = check_int("shuffle_seed", shuffle_seed, low=0)
        if ppo_epochs * minibatches > 1 and objective.proximal == "current":
            raise ValueError(
                f"ppo_epochs {ppo_epochs} x minibatches {minibatches} updates a batch needs the "
                "objective's proximal='rescore': under proximal='current' the ratio current / "
                "proximal stays 1 at every update and the clip never acts"
            )
        # The step consumes the variables and state it is handed (`update_fn(donate=True)`:
        # the old and the new weights and moments are never held side by side), so the trainer
        # steps its own copy and the caller's arrays outlive its first step.
        self.variables = copy_tree(variables)
        self.opt_state = _apart(
            _state_beside(optimizer.init(self.variables), self.variables), self.variables
        )
        self.updates = 0
        self.optimizer_updates = 0
        self.position = 0
        self.elapsed = 0.0
        self.processes = jax.process_count() if jax.distributed.is_initialized() else 1
        # Variables sharded over a mesh that spans the pool's processes are the pool's arrays
        # already: the step is the objective's own over them and the pool's batch
        # (`sharding.shard_batch`); a pool's whole variables are replicated for its step.
        self._global = _spans_processes(variables)
        if self._global and minibatches > 1:
            raise ValueError(
                f"minibatches {minibatches} splits a batch's rows on each process, but variables "
                "sharded over a mesh that spans the pool's processes train on one batch array "
                "over the pool: give minibatches 1"
            )
        pooled = self.processes > 1 and not self._global
        self._dropout = None
        if getattr(objective.model, "stochastic", False):
            if pooled:
                raise ValueError(
                    "a LoRA adapter's dropout trains in one process: its pool's step takes no "
                    "dropout key; give the adapter dropout 0 (--lora-dropout 0)"
                )
            self._dropout = jax.random.key(check_int("dropout_seed", dropout_seed, low=0))
        self._update = _update_fn(objective, optimizer, pooled=pooled)
        self._compiled: set[tuple] = set()  # the batch shapes `_compile_update` compiled for
        # Process 0 writes for the pool: the metrics log and the checkpoints.
        self._writes = self.processes == 1 or jax.process_index() == 0
        self._deadline = None
        if deadline is not None and self.processes > 1:
            self._deadline = _pool_guard.Deadline(deadline)
        self._tally = RunTally()  # what the current (or last) run trained on
        # The metrics log's length that goes with the state above: the next run cuts it there.
        self._logged_bytes = 0
        # The same for the other logs; a log of unknown length (a checkpoint older than the
        # log's care) is left whole.
        self._log_bytes: dict[str, int | None] = dict.fromkeys(logs, 0)
        # A rollout that keeps state across steps (a scheduler's carried groups) saves it with
        # each checkpoint through `checkpoint_state()`, and a resumed run hands it back through
        # `restore_state(state)` before it opens the stream.
        self._rollout: Rollout | None = None
        self._rollout_state: Any = None

    @property
    def checkpoints(self) -> Path | None:
        """Where the checkpoints go: `directory/checkpoints`."""
        return None if self.directory is None else self.directory / "checkpoints"

    def resume(self) -> Checkpoint | None:
        """Restore the latest checkpoint of the directory, if there is one.

        Returns:
            The checkpoint restored, or None (the state stays as it was).

        Raises:
            ValueError: when the checkpoint does not fit this trainer's variables or optimizer;
                in a pool, on every process, when the processes read different checkpoints.
        """
        if self.checkpoints is None:
            return None
        checkpoint = load_checkpoint(
            self.checkpoints, _stored(self.objective.model, self.variables), self.opt_state
        )
        if self.processes > 1:
            _same_checkpoint(checkpoint)
        if checkpoint is not None:
            check_log_lengths(self.directory, checkpoint.metadata, self._log_bytes)
            model = self.objective.model
            self.variables = _restored(model, self.variables, checkpoint.variables)
            self.opt_state = checkpoint.opt_state
            self.updates, self.position = checkpoint.updates, checkpoint.position
            self.elapsed = float(checkpoint.metadata.get("elapsed", 0.0))
            # A checkpoint from before several updates a step: one update each.
            self.optimizer_updates = int(
                checkpoint.metadata.get("optimizer_updates", checkpoint.updates)
            )
            self._logged_bytes = int(checkpoint.metadata.get("metrics_bytes", 0))
            kept = checkpoint.metadata.get("log_bytes", {})
            self._log_bytes = {name: kept.get(name) for name in self._log_bytes}
            self._rollout_state = checkpoint.metadata.get("rollout")
        return checkpoint

    def save(
        self, directory: Path | None = None, *, metadata: Mapping[str, Any] | None = None
    ) -> Path:
        """Checkpoint the trainer's state now (in a pool, process 0 writes it for every process;
        variables sharded over a mesh are written by every process, each its own shards).

        Args:
            directory: where to, instead of `checkpoints` (which keeps `keep_checkpoints` of
                them), keeping that one alone: `dew train --keep-best`'s `checkpoints/best`.
            metadata: added to the record's metadata.

        Returns:
            The commit record's path.

        Raises:
            ValueError: without a directory.
        """
        if self.checkpoints is None:
            raise ValueError("the trainer has no directory to save checkpoints to")
        keep = self.keep_checkpoints if directory is None else 1
        directory = self.checkpoints if directory is None else Path(directory)
        metadata = {
            **self.metadata,
            **(metadata or {}),
            "metrics_bytes": self._logged_bytes,
            "log_bytes": self._log_bytes,
            "elapsed": self.elapsed,
            "optimizer_updates": self.optimizer_updates,
            "processes": self.processes,
        }
        state = getattr(self._rollout, "checkpoint_state", None)
        if callable(state):
            metadata["rollout"] = state()
        checkpoint = Checkpoint(
            _stored(self.objective.model, self.variables),
            self.opt_state,
            self.updates,
            self.position,
            metadata,
        )
        # Sharded arrays are written by every process, each its own shards (`save_checkpoint`).
        if not self._writes and not is_sharded(self.variables):
            return directory / COMMIT
        return save_checkpoint(directory, checkpoint, keep=keep)

    def run(
        self,
        rollout: Rollout,
        dataset: Dataset,
        *,
        steps: int,
        ahead: int = 1,
        wall_clock: float | None = None,
    ) -> None:
        """Train until `updates` reaches `steps`, the dataset's stream ends, or `wall_clock`
        seconds have passed.

        Opens `dataset.stream(position)` (for a scheduler's `tasks()` stream, this cancels what an
        earlier stream left in flight) and reads it `ahead` batches beyond the batch it hands
        over, never past the batch of the last step. With checkpoints on, the last state is
        saved too.

        A rollout with `checkpoint_state()` (a scheduler under carry_over) has what it returns
        saved with each checkpoint as the metadata's `rollout`; a resumed run hands it back
        through the rollout's `restore_state(state)` before it opens the stream.

        Args:
            rollout: packs each batch's rollouts.
            dataset: the task stream (a scheduler's `tasks(dataset)`).
            steps: the `updates` count to stop at.
            ahead: batches read beyond the one handed over; at least the scheduler's `ahead`,
                or it submits fewer batches early than it could.
            wall_clock: seconds this call may run; once they have passed, it stops after the
                step in progress (a step is never cut short: its update and its line stay
                together), saying so in a warning of the `dew.train` logger. None: no bound.

        Raises:
            ValueError: naming the argument out of bounds.
            NothingTrained: at the end of a run that made steps, none of which had a token to
                train on (its state saved first, with checkpoints on).
        """
        steps = check_int("steps", steps, low=0)
        ahead = check_int("ahead", ahead, low=0)
        if wall_clock is not None:
            check_number("wall_clock", wall_clock, low=0, low_open=True)
        ends = math.inf if wall_clock is None else time.monotonic() + wall_clock
        self._tally = RunTally()
        self._rollout = rollout
        restore = getattr(rollout, "restore_state", None)
        if callable(restore) and self._rollout_state is not None:
            restore(self._rollout_state)
            self._rollout_state = None
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
                if self.updates < steps and time.monotonic() >= ends:
                    logger.warning(
                        "stopped after step %d/%d: its wall_clock of %gs has passed",
                        self.updates,
                        steps,
                        wall_clock,
                    )
                    break
            if self.checkpoint_every is not None and self.updates % self.checkpoint_every:
                self.save()
        self._tally.check()

    def _step(self, rollout: Rollout, batch: Batch, log: BinaryIO | None) -> None:
        """Train on one batch: roll it out, update, log the line, checkpoint when due."""
        watch = self._deadline.step(self.updates) if self._deadline else contextlib.nullcontext()
        with watch:
            self._train(rollout, batch, log)

    def _train(self, rollout: Rollout, batch: Batch, log: BinaryIO | None) -> None:
        started = time.perf_counter()
        packed = rollout(batch, self.variables, self.updates)
        rolled = time.perf_counter()
        first_update = self.optimizer_updates
        metrics = self._updates_on(packed)
        if self._writes:
            check_adapter_gradient(self.objective.model, metrics, packed, self.updates)
        self._tally.observe(self.updates, metrics, rollout)
        if not float(metrics.get("tokens", 1.0)) > 0:
            # A share of the trained tokens: the record's figure, which the loss reports in its
            # place under GRPOObjective(proximal="current") and, jitted, as 0 where there are
            # none. The record leaves it out of such a step; so does the line.
            metrics = {k: v for k, v in metrics.items() if k != "importance/masked"}
        finished = time.perf_counter()
        self.elapsed += finished - started
        fields: dict[str, Any] = {
            "seconds/step": finished - started,
            "seconds/rollout": rolled - started,
            "seconds/update": finished - rolled,
        }
        if self.learning_rate is not None:
            fields["learning_rate"] = float(self.learning_rate(first_update))
        if self.ppo_epochs * self.minibatches > 1:
            fields["optimizer_updates"] = self.optimizer_updates
        record = getattr(rollout, "last_record", None)
        if isinstance(record, SchedulerRecord):
            fields |= record_fields(record)
        # The newest weight push: the version the engine serves, the seconds it took and the
        # bytes its servers read (a vLLM engine's: the full weights, or a LoRA run's adapter).
        if (push := getattr(rollout, "last_push", None)) is not None:
            fields["push/version"], fields["push/seconds"], pushed = push
            if pushed is not None:
                fields["push/bytes"] = pushed
        fields |= {name: json_number(value) for name, value in metrics.items()}
        line: dict[str, Any] = {
            "step": self.updates,
            "updates": self.updates + 1,
            "position": self.position,
            "elapsed": self.elapsed,
        }
        line |= pool_fields(fields) if self.processes > 1 else fields
        # This process's own, added after the pool's numbers are combined.
        if errors := call_errors(getattr(rollout, "last_events", ())):
            line["errors"] = errors
        self.updates += 1
        self.position += 1
        if self.measure is not None:
            line |= check_measured(self.measure(self.updates), line)
        if log is not None:
            log.write(json.dumps(line, allow_nan=False).encode() + b"\n")
            log.flush()
            self._logged_bytes = log.tell()
        if self.on_step is not None:
            self.on_step(line)
        self._measure_logs()
        if self.checkpoint_every is not None and self.updates % self.checkpoint_every == 0:
            self.save()

    def _updates_on(self, packed: Batch) -> dict[str, Any]:
        """Train the step's batch by its `ppo_epochs` x `minibatches` updates: the loss metrics
        as one update gives them, or `combined_updates` over several.

        Raises:
            ValueError: naming `minibatches` and the batch's rows when it does not divide them.
            FloatingPointError: at the first update whose loss or gradient norm is not finite.
        """
        rows = len(packed["tokens"])
        if rows % self.minibatches:
            raise ValueError(
                f"minibatches {self.minibatches} must divide the batch's rows, got a batch of "
                f"{rows} rows (step {self.updates})"
            )
        size = rows // self.minibatches
        updates = []
        self._compile_update({key: value[:size] for key, value in packed.items()})
        # What the compilations before this step (the engine's, the rescoring's, the update's
        # own) left free in the C heap would otherwise stand under the update's peak.
        return_freed_memory()
        for epoch in range(self.ppo_epochs):
            if self.minibatches == 1:
                parts: list[Batch] = [packed]
            else:
                seed = (self.shuffle_seed, self.position, epoch)
                order = np.random.default_rng(seed).permutation(rows)
                # Each minibatch's rows in the order they were packed, so its loss sums alike.
                taken = [np.sort(order[i * size : (i + 1) * size]) for i in range(self.minibatches)]
                parts = [{key: value[part] for key, value in packed.items()} for part in taken]
            for part in parts:
                self.variables, self.opt_state, metrics = self._update(
                    self.variables, self.opt_state, part, **self._dropout_key()
                )
                metrics = local_copy(metrics) if self._global else jax.device_get(metrics)
                count = self.ppo_epochs * self.minibatches
                check_finite(metrics, self.updates, (len(updates) + 1, count))
                self.optimizer_updates += 1
                updates.append(metrics)
        return updates[0] if len(updates) == 1 else combined_updates(updates, self.minibatches)

    def _compile_update(self, part: Batch) -> None:
        """Compile the update for `part`'s shapes before it runs, once a shape: compiled
        inside the call that runs it, the compilation's freed memory stood under the first
        update's peak (SmolLM2-135M: about 0.4 GiB), where the trim before the update gives
        it back. A pool's step compiles in its call."""
        if not isinstance(self._update, LaidOutStep):
            return
        shapes = tuple((key, np.shape(value), str(value.dtype)) for key, value in part.items())
        if shapes not in self._compiled:
            self._update.compile(self.variables, self.opt_state, part, **self._dropout_key())
            self._compiled.add(shapes)

    def _dropout_key(self) -> dict[str, jax.Array]:
        """The next optimizer update's dropout key, as the step's `key` keyword, for a
        stochastic model (see `dropout_seed`); nothing for any other, whose step is the one
        that takes none."""
        if self._dropout is None:
            return {}
        return {"key": jax.random.fold_in(self._dropout, self.optimizer_updates)}

    def _measure_logs(self) -> None:
        """Note the logs' lengths after a step: the lengths that go with the trainer's state."""
        if self._writes:
            measure_logs(self.directory, self._log_bytes)

    def _cut_logs(self) -> None:
        """Cut the logs back to the lengths that go with the trainer's state."""
        cut_logs(self.directory, self._log_bytes)

    def _metrics_log(self) -> contextlib.AbstractContextManager[BinaryIO | None]:
        """The metrics log, cut back to the length that goes with the trainer's state, and the
        other logs cut back with it; nothing where this process writes no log."""
        if self.directory is None or not self._writes:
            return contextlib.nullcontext()
        return metrics_log(self.directory, self._logged_bytes, self._log_bytes)


def _spans_processes(tree: Any) -> bool:
    """Whether a leaf of `tree` is an array that spans other processes' devices too."""
    return any(
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        for leaf in jax.tree.leaves(tree)
    )
