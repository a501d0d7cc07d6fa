"""Train a policy on rollouts: the Rollout protocol, the Trainer, its checkpoints, and `dew train`.

`Trainer` owns what a run must not lose: the model's variables, the optax optimizer state, the
count of optimizer updates and the data position (the stream index of the next batch to hand
over). Each step it reads the task stream `ahead` batches beyond the batch it hands over (so a
`RolloutScheduler` has them running early), asks its `Rollout` for that batch's packed rows,
applies one jitted `GRPOObjective` update, writes one flat JSON line of what the step did, and
every `checkpoint_every` updates writes a checkpoint. A resumed trainer reopens the stream at the
checkpoint's position: the scheduler then cancels whatever the old stream left in flight, and
the rollouts of the batches it re-reads are run again rather than trained twice or skipped.

A checkpoint is two files, neither of them a pickle: an `.npz` of the flattened leaves of the
variables and the optimizer state, and `checkpoint.json`, the commit record, which names the
arrays file and holds the tree paths, shapes, dtypes, `updates`, `position` and metadata. Each
is written to a temporary file in the same directory, fsynced and renamed over its target; the
arrays file has a fresh name each time and the commit record is renamed last, so a crash at any
point leaves the previous checkpoint whole.

`dew train` runs a built-in task (`dew.envs.tasks`) end to end on the CPU: a `RolloutServer`
samples, a `RolloutScheduler` keeps the rollouts in flight, and the trainer trains, writing a run
folder with `config.json`, `metrics.jsonl`, `checkpoints/` and `curves.png` (reward and lag per
step); `dew train --run DIR --resume` continues it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import secrets
import struct
import sys
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TextIO, runtime_checkable

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import trio

from dew import models, replay
from dew.data import Batch, Dataset, Task
from dew.envs.environment import Sampling
from dew.envs.tasks import CopyDigits, GuessDigit
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord
from dew.objectives.rl.sessions import Label, Session, SessionSource
from dew.serve import RolloutServer, tokenizer

__all__ = [
    "Checkpoint",
    "Progress",
    "Rollout",
    "ServedSource",
    "TrainConfig",
    "Trainer",
    "load_checkpoint",
    "record_fields",
    "save_checkpoint",
    "train",
    "write_curves",
]

Variables = Any

CHECKPOINT_FORMAT = "dew-checkpoint"
CHECKPOINT_VERSION = 1
COMMIT = "checkpoint.json"
METRICS = "metrics.jsonl"


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


# --- checkpoints ----------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Checkpoint:
    """Everything a run needs to continue where it stopped.

    Args:
        variables: the model's variables.
        opt_state: the optimizer's state for them.
        updates: optimizer updates applied.
        position: the stream index of the next batch to hand over.
        metadata: JSON values kept beside them (the trainer keeps its metrics log's length and
            its training seconds there).
    """

    variables: Variables
    opt_state: Any
    updates: int
    position: int
    metadata: Mapping[str, Any] = attrs.field(factory=dict)


def _leaves(tree_name: str, tree: Any) -> list[tuple[str, Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(f"{tree_name}{jax.tree_util.keystr(path)}", leaf) for path, leaf in leaves]


def _storable(array: np.ndarray) -> np.ndarray:
    # numpy's own formats hold only its built-in dtypes; others (bfloat16) go as their bits.
    return array if array.dtype.isbuiltin else array.view(f"u{array.dtype.itemsize}")


def _fsync_directory(directory: Path) -> None:
    # A rename is durable once its directory is: without this a power cut can undo it.
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` whole or not at all: to a temporary file beside it, fsynced, then renamed."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def save_checkpoint(directory: str | os.PathLike, checkpoint: Checkpoint) -> Path:
    """Write `checkpoint` into `directory` atomically, replacing the one there.

    The arrays go to a freshly named `.npz`, then `checkpoint.json` (the commit record) is renamed
    over the old one, then the arrays of earlier checkpoints and leftovers of interrupted writes
    are removed. A crash before the commit record's rename leaves the earlier checkpoint whole.

    Args:
        directory: the checkpoint directory, created if missing.
        checkpoint: what to save; its metadata must be JSON.

    Returns:
        The path of the commit record.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    leaves = _leaves("variables", checkpoint.variables) + _leaves("opt_state", checkpoint.opt_state)
    arrays = {path: np.asarray(leaf) for path, leaf in leaves}
    name = f"state-{checkpoint.updates:08d}-{secrets.token_hex(4)}.npz"
    stored = {f"leaf{i}": _storable(array) for i, array in enumerate(arrays.values())}
    _write_atomically(directory / name, lambda file: np.savez(file, **stored))
    record = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "arrays": name,
        "updates": int(checkpoint.updates),
        "position": int(checkpoint.position),
        "metadata": dict(checkpoint.metadata),
        "leaves": [
            {"path": path, "shape": list(array.shape), "dtype": array.dtype.name}
            for path, array in arrays.items()
        ],
    }
    text = json.dumps(record, indent=1, allow_nan=False).encode()
    _write_atomically(directory / COMMIT, lambda file: file.write(text))
    for stale in directory.iterdir():
        if stale.name != name and (stale.suffix == ".npz" or stale.name.endswith(".tmp")):
            stale.unlink(missing_ok=True)
    return directory / COMMIT


