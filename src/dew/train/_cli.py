"""`dew train`: a built-in or reasoning-gym task end to end, its config, and its command line.

A run folder holds `config.json` (which `--config` reads back), `metrics.jsonl` (one line per
step), `samples.jsonl` (a few decoded rollouts per step), `eval.jsonl` (greedy evaluation on
held-out tasks every `eval_every` steps), `checkpoints/`, `curves.png` and, with `tensorboard`,
TensorBoard's event files under `tensorboard/`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import signal
import socket
import sys
import tempfile
import time
import tomllib
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import jax
import numpy as np
import optax
import trio

from dew import _pool_guard, models, replay
from dew._checks import int_at_least, positive
from dew._launch import run_pool
from dew.data import Batch, Dataset, Task
from dew.envs.environment import Sampling
from dew.envs.lookup import HARNESSES
from dew.envs.reasoning_gym import PREFIX, ReasoningGym
from dew.envs.tasks import CopyDigits, GuessDigit
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler, task_ids
from dew.objectives.rl.sessions import Label, SessionSource, Status
from dew.parallel import ProcessRows, default_pool
from dew.serve import RolloutServer, ServedSource
from dew.serve.tokenizer import BYTES, HuggingFaceTokenizer, Tokenizer
from dew.train._checkpoint import _write_atomically, read_commit
from dew.train._curves import write_curves
from dew.train._fit import measure
from dew.train._progress import Progress
from dew.train._samples import SampleLog
from dew.train._tensorboard import TensorBoard
from dew.train._trainer import METRICS, Trainer

TASKS = ("copy", "guess")
"""The built-in tasks `dew train --task` runs: CopyDigits and GuessDigit."""
HARNESS = "harness:"
"""The prefix of a task that is a built-in agent harness (`--harness NAME` is this plus NAME)."""
_GATEWAY_PACKAGES = ("hypercorn", "openai", "orjson")
SAMPLES = "samples.jsonl"
EVALUATIONS = "eval.jsonl"

# Fields that change what a run logs, not what it trains: a resumed run may change them.
_LOGGING = ("steps", "eval_every", "samples", "tensorboard")


def _task_name(instance, attribute, value):
    if isinstance(value, str) and value.startswith(HARNESS):
        _check_harness(value.removeprefix(HARNESS))
    elif not isinstance(value, str) or not (value in TASKS or value.startswith(PREFIX)):
        raise ValueError(
            f"{attribute.name} must be one of {TASKS}, {PREFIX}NAME[,key=value...] or "
            f"{HARNESS}NAME, got {value!r}"
        )


def _check_harness(name: str) -> None:
    """Raises: ValueError naming the built-in harnesses when `name` is not one, or the packages
    of the recording gateway that are not installed."""
    if name not in HARNESSES:
        raise ValueError(
            f"unknown harness {name!r}; the built-in harnesses are: {', '.join(HARNESSES)}"
        )
    missing = [package for package in _GATEWAY_PACKAGES if not importlib.util.find_spec(package)]
    if missing:
        raise ValueError(
            f"a harness trains through the recording gateway, which needs {', '.join(missing)}: "
            "pip install 'dew[gateway]'"
        )


def _path_or_none(instance, attribute, value):
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{attribute.name} must be a file's path or None, got {value!r}")


def _option(default: Any, validator: Callable, help: str, *, kind: type | None = None) -> Any:
    """A TrainConfig field that is also a `dew train` option, with its help text and, where
    the default (None) does not tell it, the type of its values."""
    kind = type(default) if kind is None else kind
    return attrs.field(default=default, validator=validator, metadata={"help": help, "type": kind})


@attrs.frozen
class TrainConfig:
    """One `dew train` run: the task, the model, the scheduler and the optimizer.

    Args:
        task: the built-in task, `copy` (CopyDigits, single turn) or `guess` (GuessDigit,
            multi-turn), a reasoning-gym dataset, `reasoning-gym:NAME[,key=value...]`
            (`dew.envs.reasoning_gym`), or a built-in agent harness behind the recording
            gateway, `harness:NAME` (`dew.envs.lookup.HARNESSES`; `dew train --harness NAME`).
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
        max_tokens: a reasoning-gym reply's most tokens (a built-in task sets its own).
        eval_every: steps between greedy evaluations on the held-out tasks; 0 for none.
        eval_tasks: held-out tasks, the ids after the training ones.
        samples: rollouts per step written, decoded, to `samples.jsonl`; 0 for none.
        tensorboard: also write the metrics as TensorBoard scalars (needs tensorboardX).
        tokenizer: a Hugging Face `tokenizer.json` (`dew.serve.tokenizer.HuggingFaceTokenizer`)
            that renders the prompts and decodes the replies; the model's vocabulary is its
            size. None for the byte tokenizer.
    """

    task: str = _option(
        "copy",
        _task_name,
        "copy (repeat digits, one turn), guess (find a digit, turns), "
        "reasoning-gym:NAME[,key=value...] (a reasoning-gym dataset and its config) or "
        "harness:NAME (a built-in agent harness, as --harness NAME)",
    )
    steps: int = _option(400, int_at_least(1), "optimizer updates to train for")
    batch_size: int = _option(8, int_at_least(1), "tasks per batch, one group each")
    groups: int = _option(16, int_at_least(2), "rollouts per task that train together")
    tasks: int = _option(
        1000, int_at_least(1), "distinct task ids the stream goes over, epoch after epoch"
    )
    learning_rate: float = _option(1e-3, positive, "Adam's step size")
    temperature: float = _option(
        1.0, positive, "the sampling temperature, which the objective scores at too"
    )
    ahead: int = _option(
        1, int_at_least(0), "task batches submitted before the trainer needs them (0 = sync)"
    )
    max_lag: int = _option(
        1, int_at_least(0), "the most updates a rollout may be behind when it trains"
    )
    sync_every: int = _option(1, int_at_least(1), "updates between weight pushes to the engine")
    checkpoint_every: int = _option(25, int_at_least(1), "updates between checkpoints")
    seed: int = _option(0, int_at_least(0), "seeds the weights, the task order and the sampling")
    d_model: int = _option(64, int_at_least(1), "the transformer's width")
    layers: int = _option(2, int_at_least(1), "the transformer's blocks")
    heads: int = _option(4, int_at_least(1), "the transformer's attention heads")
    d_ff: int = _option(256, int_at_least(1), "the transformer's MLP width")
    max_tokens: int = _option(
        4, int_at_least(1), "a reasoning-gym reply's most tokens (built-in tasks set their own)"
    )
    eval_every: int = _option(
        0, int_at_least(0), "steps between greedy evaluations on held-out tasks (0 = none)"
    )
    eval_tasks: int = _option(
        16, int_at_least(1), "held-out tasks, the ids after the training ones"
    )
    samples: int = _option(
        4, int_at_least(0), "rollouts per step written, decoded, to samples.jsonl (0 = none)"
    )
    tensorboard: bool = _option(
        False,
        attrs.validators.instance_of(bool),
        "also write the metrics as TensorBoard scalars to RUN/tensorboard (needs tensorboardX)",
    )
    tokenizer: str | None = _option(
        None,
        _path_or_none,
        "a Hugging Face tokenizer.json for the prompts and replies, with <bos>, <|im_start|> "
        "and <|im_end|> as special tokens; the model's vocabulary is its size (none: bytes)",
        kind=str,
    )

    def __attrs_post_init__(self):
        if self.tasks < self.batch_size:
            raise ValueError(f"tasks must be >= batch_size {self.batch_size}, got {self.tasks}")
        if self.max_lag < self.ahead + self.sync_every - 1:
            raise ValueError(
                f"max_lag must be >= ahead + sync_every - 1 = {self.ahead + self.sync_every - 1}, "
                f"got {self.max_lag}"
            )

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "config.json") -> TrainConfig:
        """The config a run folder's `config.json` (or a `--config` file) holds.

        Raises:
            ValueError: naming a key that is not a field, or a field out of bounds.
        """
        return cls(**_fields_of(data, where))

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> TrainConfig:
        """The config of a TOML or JSON file (a run folder's `config.json` among them), with
        `overrides` (the options given on the command line) over it.

        Raises:
            ValueError: naming the file when it cannot be read or parsed, a key that is not a
                field, or a field out of bounds.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"cannot read the config file {str(path)!r}: {error}") from error
        if not isinstance(data, Mapping):
            raise ValueError(f"{str(path)!r} must hold a table of TrainConfig fields")
        return cls(**{**_fields_of(data, str(path)), **overrides})

    def model_config(
        self, max_len: int, *, vocab: int = BYTES.vocab_size
    ) -> models.TransformerConfig:
        """The transformer's config for this run, with positions up to `max_len` and `vocab`
        token ids (the tokenizer's)."""
        return models.TransformerConfig(
            vocab=vocab,
            d_model=self.d_model,
            heads=self.heads,
            layers=self.layers,
            d_ff=self.d_ff,
            max_len=max_len,
        )


