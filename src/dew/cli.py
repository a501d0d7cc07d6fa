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
from collections.abc import Callable, Iterator, Sequence

import attrs

from dew import replay, simulate, train, tune


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


# The simulate options that set a Workload field: (option, field, type, help).
_WORKLOAD_OPTIONS = (
    ("--seed", "seed", int, "seeds the simulated rollouts"),
    ("--steps", "steps", int, "trainer steps per setting"),
    ("--slots", "slots", int, "calls the engine decodes at once (C)"),
    ("--tasks", "tasks", int, "tasks per batch, one group each"),
    ("--groups", "groups", int, "rollouts per task that train together"),
    ("--duration-mean", "duration_mean", float, "mean seconds of a rollout's model time"),
    ("--duration-sigma", "duration_sigma", float, "sigma of the lognormal duration's log"),
    ("--step-time", "step_time", float, "seconds the trainer spends on each step (T)"),
)


def _configure_simulate(parser: argparse.ArgumentParser) -> None:
    default, smoke = simulate.Workload(), simulate.Workload.smoke()
    for option, field, kind, text in _WORKLOAD_OPTIONS:
        value, small = getattr(default, field), getattr(smoke, field)
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


def _run_simulate(args: argparse.Namespace) -> int:
    given = {
        field: getattr(args, field)
        for _, field, _, _ in _WORKLOAD_OPTIONS
        if getattr(args, field) is not None
    }
    base = simulate.Workload.smoke() if args.smoke else simulate.Workload()
    try:
        workload = attrs.evolve(base, **given)
        # Long trainer waits are what the simulation measures, not news to log.
        with _quiet("dew.objectives.rl.scheduler"):
            outcomes = simulate.long_tail(workload)
    except ValueError as error:
        args.parser.error(str(error))
    print(simulate.report(workload, outcomes))
    return 0


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
    "replay": Command(
        summary="replay a recorded run under a mock clock and say where it first differs",
        configure=replay.configure_cli,
        run=replay.run_cli,
    ),
}


def parser() -> argparse.ArgumentParser:
    """The `dew` argument parser, with one subparser per entry of COMMANDS."""
    top = argparse.ArgumentParser(
        prog="dew", description="Asynchronous RL of language-model agents."
    )
    subparsers = top.add_subparsers(title="commands", dest="command", required=True)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.summary, description=command.summary)
        command.configure(sub)
        sub.set_defaults(run=command.run, parser=sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run `dew` with argv (the process's arguments when None); return the exit status.

    Raises:
        SystemExit: for --help, and with status 2 for a bad option or value.
    """
    args = parser().parse_args(argv)
    return args.run(args)