def load_checkpoint(
    directory: str | os.PathLike, variables: Variables, opt_state: Any
) -> Checkpoint | None:
    """Read the checkpoint in `directory` into trees laid out like `variables` and `opt_state`.

    Args:
        directory: where `save_checkpoint` wrote.
        variables, opt_state: templates: the checkpoint's leaves must have their paths, shapes
            and dtypes (their values are not used).

    Returns:
        The checkpoint, its leaves as jax arrays; None when the directory holds none.

    Raises:
        ValueError: naming the file, or the leaf whose path, shape or dtype differs from the
            templates'.
    """
    commit = Path(directory) / COMMIT
    if not commit.exists():
        return None
    record = json.loads(commit.read_text())
    if record.get("format") != CHECKPOINT_FORMAT or record.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"{commit} is not a {CHECKPOINT_FORMAT} version {CHECKPOINT_VERSION} commit record"
        )
    trees = {"variables": variables, "opt_state": opt_state}
    expected = [leaf for name, tree in trees.items() for leaf in _leaves(name, tree)]
    saved = record["leaves"]
    if len(saved) != len(expected):
        raise ValueError(
            f"{commit} holds {len(saved)} leaves, the templates have {len(expected)}: "
            f"a checkpoint of another model or optimizer"
        )
    restored = []
    with np.load(commit.parent / record["arrays"], allow_pickle=False) as stored:
        for index, (entry, (path, leaf)) in enumerate(zip(saved, expected, strict=True)):
            want = jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf))
            if entry["path"] != path:
                raise ValueError(f"{commit} leaf {index} is {entry['path']}, the templates' {path}")
            if tuple(entry["shape"]) != want.shape or entry["dtype"] != want.dtype.name:
                raise ValueError(
                    f"{commit} leaf {path} is {entry['dtype']}{entry['shape']}, "
                    f"the templates' {want.dtype.name}{list(want.shape)}"
                )
            array = stored[f"leaf{index}"]
            restored.append(
                jnp.asarray(array.view(want.dtype) if array.dtype != want.dtype else array)
            )
    values = iter(restored)
    rebuilt = {
        name: jax.tree.unflatten(
            jax.tree.structure(tree), [next(values) for _ in jax.tree.leaves(tree)]
        )
        for name, tree in trees.items()
    }
    return Checkpoint(
        rebuilt["variables"],
        rebuilt["opt_state"],
        updates=int(record["updates"]),
        position=int(record["position"]),
        metadata=record["metadata"],
    )


