"""`dew train`: the built-in tasks end to end, its config, and its command line."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import jax
import numpy as np
import optax

from dew import models, replay
from dew._checks import int_at_least, positive
from dew.data import Task
from dew.envs.environment import Sampling
from dew.envs.tasks import CopyDigits, GuessDigit
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.serve import RolloutServer, ServedSource, tokenizer
from dew.train._checkpoint import COMMIT, _write_atomically
from dew.train._curves import write_curves
from dew.train._progress import Progress
from dew.train._trainer import METRICS, Trainer

TASKS = ("copy", "guess")
"""The built-in tasks `dew train --task` runs: CopyDigits and GuessDigit."""


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
        """The transformer's config for this run, with positions up to `max_len`."""
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