def _load_tokenizer(config: TrainConfig) -> Tokenizer:
    """The tokenizer `config` names: its `tokenizer.json`, or the byte tokenizer.

    Raises:
        ValueError: naming the path when it is no file, or not a tokenizer the chat template
            can use.
    """
    if config.tokenizer is None:
        return BYTES
    try:
        return HuggingFaceTokenizer.from_file(config.tokenizer)
    except FileNotFoundError:
        raise ValueError(f"--tokenizer {config.tokenizer}: there is no such file") from None
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"--tokenizer {config.tokenizer}: {error}") from error


def _fields_of(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(data) - {field.name for field in attrs.fields(TrainConfig)})
    if unknown:
        raise ValueError(f"{where} has keys that are not TrainConfig fields: {unknown}")
    return dict(data)


@attrs.frozen
class _Shape:
    """How a built-in task's rollouts are served and packed."""

    max_len: int  # the engine's longest prompt + completion
    width: int  # packed row width
    chains_per_row: int  # chains that surely fit a row


@attrs.frozen
class _RunTask:
    """What a run needs of its task: a source on an engine, task batches and their tasks, and
    how the source's engine is served in the rollouts' trio run (`serve(source, server)`)."""

    source: Callable[[Any, Sampling], SessionSource]
    dataset: Callable[..., Dataset]
    tasks: Callable[[Batch], Sequence[Task]]
    shape: _Shape
    serve: Callable[[SessionSource, RolloutServer], SessionSource] = ServedSource


