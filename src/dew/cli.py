"""The `dew` command: one subcommand per entry of `COMMANDS`.

Each entry names its subcommand and gives its one-line summary, a function that adds its options
to its own argparse parser, and a function that runs it from the parsed options and returns the
exit status; adding a subcommand is adding an entry.

    dew simulate           # the long-tail table: what ahead, oversample and admit buy
    dew simulate --smoke   # the same, tiny
    dew tune run.trace     # calibrate the simulation from a recorded run and tabulate the knobs
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

import attrs

from dew import replay, simulate, train, tune
from dew._checks import int_option, number_option, span_option
from dew.serve import _vllm_serve


@attrs.frozen
class Command:
    """One subcommand of `dew`.

    Args:
        summary: the line `dew --help` shows for it.
        configure: adds its options to its parser.
        run: runs it from the parsed options; returns the exit status.
    """

    summary: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# The simulate options that set a Workload field: (option, field, type, help). Each type bounds
# its values: a typo of a few zeros would otherwise simulate for hours.
_WORKLOAD_OPTIONS = (
    ("--seed", "seed", int_option(0, 2**32 - 1), "seeds the simulated rollouts"),
    ("--steps", "steps", int_option(1, 10**4), "trainer steps per setting"),
    ("--slots", "slots", int_option(1, 2**20), "calls the engine decodes at once (C)"),
    ("--tasks", "tasks", int_option(1, 4096), "tasks per batch, one group each"),
    ("--groups", "groups", int_option(1, 4096), "rollouts per task that train together"),
    ("--duration-mean", "duration_mean", number_option(0, 1e6), "a rollout's mean model seconds"),
    ("--duration-sigma", "duration_sigma", number_option(0, 10), "the lognormal duration's sigma"),
    ("--calls", "calls", span_option(1, 64), "engine calls per rollout, N or LOW-HIGH"),
    ("--step-time", "step_time", number_option(0, 1e6), "trainer seconds per step (T)"),
)


MAX_SIMULATED = 10**5
"""The most rollouts `dew simulate` simulates a setting: the whole table then takes minutes."""

MAX_SIMULATED_SECONDS = 600
"""The most CPU-seconds `dew simulate`'s table may be estimated to take
(`simulate.estimated_seconds`): engine calls and large groups multiply a rollout's cost, so a
table within every option's bounds could otherwise run for hours."""


def _configure_simulate(parser: argparse.ArgumentParser) -> None:
    default, smoke = simulate.Workload(), simulate.Workload.smoke()
    for option, field, kind, text in _WORKLOAD_OPTIONS:
        value, small = (_shown(getattr(workload, field)) for workload in (default, smoke))
        shown = f"default: {value}" + ("" if small == value else f", {small} with --smoke")
        # None marks an option not given, so --smoke's workload keeps its own value for it.
        parser.add_argument(
            option,
            dest=field,
            type=kind,
            default=None,
            metavar=field.split("_")[-1].upper(),
            help=f"{text} ({shown})",
        )
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny workload that runs in seconds, for CI"
    )