# --- the trainer ----------------------------------------------------------------------------------


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


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
            _count("checkpoint_every", checkpoint_every, 1)
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
        steps = _count("steps", steps, 0)
        ahead = _count("ahead", ahead, 0)
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


# --- serving inside the scheduler's trio run ------------------------------------------------------


@attrs.define(eq=False)
class ServedSource:
    """A session source whose RolloutServer's step loop runs in the trio run that calls it.

    A RolloutServer batches only the calls made inside the trio run its loop runs in, and the
    scheduler's synchronous facade runs its rollouts in a trio run of its own, in a thread it
    owns. So the first rollout starts the server there, as a system task of that run (which
    lives until the run ends), and every rollout waits for it to be up. A server that fails makes
    every later rollout raise, which the scheduler reports to the trainer as a broken source.

    Args:
        source: runs the rollouts; its engine is `server`.
        server: the engine to run in the rollouts' trio run.
    """

    source: SessionSource
    server: RolloutServer
    _running: trio.Event | None = attrs.field(default=None, init=False)
    _token: trio.lowlevel.TrioToken | None = attrs.field(default=None, init=False)
    _failure: BaseException | None = attrs.field(default=None, init=False)

    async def run(self, task: Task, label: Label) -> Session:
        """Run `task` with `source`, once the server is up in this trio run.

        Raises:
            RuntimeError: when called from a second trio run, or when the server failed.
        """
        token = trio.lowlevel.current_trio_token()
        if self._running is None:
            self._running, self._token = trio.Event(), token
            trio.lowlevel.spawn_system_task(self._serve, name="dew-rollout-server")
        elif token is not self._token:
            raise RuntimeError("a ServedSource serves the trio run that first called it only")
        await self._running.wait()
        if self._failure is not None:
            raise RuntimeError("the rollout server stopped") from self._failure
        return await self.source.run(task, label)

    async def _serve(self) -> None:
        try:
            async with self.server:
                self._running.set()
                await trio.sleep_forever()
        except Exception as error:  # an uncaught error in a system task would crash the run
            self._failure = error
            self._running.set()


# --- dew train: the built-in tasks end to end -----------------------------------------------------


def _int_at_least(bound: int):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < bound:
            raise ValueError(f"{attribute.name} must be an int >= {bound}, got {value!r}")

    return check