def _task(config: TrainConfig, tokenizer: Tokenizer) -> _RunTask:
    if config.task.startswith(HARNESS):
        return _harness_task(config)
    if config.task == "copy":
        copy = CopyDigits(seed=config.seed)
        # Every prompt has the same length in bytes; another tokenizer's may differ.
        prompts = {copy.prompt(Task(str(i))) for i in range(config.tasks + config.eval_tasks)}
        longest = max(
            len(tokenizer.encode_chat([{"role": "user", "content": prompt}])) for prompt in prompts
        )
        chain = longest + copy.max_tokens
        shape = _Shape(max_len=chain, width=2 * chain, chains_per_row=2)
        return _RunTask(
            lambda engine, sampling: copy.source(engine, sampling=sampling, tokenizer=tokenizer),
            copy.dataset,
            task_ids,
            shape,
        )
    if config.task == "guess":
        guess = GuessDigit(seed=config.seed)
        context = guess.max_context
        return _RunTask(
            lambda engine, sampling: guess.source(engine, sampling=sampling, tokenizer=tokenizer),
            guess.dataset,
            task_ids,
            _Shape(max_len=context, width=context, chains_per_row=1),
        )
    gym = ReasoningGym.parse(config.task, size=config.tasks + config.eval_tasks, seed=config.seed)
    sizes = measure(
        [gym.task(index) for index in range(gym.size)],
        gym.prompt,
        max_tokens=config.max_tokens,
        rollouts=config.batch_size * config.groups,
        tokenizer=tokenizer,
        width=None,
    )
    return _RunTask(
        lambda engine, sampling: gym.source(
            engine, max_tokens=config.max_tokens, sampling=sampling, tokenizer=tokenizer
        ),
        gym.dataset,
        gym.tasks,
        _Shape(max_len=sizes.context, width=sizes.width, chains_per_row=1),
    )


@functools.lru_cache(maxsize=4)
def _objective(model_config: models.TransformerConfig, temperature: float) -> GRPOObjective:
    """The objective of a run's model at `temperature`, one per process: the trainer's compiled
    step and the scheduler's rescoring are the objective's, so a second run in the process (a
    resumed run, a notebook's next cell) reuses them rather than compiling again."""
    return GRPOObjective(models.model(model_config), temperature=temperature)


def _harness_task(config: TrainConfig) -> _RunTask:
    """A built-in agent harness as a run's task: its source is a `ServedGateway`, which serves
    the engine and a recording gateway in the rollouts' trio run and runs the harness against
    the gateway; the engine's and a packed row's length is the harness's `max_len`, one chain
    (a session's merged calls) a row."""
    from dew.gateway import ServedGateway  # the gateway extra, checked with the config

    harness = HARNESSES[config.task.removeprefix(HARNESS)]

    def source(engine, sampling: Sampling) -> SessionSource:
        options = {
            "max_context": harness.max_len,
            "max_tokens": harness.max_tokens,
            "sampling": sampling,
            "announce": False,
        }
        return ServedGateway(
            engine, lambda gateway: harness.source(gateway, seed=config.seed), options
        )

    shape = _Shape(max_len=harness.max_len, width=harness.max_len, chains_per_row=1)
    return _RunTask(source, harness.dataset, task_ids, shape, serve=_served_by_gateway)


def _served_by_gateway(source: SessionSource, server: RolloutServer) -> SessionSource:
    """A `ServedGateway` serves its engine itself."""
    return source