def _shown(value) -> str:
    """A workload field's value as its option takes it: a (low, high) span as LOW-HIGH."""
    return "-".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _run_simulate(args: argparse.Namespace) -> int:
    given = {
        field: getattr(args, field)
        for _, field, _, _ in _WORKLOAD_OPTIONS
        if getattr(args, field) is not None
    }
    base = simulate.Workload.smoke() if args.smoke else simulate.Workload()
    try:
        workload = attrs.evolve(base, **given)
        rollouts = workload.steps * workload.tasks * workload.groups
        if rollouts > MAX_SIMULATED:
            raise ValueError(
                f"steps x tasks x groups must be <= {MAX_SIMULATED} rollouts a setting, got "
                f"{workload.steps} x {workload.tasks} x {workload.groups}"
            )
        seconds = simulate.estimated_seconds(workload)
        if seconds > MAX_SIMULATED_SECONDS:
            raise ValueError(
                f"--steps {workload.steps} x --tasks {workload.tasks} x --groups "
                f"{workload.groups} x --calls {_shown(workload.calls)} would simulate for about "
                f"{seconds / 60:.0f} CPU-minutes, more than {MAX_SIMULATED_SECONDS // 60}: "
                "lower one of them"
            )
        count = len(simulate.settings(workload))
        _progress(f"{count} settings, about {seconds:.0f} CPU-seconds")

        def done(index: int, outcome: simulate.Outcome) -> None:
            _progress(f"{outcome.setting.name} simulated ({index + 1}/{count})")

        # Long trainer waits are what the simulation measures, not news to log.
        with _quiet("dew.objectives.rl.scheduler"):
            outcomes = simulate.long_tail(workload, done=done)
    except ValueError as error:
        args.parser.error(str(error))
    print(simulate.report(workload, outcomes))
    return 0


def _progress(text: str) -> None:
    """A progress line of `dew simulate`, on standard error (the table goes to standard out)."""
    print(f"dew simulate: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Keep logger `name` to errors inside the block, and restore its level after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


COMMANDS: dict[str, Command] = {
    "train": Command(
        summary="train a policy on a built-in task end to end, and write a run folder",
        configure=train.configure_cli,
        run=train.run_cli,
    ),
    "simulate": Command(
        summary="simulate the rollout long tail under each scheduler setting and tabulate it",
        configure=_configure_simulate,
        run=_run_simulate,
    ),
    "tune": Command(
        summary="calibrate the simulation from recorded runs and tabulate each knob setting",
        configure=tune.configure_cli,
        run=tune.run_cli,
    ),
    "export": Command(
        summary="write a dew train --model run's last checkpoint as a Hugging Face folder",
        configure=train.configure_export_cli,
        run=train.run_export_cli,
    ),
    "serve": Command(
        summary="start a vLLM server for a checkpoint folder, for dew train --engine-url",
        configure=_vllm_serve.configure_cli,
        run=_vllm_serve.run_cli,
    ),
    "replay": Command(
        summary="replay a recorded run under a mock clock and say where it first differs",
        configure=replay.configure_cli,
        run=replay.run_cli,
    ),
}


def finite_float(text: str) -> float:
    """A float option's value, refused unless finite: an infinite or NaN duration, rate or
    weight makes a command hang or train on NaN rather than fail.

    Raises:
        argparse.ArgumentTypeError: naming the value (argparse adds the option).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _finite_floats(parser: argparse.ArgumentParser) -> None:
    """Make every `type=float` option of parser take finite floats only, whichever command's
    configure added it."""
    for action in parser._actions:
        if action.type is float:
            action.type = finite_float


class _Parser(argparse.ArgumentParser):
    """An argument parser whose refusals are the error and a hint, two lines: argparse's own
    print the whole usage block first, in which a newcomer must hunt for the one line that
    matters."""

    def error(self, message: str) -> NoReturn:
        """Print `PROG: error: MESSAGE` and where the options are described; exit with 2."""
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def parser() -> argparse.ArgumentParser:
    """The `dew` argument parser, with one subparser per entry of COMMANDS; every float option of
    every command takes finite numbers only, and every refusal is one line and a hint."""
    top = _Parser(prog="dew", description="Asynchronous RL of language-model agents.")
    # The metavar lists the commands: the error for a missing one names them.
    subparsers = top.add_subparsers(
        title="commands", dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}"
    )
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.summary, description=command.summary)
        command.configure(sub)
        _finite_floats(sub)
        sub.set_defaults(run=command.run, parser=sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run `dew` with argv (the process's arguments when None); return the exit status.

    Raises:
        SystemExit: for --help, and with status 2 for a bad option or value.
    """
    args = parser().parse_args(argv)
    return args.run(args)
