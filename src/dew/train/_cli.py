"""The `dew train` command: its options, and a run in this process or on a pool of processes.

The run itself is `_run.train`; its config `_config.TrainConfig`; its paths are checked by
`_folders` and its Ctrl-C handled by `_interrupt`.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from dew import _pool_guard
from dew._checks import int_option, number_option
from dew._launch import run_pool
from dew.envs.lookup import HARNESSES
from dew.models.hf import lora
from dew.serve._vllm_process import VLLMError
from dew.train._checkpoint import COMMIT, read_commit
from dew.train._config import TrainConfig
from dew.train._config_fields import ENVIRONMENTS, HARNESS, _check_harness
from dew.train._config_preflight import _check_task, _load_environment, _load_tokenizer, _mesh_sizes
from dew.train._folders import (
    Misfit,
    RunInUse,
    _check_record,
    _check_run,
    _check_split,
    _default_run,
    _history,
    _run_config,
)
from dew.train._interrupt import INTERRUPTED, _CtrlC, _Interrupted, _say, any_process
from dew.train._progress import Progress
from dew.train._run import train
from dew.train._run_checks import _check_memory, _check_minibatches
from dew.train._step_lines import NothingTrained
from dew.train._tasks import _check_checkpoint_task


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
            type=_checked(field),
            default=None,
            metavar=field.name.upper(),
            help=help,
            **({"nargs": field.metadata["nargs"]} if "nargs" in field.metadata else {}),
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
        "--env",
        metavar="SPEC",
        default=None,
        help="train an environment of another package (the task SPEC): verifiers:NAME"
        "[,key=value...] (a verifiers environment, its agents' model calls through the "
        "recording gateway) or textarena:GAME[,key=value...] (Wordle-v0, TicTacToe-v0 against "
        "a fixed opponent) (default: none)",
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
        type=int_option(1, 1024),
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
        "--num-processes",
        type=int_option(1, 2**16),
        metavar="N",
        default=None,
        help="the pool's size",
    )
    pool.add_argument(
        "--process-id",
        type=int_option(0, 2**16 - 1),
        metavar="I",
        default=None,
        help="this process's index, 0..N-1",
    )
    pool.add_argument(
        "--deadline",
        type=number_option(0, 7 * 86400),
        metavar="SECONDS",
        default=600.0,
        help="in a pool, the seconds a step may take before every process stops, naming the "
        "processes behind (default: 600)",
    )


def _checked(field: attrs.Attribute) -> Callable[[str], Any]:
    """The argparse type of `field`'s option: its text as the field's type, checked by the
    field's own validator, so that a value out of bounds is refused naming the option (and the
    bound, in one place: the field's declaration)."""
    kind = field.metadata["type"]

    def parse(text: str) -> Any:
        value = kind(text)  # argparse names the option and the type when this fails
        try:
            field.validator(None, field, value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value

    parse.__name__ = kind.__name__
    return parse


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
    began = time.monotonic()  # the summary's time: the command's, servers' start included
    given = {f.name: getattr(args, f.name) for f in attrs.fields(TrainConfig)}
    given = {name: value for name, value in given.items() if value is not None}
    _harness_option(args, given)
    _env_option(args, given)
    if args.resume and args.run_folder is None:
        args.parser.error("--resume needs --run, the folder of the run to continue")
    run = None if args.run_folder is None else Path(args.run_folder)
    joining = _pool_options(args)
    try:
        # A resumed run's config is the one it was trained with (its checkpoint's).
        saved = _run_config(run) if args.resume else None
        if saved is not None:
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
        tokenizer = _load_tokenizer(config)
        _mesh_sizes(config, args.processes or args.num_processes or 1, count=not joining)
        _check_task(config)
        _load_environment(config)
        _check_checkpoint_task(config, tokenizer)
        if not joining:  # a pool's process checks it in train(), after jax.distributed starts
            _check_memory(config, tokenizer, args.processes or 1)
            _check_minibatches(config, tokenizer, args.processes or 1)
        # A damaged checkpoint is refused here, before anything starts or is written.
        commit = read_commit(run / "checkpoints") if args.resume else None
    except ValueError as error:
        args.parser.error(str(error))
    if args.processes is not None:
        return _launch(args, given, run)
    if joining:
        return _join(args, config, run, began)
    _announce(config, run, commit, resume=args.resume)
    return _train_until_interrupted(
        config, run, resume=args.resume, record=args.record, began=began
    )


def _train_until_interrupted(
    config: TrainConfig, run: Path, *, resume: bool, record: str | None, began: float
) -> int:
    """Train in this process, with progress lines, until the last step or a Ctrl-C (`_CtrlC`);
    return the exit status: 0, INTERRUPTED after one line saying where it stopped, or 1 after
    one line saying that the run trained on nothing (`NothingTrained`)."""
    stopped = None
    # The second press raises KeyboardInterrupt wherever the code is, even in the context's
    # exit: the outer handler takes it there too.
    try:
        with _CtrlC(terminate=True) as ctrl_c:
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
            except NothingTrained as nothing:
                _say(f"dew train: {nothing}")
                return 1
            except RunInUse as error:  # found once the run holds its folder, not before
                _say(f"dew train: {error}")
                return 1
            except Misfit as error:  # found once the model is built, not before
                _say(f"dew train: {error}")
                return 1
            except OSError as error:  # a full disk, a folder gone: the run cannot go on
                where = error.filename or run
                _say(f"dew train: cannot write {where}: {error.strerror or error}; {_then(run)}")
                return 1
            except FloatingPointError as error:  # the step that went non-finite, named
                _say(f"dew train: {error}")
                return 1
            except VLLMError as error:  # servers that cannot serve the run, named by URL
                _say(f"dew train: {error}")
                return 1
    except KeyboardInterrupt:
        stopped = stopped or "stopped at once; the last checkpoint stands"
    if stopped is not None:
        _say(f"dew train: {stopped}: continue with `dew train --run {run} --resume`")
        return INTERRUPTED
    print(_summary(trainer, run, began), flush=True)
    return 0


def _summary(trainer, run: Path, began: float) -> str:
    """The run's last line: its steps and the command's wall time since `began` (loading the
    model and starting vLLM servers included, which the trainer's own `elapsed`, the steps'
    time summed over the run's resumes, leaves out)."""
    line = (
        f"trained {trainer.updates} steps in {time.monotonic() - began:.0f}s of wall time "
        f"({trainer.elapsed:.0f}s in steps); metrics, checkpoints and curves.png in {run}"
    )
    if isinstance(trainer.objective.model, lora.LoRAModel):
        held = lora.footprint(trainer.variables, trainer.opt_state)
        line += (
            f"\nLoRA: {_megabytes(held['adapter'])} of adapter and "
            f"{_megabytes(held['optimizer'])} of optimizer state over the frozen "
            f"{_megabytes(held['base'])} of params; full fine-tuning would hold "
            f"{_megabytes(held['base'])} of gradients and {_megabytes(held['full_optimizer'])} "
            "of Adam's state"
        )
    return line


def _megabytes(count: int) -> str:
    return f"{count / 2**20:.2f} MiB"


def _then(run: Path) -> str:
    """What to do once a run that could not write its folder can write it: resume from its
    last checkpoint, or, when its steps were logged but none checkpointed (which `--resume`
    refuses to train over: `_check_run`), start afresh."""
    if (run / "checkpoints" / COMMIT).exists() or not _history(run):
        return (
            f"the last checkpoint stands: continue with `dew train --run {run} --resume` once "
            "it can be written"
        )
    return (
        "its steps were logged but none checkpointed, so there is nothing to resume: start "
        "afresh with another --run once it can be written"
    )


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


def _env_option(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """Make `--env SPEC` the task SPEC in `given`, or exit 2 naming the prefixes when SPEC has
    none, or when `--task` or `--harness` is given too."""
    if args.env is None:
        return
    if "task" in given:
        args.parser.error("--env SPEC is the task SPEC: give one of --task, --harness and --env")
    if not args.env.startswith(tuple(ENVIRONMENTS)):
        args.parser.error(
            f"--env {args.env}: name verifiers:NAME[,key=value...] or textarena:GAME[,...]"
        )
    given["task"] = args.env


def _pool_options(args: argparse.Namespace) -> bool:
    """Check the pool's options; return whether this process joins a pool (--coordinator)."""
    joining = [args.coordinator, args.num_processes, args.process_id]
    if args.processes is not None:
        if any(option is not None for option in joining):
            args.parser.error(
                "--processes starts a pool of its own: leave out --coordinator, "
                "--num-processes and --process-id"
            )
    elif any(option is not None for option in joining) and None in joining:
        args.parser.error("joining a pool takes --coordinator, --num-processes and --process-id")
    if args.deadline <= 0:
        args.parser.error(f"--deadline must be a finite number of seconds > 0, got {args.deadline}")
    return args.coordinator is not None


def _announce(
    config: TrainConfig, run: Path, commit: Mapping[str, Any] | None, *, resume: bool
) -> None:
    """Say what runs where, and where a resumed run's checkpoint (`commit`, read and checked
    by `read_commit`) continues, or that there is none to continue from (a mistyped --run
    would otherwise start afresh without a word)."""
    print(f"dew train: {config.task} for {config.steps} steps in {run}", flush=True)
    if commit is not None:
        print(
            f"resuming at step {commit['updates']}, data position {commit['position']}",
            flush=True,
        )
    elif resume:
        print(f"no checkpoint in {run / 'checkpoints'}: training from the first step", flush=True)


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
        elif isinstance(value, list | tuple):  # an option of several values (--engine-url)
            options += [f"--{option}", *map(str, value)]
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
    return run_pool(commands, paths, echo=sys.stdout, report=sys.stderr, graceful=True)


def _join(args: argparse.Namespace, config: TrainConfig, run: Path, began: float) -> int:
    """Be process --process-id of the pool at --coordinator: train, or stop the whole pool with
    a line naming the process that stopped it."""
    try:
        _pool_guard.join(args.coordinator, args.num_processes, args.process_id)
    except ValueError as error:
        args.parser.error(str(error))
    print(f"process {args.process_id} of {args.num_processes} (pid {os.getpid()})", flush=True)
    try:
        commit = read_commit(run / "checkpoints") if args.resume else None
        _announce(config, run, commit, resume=args.resume)
        # The launcher passes a Ctrl-C on to every process: the pool agrees after each step
        # whether any was pressed, and all stop after the same step, with its checkpoint.
        with _CtrlC() as ctrl_c:
            trainer = train(
                config,
                run,
                resume=args.resume,
                on_step=ctrl_c.after(Progress(config.steps), config.steps, agree=any_process),
                deadline=args.deadline,
            )
    except _Interrupted as stop:
        _say(
            f"dew train: stopped after step {stop.updates}/{config.steps}, its checkpoint saved: "
            f"continue with `dew train --run {run} --resume --processes {args.num_processes}`"
        )
        return INTERRUPTED
    except NothingTrained as nothing:
        # Every process finds it at the same step: `tokens` is counted over the pool's batch.
        _say(f"dew train: process {args.process_id}: {nothing}")
        sys.stdout.flush()
        os._exit(1)
    except Exception as error:
        print(_pool_guard.stop(error), file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # An orderly exit would wait in jax.distributed's shutdown for processes that are gone.
        os._exit(1)
    print(_summary(trainer, run, began), flush=True)
    return 0