def _sampling(config: TrainConfig, updates: int) -> Sampling:
    """Each call's sampling key a function of the seed, its rollout's label and the updates the
    process started at: reproducible whatever order trio runs the rollouts in, and afresh in a
    resumed process (whose scheduler numbers its groups from 0 again). In a pool, each process
    draws its own keys: its index is part of the seed."""
    entropy = [config.seed, updates]
    if jax.process_count() > 1:
        entropy.append(jax.process_index())
    seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
    return Sampling(config.temperature, seed=seed)


def _check_split(config: TrainConfig, processes: int) -> None:
    """Refuse a batch that the pool's processes cannot share evenly."""
    if config.batch_size % processes:
        raise ValueError(
            f"batch_size {config.batch_size} must split evenly over the {processes} processes"
        )


def _check_run(config: TrainConfig, run: Path, *, resume: bool) -> None:
    """Refuse a run folder that cannot be written, or that would mix two runs.

    Raises:
        ValueError: when `run` cannot be made or written (`_check_run_folder`), holds a run and
            `resume` is not set, or holds a run of a config that differs from `config` in more
            than `steps`.
    """
    _check_run_folder(run)
    saved = run / "config.json"
    if resume and saved.exists():
        previous = TrainConfig.from_json(_read_json(saved))
        changed = [
            field.name
            for field in attrs.fields(TrainConfig)
            if field.name not in _LOGGING
            and getattr(previous, field.name) != getattr(config, field.name)
        ]
        if changed:
            raise ValueError(f"{run} was trained with other {', '.join(changed)}: {previous}")
    elif not resume and (saved.exists() or (run / METRICS).exists()):
        raise ValueError(f"{run} already holds a run; resume it or choose another folder")


def _read_json(path: Path) -> Any:
    """A JSON file's value.

    Raises:
        ValueError: naming the file when it is truncated or not JSON.
    """
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is damaged (not JSON: {error})") from None


def _check_run_folder(run: Path) -> None:
    """Refuse a run folder that cannot be made or written, before anything is: a file, a path
    through a file, or one whose nearest existing folder refuses a new entry (unwritable, or a
    file system such as /proc that takes none) would otherwise fail after other files were
    written, or with a traceback.

    Raises:
        ValueError: naming the path and what is wrong with it.
    """
    if run.exists() and not run.is_dir():
        raise ValueError(f"--run {run} is a file, not a folder")
    folder = _nearest_existing(run)
    if not folder.is_dir():
        raise ValueError(f"--run {run}: {folder} is a file, not a folder")
    _probe(folder, f"--run {run}", directory=True)


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (a relative path ends at `.`)."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


def _probe(folder: Path, option: str, *, directory: bool) -> None:
    """Refuse `folder` unless a folder (`directory`) or a file can be made in it, by making a
    hidden one and removing it: permission bits alone do not say (root passes every check, and
    /proc refuses root too).

    Raises:
        ValueError: naming `option` and the folder, with the system's reason.
    """
    try:
        if directory:
            tempfile.TemporaryDirectory(dir=folder, prefix=".dew-probe-").cleanup()
        else:
            tempfile.TemporaryFile(dir=folder, prefix=".dew-probe-").close()
    except OSError as error:
        raise ValueError(
            f"{option}: nothing can be written in {folder} ({error.strerror or error})"
        ) from None


def _check_record(record: str | os.PathLike) -> None:
    """Refuse a trace path before anything is written: a trace is one run's, written whole, so
    an existing file (a resumed run's earlier trace, say) would be silently overwritten, and a
    folder or a missing or unwritable parent would fail after the run folder was written.

    Raises:
        ValueError: naming the path and what is wrong with it.
    """
    path = Path(record)
    if path.is_dir():
        raise ValueError(f"--record {path} is a folder; give the trace's file name")
    if path.exists():
        raise ValueError(
            f"--record {path} already exists and would be overwritten; record to a new file "
            "(a resumed run records a trace of its own)"
        )
    folder = _nearest_existing(path.parent)
    if not folder.is_dir():
        raise ValueError(f"--record {path}: {folder} is a file, not a folder")
    if folder != path.parent:
        raise ValueError(f"--record {path}: the folder {path.parent} does not exist")
    _probe(folder, f"--record {path}", directory=False)