def _positive_number(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


TASKS = ("copy", "guess")


def _task_name(instance, attribute, value):
    if value not in TASKS:
        raise ValueError(f"{attribute.name} must be one of {TASKS}, got {value!r}")


def _option(default: Any, validator: Callable, help: str) -> Any:
    """A TrainConfig field that is also a `dew train` option, with its help text."""
    return attrs.field(default=default, validator=validator, metadata={"help": help})


@attrs.frozen
class TrainConfig:
    """One `dew train` run: the task, the model, the scheduler and the optimizer.

    Args:
        task: the built-in task: `copy` (CopyDigits, single turn) or `guess` (GuessDigit,
            multi-turn).
        steps: optimizer updates to train for.
        batch_size: tasks per batch, one group each.
        groups: rollouts per task that train together.
        tasks: distinct task ids; the stream goes over them in a seeded order, epoch after epoch.
        learning_rate: Adam's step size.
        temperature: the engine's sampling temperature; the objective's log-probs are of the
            same tempered distribution.
        ahead: task batches submitted before the trainer hands them over (the trainer reads
            that far ahead); 0 is synchronous.
        max_lag: the most updates a rollout's oldest call may be behind at training.
        sync_every: updates between weight pushes to the engine.
        checkpoint_every: updates between checkpoints.
        seed: seeds the initial weights, the task order and the sampling.
        d_model, layers, heads, d_ff: the transformer's shape (`dew.models.TransformerConfig`).
    """

    task: str = _option(
        "copy",
        _task_name,
        "the built-in task: copy (repeat digits, one turn) or guess (find a digit, turns)",
    )
    steps: int = _option(400, _int_at_least(1), "optimizer updates to train for")
    batch_size: int = _option(8, _int_at_least(1), "tasks per batch, one group each")
    groups: int = _option(16, _int_at_least(2), "rollouts per task that train together")
    tasks: int = _option(
        1000, _int_at_least(1), "distinct task ids the stream goes over, epoch after epoch"
    )
    learning_rate: float = _option(1e-3, _positive_number, "Adam's step size")
    temperature: float = _option(
        1.0, _positive_number, "the sampling temperature, which the objective scores at too"
    )
    ahead: int = _option(
        1, _int_at_least(0), "task batches submitted before the trainer needs them (0 = sync)"
    )
    max_lag: int = _option(
        1, _int_at_least(0), "the most updates a rollout may be behind when it trains"
    )
    sync_every: int = _option(1, _int_at_least(1), "updates between weight pushes to the engine")
    checkpoint_every: int = _option(25, _int_at_least(1), "updates between checkpoints")
    seed: int = _option(0, _int_at_least(0), "seeds the weights, the task order and the sampling")
    d_model: int = _option(64, _int_at_least(1), "the transformer's width")
    layers: int = _option(2, _int_at_least(1), "the transformer's blocks")
    heads: int = _option(4, _int_at_least(1), "the transformer's attention heads")
    d_ff: int = _option(256, _int_at_least(1), "the transformer's MLP width")

    def __attrs_post_init__(self):
        if self.tasks < self.batch_size:
            raise ValueError(f"tasks must be >= batch_size {self.batch_size}, got {self.tasks}")
        if self.max_lag < self.ahead + self.sync_every - 1:
            raise ValueError(
                f"max_lag must be >= ahead + sync_every - 1 = {self.ahead + self.sync_every - 1}, "
                f"got {self.max_lag}"
            )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainConfig:
        """The config a run folder's `config.json` holds.

        Raises:
            ValueError: naming a key that is not a field, or a field out of bounds.
        """
        unknown = sorted(set(data) - {field.name for field in attrs.fields(cls)})
        if unknown:
            raise ValueError(f"config.json has keys that are not TrainConfig fields: {unknown}")
        return cls(**data)

    def model_config(self, max_len: int) -> models.TransformerConfig:
        return models.TransformerConfig(
            d_model=self.d_model,
            heads=self.heads,
            layers=self.layers,
            d_ff=self.d_ff,
            max_len=max_len,
        )


@attrs.frozen
class _Shape:
    """How a built-in task's rollouts are served and packed."""

    max_len: int  # the engine's longest prompt + completion
    width: int  # packed row width
    chains_per_row: int  # chains that surely fit a row


def _task(config: TrainConfig) -> tuple[CopyDigits | GuessDigit, _Shape]:
    if config.task == "copy":
        task = CopyDigits(seed=config.seed)
        # Every prompt has the same length: the chat template around the same number of digits.
        user = [{"role": "user", "content": task.prompt(Task("0"))}]
        chain = len(tokenizer.encode_chat(user, add_generation_prompt=True)) + task.max_tokens
        return task, _Shape(max_len=chain, width=2 * chain, chains_per_row=2)
    task = GuessDigit(seed=config.seed)
    return task, _Shape(max_len=task.max_context, width=task.max_context, chains_per_row=1)


def _sampling(config: TrainConfig, updates: int) -> Sampling:
    """Each call's sampling key a function of the seed, its rollout's label and the updates the
    process started at: reproducible whatever order trio runs the rollouts in, and afresh in a
    resumed process (whose scheduler numbers its groups from 0 again)."""
    seed = int(np.random.SeedSequence([config.seed, updates]).generate_state(1)[0])
    return Sampling(config.temperature, seed=seed)


def _check_run(config: TrainConfig, run: Path, *, resume: bool) -> None:
    """Refuse a run folder that would mix two runs.

    Raises:
        ValueError: when `run` holds a run and `resume` is not set, or when it holds a run of a
            config that differs from `config` in more than `steps`.
    """
    saved = run / "config.json"
    if resume and saved.exists():
        previous = TrainConfig.from_json(json.loads(saved.read_text()))
        changed = [
            field.name
            for field in attrs.fields(TrainConfig)
            if field.name != "steps"
            and getattr(previous, field.name) != getattr(config, field.name)
        ]
        if changed:
            raise ValueError(f"{run} was trained with other {', '.join(changed)}: {previous}")
    elif not resume and (saved.exists() or (run / METRICS).exists()):
        raise ValueError(f"{run} already holds a run; resume it or choose another folder")


def train(
    config: TrainConfig,
    run: str | os.PathLike,
    *,
    resume: bool = False,
    on_step: Callable[[Mapping[str, Any]], None] | None = None,
    record: str | os.PathLike | None = None,
) -> Trainer:
    """Train `config`'s built-in task end to end, in the run folder `run`.

    Writes `run/config.json`, then trains with a RolloutServer, a RolloutScheduler (truncated
    rollouts train on their verifier's score) and a Trainer logging to `run/metrics.jsonl` and
    checkpointing to `run/checkpoints`, and finally draws `run/curves.png`.

    Args:
        config: the run.
        run: the run folder.
        resume: continue the run in `run` from its last checkpoint (from the start when it has
            none); otherwise `run` must not hold a run yet.
        on_step: called with each step's metrics line.
        record: write a `dew.replay` trace of the run here: every session the environment
            returned, every push and every call, so `dew replay` can reproduce the scheduler's
            decisions and packed batches without the engine.

    Returns:
        The trainer, after its last step.

    Raises:
        ValueError: when `run` holds a run and `resume` is not set, or holds a different config.
    """
    run = Path(run)
    _check_run(config, run, resume=resume)
    run.mkdir(parents=True, exist_ok=True)
    saved = run / "config.json"
    _write_atomically(
        saved, lambda file: file.write(json.dumps(attrs.asdict(config), indent=1).encode())
    )

    task, shape = _task(config)
    model_config = config.model_config(shape.max_len)
    variables = models.init(jax.random.key(config.seed), model_config)
    objective = GRPOObjective(models.model(model_config), temperature=config.temperature)
    trainer = Trainer(
        objective,
        optax.adam(config.learning_rate),
        variables,
        directory=run,
        checkpoint_every=config.checkpoint_every,
        on_step=on_step,
    )
    if resume:
        trainer.resume()
    server = RolloutServer(
        model_config,
        trainer.variables,
        slots=config.batch_size * config.groups * (config.ahead + 1),
        version=trainer.updates,
    )
    source = ServedSource(task.source(server, sampling=_sampling(config, trainer.updates)), server)
    publisher = server
    recorder = None
    if record is not None:
        recorder = replay.Recorder(record)
        source = replay.RecordingSource(source, recorder)
        publisher = replay.RecordingPublisher(server, recorder)
    rollouts = config.batch_size * config.groups
    scheduler = RolloutScheduler(
        objective,
        source,
        publisher,
        width=shape.width,
        rows=-(-rollouts // shape.chains_per_row),
        groups=config.groups,
        max_lag=config.max_lag,
        ahead=config.ahead,
        sync_every=config.sync_every,
        truncation="score",
    )
    per_epoch = config.tasks // config.batch_size * config.batch_size
    dataset = task.dataset(
        config.tasks,
        config.batch_size,
        shuffle_seed=config.seed,
        epochs=-(-config.steps * config.batch_size // per_epoch),
    )
    if recorder is None:
        try:
            trainer.run(scheduler, scheduler.tasks(dataset), steps=config.steps, ahead=config.ahead)
        finally:
            scheduler.close()
    else:
        with recorder.record(scheduler):  # closes the scheduler, then ends the trace
            trainer.run(recorder, recorder.tasks(dataset), steps=config.steps, ahead=config.ahead)
    write_curves(run / METRICS, run / "curves.png")
    return trainer


# --- progress -------------------------------------------------------------------------------------


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


# --- the reward and lag plot: a tiny PNG writer ---------------------------------------------------

# A 3x5 bitmap font for the plot's labels: each glyph is five rows of three bits, top row first.
_FONT = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717",
    "6": "74757", "7": "71111", "8": "75757", "9": "75717", ".": "00002", "-": "00700",
    " ": "00000", "a": "06357", "d": "13557", "e": "07763", "g": "35316", "l": "22223",
    "p": "07574", "r": "06544", "s": "03636", "t": "27222", "w": "05577",
}  # fmt: skip


def _png(pixels: np.ndarray) -> bytes:
    """Encode uint8[height, width, 3] RGB pixels as a PNG file."""
    height, width, _ = pixels.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, -1)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def _text(canvas: np.ndarray, x: int, y: int, text: str, scale: int = 2) -> None:
    """Draw `text` in the bitmap font, in black, its top-left corner at (x, y)."""
    for char in text:
        glyph = _FONT.get(char, _FONT[" "])
        for row, bits in enumerate(glyph):
            for column in range(3):
                if int(bits, 16) >> (2 - column) & 1:
                    top, left = y + row * scale, x + column * scale
                    canvas[top : top + scale, left : left + scale] = 0
        x += 4 * scale


def _trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Each value's mean with the `window - 1` before it, over the finite ones (NaN if none)."""
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    end = np.arange(1, len(values) + 1)
    begin = np.maximum(end - window, 0)
    count = counts[end] - counts[begin]
    return np.where(count > 0, (sums[end] - sums[begin]) / np.maximum(count, 1), np.nan)


def _line(
    canvas: np.ndarray, box: tuple[int, int, int, int], xs: np.ndarray, ys: np.ndarray,
    colour: tuple[int, int, int],
) -> None:  # fmt: skip
    """Draw the polyline through (xs, ys), two pixels thick, clipped to the box; NaNs break it."""
    left, top, right, bottom = box
    finite = np.isfinite(ys)
    for x0, y0, x1, y1, ok in zip(
        xs[:-1], ys[:-1], xs[1:], ys[1:], finite[:-1] & finite[1:], strict=True
    ):
        if not ok:
            continue
        count = int(max(abs(x1 - x0), abs(y1 - y0))) + 2
        px = np.rint(np.linspace(x0, x1, count)).astype(int)
        py = np.rint(np.linspace(y0, y1, count)).astype(int)
        for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
            canvas[np.clip(py + dy, top, bottom), np.clip(px + dx, left, right)] = colour


def _panel(
    canvas: np.ndarray, box: tuple[int, int, int, int], steps: np.ndarray, values: np.ndarray,
    title: str, colour: tuple[int, int, int],
) -> None:  # fmt: skip
    """Plot `values` over `steps` in the box (left, top, right, bottom): each step's value in a
    pale tint, their trailing mean (over a 25th of the run) over it in `colour`; framed, with the
    title and the y range written beside it."""
    left, top, right, bottom = box
    canvas[top : bottom + 1, [left, right]] = 160
    canvas[[top, bottom], left : right + 1] = 160
    finite = np.isfinite(values)
    low, high = (values[finite].min(), values[finite].max()) if finite.any() else (0.0, 1.0)
    if high - low < 1e-9:
        low, high = low - 0.5, high + 0.5
    _text(canvas, left + 6, top + 6, title)
    _text(canvas, 4, top, f"{high:.2f}")
    _text(canvas, 4, bottom - 10, f"{low:.2f}")
    if len(steps) < 2:
        return
    xs = left + (steps - steps.min()) / max(steps.max() - steps.min(), 1) * (right - left)
    smooth = _trailing_mean(values, max(1, len(values) // 25))
    pale = tuple(255 - (255 - c) // 3 for c in colour)
    for series, shade in ((values, pale), (smooth, colour)):
        _line(canvas, box, xs, bottom - (series - low) / (high - low) * (bottom - top), shade)


def write_curves(metrics: str | os.PathLike, path: str | os.PathLike) -> None:
    """Draw the reward (`reward/mean`) and lag of each step of a metrics log into a PNG.

    Two panels over the step axis: reward on top, lag below, each scaled to its own range.
    """
    steps, rewards, lags = [], [], []
    with open(metrics, encoding="utf-8") as log:
        for text in log:
            line = json.loads(text)
            steps.append(line["step"])
            rewards.append(line.get("reward/mean"))
            lags.append(line.get("lag"))

    def array(values: list) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in values], np.float64)

    width, height = 640, 400
    canvas = np.full((height, width, 3), 255, np.uint8)
    steps_array = np.array(steps, np.float64)
    _panel(canvas, (56, 10, 630, 190), steps_array, array(rewards), "reward", (31, 119, 180))
    _panel(canvas, (56, 210, 630, 370), steps_array, array(lags), "lag", (255, 127, 14))
    if steps:
        _text(canvas, 56, 378, f"step {steps[0]}")
        last = f"step {steps[-1]}"
        _text(canvas, 630 - 8 * len(last), 378, last)
    _write_atomically(Path(path), lambda file: file.write(_png(canvas)))


# --- the command line -----------------------------------------------------------------------------


def configure_cli(parser: argparse.ArgumentParser) -> None:
    """Add `dew train`'s options: one per TrainConfig field, `--run` and `--resume`."""
    default = TrainConfig()
    for field in attrs.fields(TrainConfig):
        value = getattr(default, field.name)
        kind = type(value)
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            dest=field.name,
            type=kind,
            default=None,
            choices=TASKS if field.name == "task" else None,
            metavar=None if field.name == "task" else field.name.upper(),
            help=f"{field.metadata['help']} (default: {value})",
        )
    parser.add_argument(
        "--run",
        dest="run_folder",
        metavar="DIR",
        default=None,
        help="the run folder (default: dew-runs/TASK-YYYYmmdd-HHMMSS)",
    )
    parser.add_argument(
        "--record",
        metavar="TRACE",
        default=None,
        help="write a trace of the run that `dew replay TRACE` reproduces (default: off)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run from its last checkpoint, with its config "
        "(--steps may extend it) (default: off)",
    )


def run_cli(args: argparse.Namespace) -> int:
    """`dew train [options]`: train a built-in task, showing progress; return the exit status.

    Raises:
        SystemExit: with status 2, through the parser, for a bad option or run folder.
    """
    given = {f.name: getattr(args, f.name) for f in attrs.fields(TrainConfig)}
    given = {name: value for name, value in given.items() if value is not None}
    if args.resume and args.run_folder is None:
        args.parser.error("--resume needs --run, the folder of the run to continue")
    run = (
        Path(args.run_folder)
        if args.run_folder is not None
        else _default_run(given.get("task", "copy"))
    )
    saved = run / "config.json"
    try:
        if args.resume and saved.exists():
            config = attrs.evolve(TrainConfig.from_json(json.loads(saved.read_text())), **given)
        else:
            config = TrainConfig(**given)
        _check_run(config, run, resume=args.resume)
    except ValueError as error:
        args.parser.error(str(error))
    print(f"dew train: {config.task} for {config.steps} steps in {run}", flush=True)
    commit = run / "checkpoints" / COMMIT
    if args.resume and commit.exists():
        record = json.loads(commit.read_text())
        print(
            f"resuming at step {record['updates']}, data position {record['position']}",
            flush=True,
        )
    trainer = train(
        config, run, resume=args.resume, on_step=Progress(config.steps), record=args.record
    )
    print(
        f"trained {trainer.updates} steps in {trainer.elapsed:.0f}s; metrics, checkpoints "
        f"and curves.png in {run}",
        flush=True,
    )
    return 0


def _default_run(task: str) -> Path:
    return Path("dew-runs") / f"{task}-{time.strftime('%Y%m%d-%H%M%S')}"