def train(
    config: TrainConfig,
    run: str | os.PathLike,
    *,
    resume: bool = False,
    on_step: Callable[[Mapping[str, Any]], None] | None = None,
    record: str | os.PathLike | None = None,
    deadline: float | None = None,
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
            decisions and packed batches without the engine (a single process's run only).
        deadline: in a pool, the seconds a step may take before every process stops.

    In a pool of `jax.distributed` processes (`dew train --processes`), every process calls it
    alike: each runs its own server and scheduler on its own rows of each global batch of
    `batch_size` tasks, and process 0 writes the run folder, which every process must read.

    Returns:
        The trainer, after its last step.

    Raises:
        ValueError: on every process of a pool, when `run` cannot be made or written (a
            file, a path through a file, a folder that takes no new entry), holds a run and
            `resume` is not set, or holds a different config, or the batch does not split
            over the processes; when `record` exists already, is a folder, or its folder is
            missing or takes no new file.
    """
    run = Path(run)
    index, processes = jax.process_index(), jax.process_count()
    problem = None
    try:
        _check_run(config, run, resume=resume)
        _check_split(config, processes)
        _load_tokenizer(config)
        if record is not None and processes > 1:
            raise ValueError("--record traces a single process's run; run it without a pool")
        if record is not None:
            _check_record(record)
    except ValueError as error:
        problem = error
    # Every process refuses alike, before process 0 writes anything.
    default_pool().agree(problem)
    if index == 0:
        run.mkdir(parents=True, exist_ok=True)
        _write_atomically(
            run / "config.json",
            lambda file: file.write(json.dumps(attrs.asdict(config), indent=1).encode()),
        )

    tokenizer = _load_tokenizer(config)
    task = _task(config, tokenizer)
    shape = task.shape
    model_config = config.model_config(shape.max_len, vocab=tokenizer.vocab_size)
    variables = models.init(jax.random.key(config.seed), model_config)
    objective = _objective(model_config, config.temperature)
    trainer = Trainer(
        objective,
        optax.adam(config.learning_rate),
        variables,
        directory=run,
        checkpoint_every=config.checkpoint_every,
        deadline=deadline,
        logs=(SAMPLES, EVALUATIONS),
    )
    if resume:
        trainer.resume()
    tasks = config.batch_size // processes  # this process's share of each batch
    slots = tasks * config.groups * (config.ahead + 1)
    server = RolloutServer(model_config, trainer.variables, slots=slots, version=trainer.updates)
    source = task.source(server, _sampling(config, trainer.updates))
    samples = None
    logs = None
    if index == 0:  # one process writes the run's logs beside metrics.jsonl
        if config.samples:
            source = samples = SampleLog(source, tokenizer, batch_size=tasks, keep=config.samples)
        logs = _RunLogs(config, run, trainer, samples, on_step)
        if config.eval_every:
            logs.evaluation = _Evaluation(task, config, model_config, slots)
    trainer.on_step = on_step if logs is None else logs
    source = task.serve(source, server)
    publisher = server
    recorder = None
    if record is not None:
        recorder = replay.Recorder(record)
        source = replay.RecordingSource(source, recorder)
        publisher = replay.RecordingPublisher(server, recorder)
    rollouts = tasks * config.groups
    scheduler = RolloutScheduler(
        objective,
        source,
        publisher,
        width=shape.width,
        rows=-(-rollouts // shape.chains_per_row),
        tasks=task.tasks,
        groups=config.groups,
        max_lag=config.max_lag,
        ahead=config.ahead,
        sync_every=config.sync_every,
        truncation="score",
        vocab=model_config.vocab,
    )
    per_epoch = config.tasks // config.batch_size * config.batch_size
    dataset = ProcessRows(
        task.dataset(
            config.tasks,
            config.batch_size,
            shuffle_seed=config.seed,
            epochs=-(-config.steps * config.batch_size // per_epoch),
        )
    )
    try:
        if recorder is None:
            try:
                trainer.run(
                    scheduler, scheduler.tasks(dataset), steps=config.steps, ahead=config.ahead
                )
            finally:
                scheduler.close()
        else:
            with recorder.record(scheduler):  # closes the scheduler, then ends the trace
                trainer.run(
                    recorder, recorder.tasks(dataset), steps=config.steps, ahead=config.ahead
                )
    except _Interrupted:
        trainer.save()  # the last completed step's, which no periodic checkpoint may hold
        raise
    finally:
        if logs is not None:
            logs.close()
    if index == 0:
        write_curves(run / METRICS, run / "curves.png", evaluations=run / EVALUATIONS)
    return trainer


class _RunLogs:
    """A run's per-step logs beside `metrics.jsonl` (an `on_step` callback): the decoded samples,
    the greedy evaluations on held-out tasks, TensorBoard, then the caller's own callback."""

    def __init__(
        self,
        config: TrainConfig,
        run: Path,
        trainer: Trainer,
        samples: SampleLog | None,
        on_step: Callable[[Mapping[str, Any]], None] | None,
    ):
        self.config = config
        self.run = run
        self.trainer = trainer
        self.samples = samples
        self.first_position = trainer.position
        self.on_step = on_step
        self.evaluation: _Evaluation | None = None
        self.tensorboard = TensorBoard(run / "tensorboard") if config.tensorboard else None

    def __call__(self, line: Mapping[str, Any]) -> None:
        if self.samples is not None:
            # The scheduler numbers batches from the position its stream opened at.
            batch = line["position"] - self.first_position
            records = [{"step": line["step"], **record} for record in self.samples.take(batch)]
            _append_lines(self.run / SAMPLES, records)
        updates = line["updates"]
        if self.evaluation is not None and updates % self.config.eval_every == 0:
            result = self.evaluation(self.trainer.variables, updates)
            _append_lines(self.run / EVALUATIONS, [result])
            line = {**line, **{f"eval/{key}": value for key, value in result.items()}}
        if self.tensorboard is not None:
            self.tensorboard(line)
        if self.on_step is not None:
            self.on_step(line)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def _append_lines(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as log:
        for record in records:
            log.write(json.dumps(record, allow_nan=False) + "\n")


class _Evaluation:
    """Greedy rollouts of the held-out tasks (the `eval_tasks` ids after the training ones) on
    an engine of their own, in a trio run of their own on the trainer's thread.

    The engine has the training engine's model and slots, so its steps reuse the compiled
    functions.
    """

    def __init__(self, task: _RunTask, config: TrainConfig, model_config, slots: int):
        ids = np.arange(config.tasks, config.tasks + config.eval_tasks, dtype=np.int64)
        self.tasks = list(task.tasks({"task_id": ids}))
        self.task = task
        # Placeholder weights: each evaluation loads the trainer's.
        variables = models.init(jax.random.key(0), model_config)
        self.server = RolloutServer(model_config, variables, slots=slots)

    def __call__(self, variables, updates: int) -> dict[str, Any]:
        """Roll out every held-out task greedily under `variables`.

        Returns:
            `updates`, `reward/mean` (a rollout without a reward counts 0), `status/completed`
            (the share that finished with a stop token) and each task's reward in `rewards`.
        """
        self.server.load(variables, updates)
        sessions = trio.run(self._rollouts)
        rewards = [0.0 if s.reward is None else float(s.reward) for s in sessions]
        completed = [s.status is Status.COMPLETED for s in sessions]
        return {
            "updates": updates,
            "reward/mean": math.fsum(rewards) / len(rewards),
            "status/completed": sum(completed) / len(completed),
            "rewards": rewards,
        }

    async def _rollouts(self):
        sessions = [None] * len(self.tasks)
        # Served afresh in each evaluation's trio run (a served source serves one run).
        greedy = self.task.source(self.server, Sampling(temperature=0.0))
        source = self.task.serve(greedy, self.server)

        async def one(index: int) -> None:
            label = Label(group=index, sample=0, attempt=0)
            sessions[index] = await source.run(self.tasks[index], label)

        async with trio.open_nursery() as nursery:
            for index in range(len(self.tasks)):
                nursery.start_soon(one, index)
        return sessions


def configure_cli(parser: argparse.ArgumentParser) -> None:
    """Add `dew train`'s options: `--config`, one per TrainConfig field, `--run`, `--record` and
    `--resume`."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read the run's config from a TOML file (or a run folder's config.json); the "
        "options given here override it (default: none)",
    )
    default = TrainConfig()
    for field in attrs.fields(TrainConfig):
        value = getattr(default, field.name)
        option = f"--{field.name.replace('_', '-')}"
        help = f"{field.metadata['help']} (default: {'none' if value is None else value})"
        # None marks an option not given, so a --config file or a resumed run keeps its value.
        if isinstance(value, bool):
            parser.add_argument(
                option, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                help=help,
            )  # fmt: skip
            continue
        parser.add_argument(
            option,
            dest=field.name,
            type=field.metadata["type"],
            default=None,
            metavar=field.name.upper(),
            help=help,
        )
    parser.add_argument(
        "--harness",
        metavar="NAME",
        default=None,
        help="train a built-in agent harness through the recording gateway (the task "
        f"harness:NAME): {'; '.join(f'{name}: {h.summary}' for name, h in HARNESSES.items())} "
        "(default: none)",
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
        help="write a trace of the run that `dew replay TRACE` reproduces; a name ending in .gz "
        "is gzip-compressed (default: off)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run from its last checkpoint, with its config "
        "(--steps may extend it) (default: off)",
    )
    pool = parser.add_argument_group(
        "a pool of processes",
        "train data-parallel on several processes: each takes its share of every batch",
    )
    pool.add_argument(
        "--processes",
        type=int,
        metavar="N",
        default=None,
        help="start N processes on this machine, on the loopback interface; their logs go to "
        "the run folder's logs/ (default: one process, no pool)",
    )
    pool.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="join a pool across machines: process 0's address, where it listens",
    )
    pool.add_argument(
        "--num-processes", type=int, metavar="N", default=None, help="the pool's size"
    )
    pool.add_argument(
        "--process-id", type=int, metavar="I", default=None, help="this process's index, 0..N-1"
    )
    pool.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        default=600.0,
        help="in a pool, the seconds a step may take before every process stops, naming the "
        "processes behind (default: 600)",
    )


def run_cli(args: argparse.Namespace) -> int:
    """`dew train [options]`: train a built-in or reasoning-gym task, showing progress; return
    the exit status.

    With `--processes N` it starts the pool's N processes and returns the pool's status; with
    `--coordinator`, `--num-processes` and `--process-id` it is one process of a pool. A run in
    one process stops on Ctrl-C after the step in progress, with its checkpoint, or at once on a
    second Ctrl-C, with one line either way and status INTERRUPTED (`_CtrlC`).

    Raises:
        SystemExit: with status 2, through the parser, for a bad option or run folder.
    """
    given = {f.name: getattr(args, f.name) for f in attrs.fields(TrainConfig)}
    given = {name: value for name, value in given.items() if value is not None}
    _harness_option(args, given)
    if args.resume and args.run_folder is None:
        args.parser.error("--resume needs --run, the folder of the run to continue")
    run = None if args.run_folder is None else Path(args.run_folder)
    joining = _pool_options(args)
    try:
        if args.resume and (run / "config.json").exists():
            saved = TrainConfig.from_json(_read_json(run / "config.json"))
            config = attrs.evolve(saved, **given)
        elif args.config is not None:
            config = TrainConfig.from_file(args.config, **given)
        else:
            config = TrainConfig(**given)
        run = _default_run(config.task) if run is None else run
        # A pool's processes check the folder together, once they have joined.
        if not joining:
            _check_run(config, run, resume=args.resume)
        if args.processes is not None:
            _check_split(config, args.processes)
        if args.record is not None:
            _check_record(args.record)
        _load_tokenizer(config)
        # A damaged checkpoint is refused here, before anything starts or is written.
        commit = read_commit(run / "checkpoints") if args.resume else None
    except ValueError as error:
        args.parser.error(str(error))
    if args.processes is not None:
        return _launch(args, given, run)
    if joining:
        return _join(args, config, run)
    _announce(config, run, commit)
    return _train_until_interrupted(config, run, resume=args.resume, record=args.record)


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
    """

    def __init__(self):
        self.presses = 0
        self._previous = None

    def __enter__(self) -> _CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, *exc_info) -> None:
        # After a press, the process is on its way out: a later one would only interrupt its
        # clean-up (and print "Exception ignored in atexit callback").
        signal.signal(signal.SIGINT, signal.SIG_IGN if self.presses else self._previous)

    def _press(self, signum, frame) -> None:
        self.presses += 1
        if self.presses > 1:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            raise KeyboardInterrupt
        _say(
            "dew train: Ctrl-C: stopping after the step in progress, with its checkpoint "
            "(Ctrl-C again stops at once)"
        )

    def after(self, on_step: Callable[[Mapping[str, Any]], None], steps: int):
        """`on_step`, then, after a press, stop the run: the step is logged and complete. The
        last of `steps` ends the run anyway, which then finishes as usual (curves and all)."""

        def step_ended(line: Mapping[str, Any]) -> None:
            on_step(line)
            if self.presses and line["updates"] < steps:
                raise _Interrupted(line["updates"])

        return step_ended


def _say(text: str) -> None:
    """Write a line to standard error from a signal handler: straight to its file descriptor,
    as the buffered stream may be mid-write in the code the handler interrupted."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without one (a test's capture)
        print(text, file=sys.stderr, flush=True)
        return
    os.write(fd, (text + "\n").encode())


def _train_until_interrupted(
    config: TrainConfig, run: Path, *, resume: bool, record: str | None
) -> int:
    """Train in this process, with progress lines, until the last step or a Ctrl-C (`_CtrlC`);
    return the exit status: 0, or INTERRUPTED after one line saying where it stopped."""
    stopped = None
    # The second press raises KeyboardInterrupt wherever the code is, even in the context's
    # exit: the outer handler takes it there too.
    try:
        with _CtrlC() as ctrl_c:
            try:
                trainer = train(
                    config,
                    run,
                    resume=resume,
                    on_step=ctrl_c.after(Progress(config.steps), config.steps),
                    record=record,
                )
            except _Interrupted as stop:
                stopped = f"stopped after step {stop.updates}/{config.steps}, its checkpoint saved"
    except KeyboardInterrupt:
        stopped = stopped or "stopped at once; the last checkpoint stands"
    if stopped is not None:
        _say(f"dew train: {stopped}: continue with `dew train --run {run} --resume`")
        return INTERRUPTED
    print(
        f"trained {trainer.updates} steps in {trainer.elapsed:.0f}s; metrics, checkpoints "
        f"and curves.png in {run}",
        flush=True,
    )
    return 0


def _harness_option(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """Make `--harness NAME` the task `harness:NAME` in `given`, or exit 2 naming the built-in
    harnesses when NAME is not one, or when `--task` is given too."""
    if args.harness is None:
        return
    if "task" in given:
        args.parser.error("--harness NAME is the task harness:NAME: give --task or --harness")
    try:
        _check_harness(args.harness)
    except ValueError as error:
        args.parser.error(f"--harness: {error}")
    given["task"] = HARNESS + args.harness


def _pool_options(args: argparse.Namespace) -> bool:
    """Check the pool's options; return whether this process joins a pool (--coordinator)."""
    joining = [args.coordinator, args.num_processes, args.process_id]
    if args.processes is not None:
        if any(option is not None for option in joining):
            args.parser.error(
                "--processes starts a pool of its own: leave out --coordinator, "
                "--num-processes and --process-id"
            )
        if args.processes < 1:
            args.parser.error(f"--processes must be an int >= 1, got {args.processes}")
    elif any(option is not None for option in joining) and None in joining:
        args.parser.error("joining a pool takes --coordinator, --num-processes and --process-id")
    if not 0 < args.deadline < math.inf:
        args.parser.error(f"--deadline must be a finite number of seconds > 0, got {args.deadline}")
    return args.coordinator is not None


def _announce(config: TrainConfig, run: Path, commit: Mapping[str, Any] | None) -> None:
    """Say what runs where, and where a resumed run's checkpoint (`commit`, read and checked
    by `read_commit`) continues."""
    print(f"dew train: {config.task} for {config.steps} steps in {run}", flush=True)
    if commit is not None:
        print(
            f"resuming at step {commit['updates']}, data position {commit['position']}",
            flush=True,
        )


def _launch(args: argparse.Namespace, given: Mapping[str, Any], run: Path) -> int:
    """Start the pool of `--processes` local processes, each `dew train` joining it; return the
    pool's status (the first failure's)."""
    logs = run / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:  # a free port for the coordinator
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = [] if args.config is None else ["--config", str(args.config)]
    for name, value in given.items():
        option = name.replace("_", "-")
        if isinstance(value, bool):  # a --flag/--no-flag pair takes no value
            options.append(f"--{option}" if value else f"--no-{option}")
        else:
            options.append(f"--{option}={value}")
    options += ["--run", str(run), "--deadline", str(args.deadline)]
    options += ["--resume"] if args.resume else []
    commands = [
        [sys.executable, "-m", "dew", "train", *options, "--coordinator", f"127.0.0.1:{port}"]
        + ["--num-processes", str(args.processes), "--process-id", str(index)]
        for index in range(args.processes)
    ]
    paths = [logs / f"process-{index}.log" for index in range(args.processes)]
    print(f"dew train: a pool of {args.processes} processes; their logs in {logs}", flush=True)
    return run_pool(commands, paths, echo=sys.stdout, report=sys.stderr)


def _join(args: argparse.Namespace, config: TrainConfig, run: Path) -> int:
    """Be process --process-id of the pool at --coordinator: train, or stop the whole pool with
    a line naming the process that stopped it."""
    try:
        _pool_guard.join(args.coordinator, args.num_processes, args.process_id)
    except ValueError as error:
        args.parser.error(str(error))
    print(f"process {args.process_id} of {args.num_processes} (pid {os.getpid()})", flush=True)
    try:
        _announce(config, run, read_commit(run / "checkpoints") if args.resume else None)
        trainer = train(
            config,
            run,
            resume=args.resume,
            on_step=Progress(config.steps),
            deadline=args.deadline,
        )
    except Exception as error:
        print(_pool_guard.stop(error), file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # An orderly exit would wait in jax.distributed's shutdown for processes that are gone.
        os._exit(1)
    print(
        f"trained {trainer.updates} steps in {trainer.elapsed:.0f}s; metrics, checkpoints "
        f"and curves.png in {run}",
        flush=True,
    )
    return 0


def _default_run(task: str) -> Path:
    # A reasoning-gym task names the folder by its dataset, without its options.
    name = task.removeprefix(PREFIX).removeprefix(HARNESS).split(",")[0]
    return Path("dew-runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
