"""`dew tune TRACE...`: its options, each checked as it is parsed and named when refused, and
the command that fits the traces, simulates the grid and prints the table (and draws the front).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import attrs

from dew import calibrate
from dew._checks import int_option, number_option
from dew.simulate import WASTE_BUDGET, Contention, describe
from dew.tune._calibration import calibrated, recorded_budgets, time_trainer
from dew.tune._grid import Grid, admitted, sized_to_ahead, sized_to_rows, timed_rows, tune
from dew.tune._report import plot, table

# The most values one knob of the grid may list, and the most simulated runs (settings x
# seeds) one `dew tune` makes: each run takes a moment, so a grid past these takes hours.
MAX_VALUES = 64
MAX_RUNS = 4096
MAX_SLOTS = 2**20
# What --plot writes: matplotlib draws these by the file's suffix.
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def _items(text: str, parse: Callable[[str], object]) -> tuple:
    """At most MAX_VALUES comma-separated values, each parsed by `parse` and listed once: a
    value listed twice would add no row, and is more likely a typo than a wish.

    Raises:
        argparse.ArgumentTypeError: naming the empty item, the count or the repeated value.
    """
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list, got {text!r}")
    if len(items) > MAX_VALUES:
        raise argparse.ArgumentTypeError(f"must list at most {MAX_VALUES} values, got {len(items)}")
    values = tuple(parse(item) for item in items)
    for i, value in enumerate(values):
        if value in values[:i]:
            raise argparse.ArgumentTypeError(
                f"must list each value once, got {items[i]!r} again in {text!r}"
            )
    return values


def _int_list(low: int, high: int, word: str | None = None, keep: str | None = None):
    """A parser of at most MAX_VALUES comma-separated ints within [low, high], each listed
    once; `word` (when given) stands for None, and `keep` (when given) is kept as it is."""
    single = int_option(low, high)
    words = ", ".join(f"{w!r}" for w in (word, keep) if w is not None)

    def one(item: str) -> int | str | None:
        if item in (word, keep):
            return None if item == word else item
        try:
            return single(item)
        except argparse.ArgumentTypeError:
            if not words:
                raise
            raise argparse.ArgumentTypeError(
                f"must be an int within [{low}, {high}] or one of {words}, got {item!r}"
            ) from None

    return lambda text: _items(text, one)


def _budget_list(text: str) -> tuple[float, ...]:
    """--waste-budget's comma-separated shares, each a number within [0, 1) (the scheduler's
    and `dew train --waste-budget`'s bounds), each listed once."""

    def one(item: str) -> float:
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not 0 <= value < 1:
            raise argparse.ArgumentTypeError(f"must be a number within [0, 1), got {item!r}")
        return value

    return _items(text, one)


def _hedges(text: str) -> tuple[bool, ...]:
    words = {"on": True, "off": False}
    values = [value.strip() for value in text.split(",")]
    if any(value not in words for value in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"must be on, off or on,off, got {text!r}")
    return tuple(words[value] for value in values)


def _slots(text: str) -> int | str | None:
    if text in ("observed", "unbounded"):
        return None if text == "unbounded" else text
    try:
        return int_option(1, MAX_SLOTS)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be an int within [1, {MAX_SLOTS}], 'observed' or 'unbounded', got {text!r}"
        ) from None


def _contention(text: str) -> bool | Contention:
    if text in ("off", "fit"):
        return text == "fit"
    parts = text.split(",")
    factor = number_option(0.0, 1000.0)
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(
            f"must be 'off', 'fit' or TRAINER,ENGINE (two factors >= 0), got {text!r}"
        )
    return Contention(trainer=factor(parts[0].strip()), engine=factor(parts[1].strip()))


def configure_cli(parser: argparse.ArgumentParser) -> None:
    """Add `dew tune`'s arguments: the traces, the grid, the simulation and the limits."""
    default = Grid()
    parser.add_argument(
        "traces", nargs="+", metavar="TRACE", help="recorded runs (dew train --record)"
    )
    knobs = parser.add_argument_group("the grid (comma-separated values)")
    knobs.add_argument(
        "--ahead", type=_int_list(0, 64), default=default.ahead, help="default: 0,1,2"
    )
    knobs.add_argument(
        "--oversample", type=_int_list(0, 4096), default=default.oversample, help="default: 0"
    )
    knobs.add_argument(
        "--admit",
        type=_int_list(1, 4096, "all", "auto"),
        default=default.admit,
        help="groups admitted per batch, 'all' for every task's, 'auto' for the scheduler's "
        "own choice each call (default: all)",
    )
    knobs.add_argument(
        "--carry-over",
        action="store_true",
        help="also each admit setting with carry-over (the groups admit cuts train later)",
    )
    knobs.add_argument(
        "--hedge",
        type=_hedges,
        default=default.hedge,
        metavar="on|off|on,off",
        help="whether the carry-over settings back up their carried groups' stragglers with "
        "fresh samples ('off' is dew train --no-hedge; needs --carry-over; default: on)",
    )
    knobs.add_argument(
        "--waste-budget",
        type=_budget_list,
        default=None,
        metavar="SHARE[,SHARE...]",
        help="the admit auto settings' waste budgets, each within [0, 1) (dew train "
        "--waste-budget; needs --admit auto; default: the budget each trace that ran admit "
        f"auto recorded, else {WASTE_BUDGET})",
    )
    knobs.add_argument(
        "--sync-every", type=_int_list(1, 1000), default=default.sync_every, help="default: 1,2"
    )
    knobs.add_argument(
        "--max-lag",
        type=_int_list(0, 10**4, "least"),
        default=default.max_lag,
        help="'least' for the least ahead + sync_every - 1 allows; values below it are left "
        "out (default: least)",
    )
    run = parser.add_argument_group("the simulation")
    run.add_argument(
        "--steps",
        type=int_option(1, 10**4),
        default=24,
        help="trainer steps per run, warmup included (default: 24)",
    )
    run.add_argument(
        "--warmup",
        type=int_option(0, 10**4),
        default=2,
        help="first trainer calls left out of the fit and the figures (default: 2)",
    )
    run.add_argument(
        "--seeds", type=int_option(1, 1000), default=3, help="runs per setting (default: 3)"
    )
    run.add_argument(
        "--seed",
        type=int_option(0, 2**32 - 1),
        default=0,
        help="the first run's seed (default: 0)",
    )
    run.add_argument(
        "--slots",
        type=_slots,
        default="observed",
        help="the engine's slots: an int, 'observed' (the most rollouts the traces had in "
        "flight) or 'unbounded' (default: observed)",
    )
    run.add_argument(
        "--step-time",
        type=number_option(0.0, 86400.0),
        default=None,
        help="the trainer's seconds per step instead of the traces' own step times",
    )
    run.add_argument(
        "--engine-scaling",
        type=number_option(0.0, 10.0),
        default=0.0,
        metavar="EXPONENT",
        help="for an engine sized to ahead as dew train's is: a setting's rollouts take "
        "((ahead + 1) / (the trace's ahead + 1)) ** EXPONENT times as long; about 1 for dew "
        "train's CPU engine (default: 0, one engine for every setting)",
    )
    run.add_argument(
        "--trainer-scaling",
        type=number_option(0.0, 10.0),
        default=0.0,
        metavar="EXPONENT",
        help="for a trainer whose rows are sized to admit as dew train's are: a setting that "
        "trains A groups a step where the trace trained R steps (A / R) ** EXPONENT times as "
        "long; about 1 for dew train's CPU trainer (default: 0, one trainer for every setting)",
    )
    run.add_argument(
        "--time-trainer",
        metavar="RUN",
        default=None,
        help="the recorded run's folder (dew train --run): time its trainer's step on this "
        "machine at the rows each setting trains, and scale the traces' step times by those "
        "seconds rather than by --trainer-scaling's power of the rows",
    )
    run.add_argument(
        "--contention",
        type=_contention,
        default=False,
        metavar="off|fit|TRAINER,ENGINE",
        help="how the trainer's and the engine's CPU work slow each other while both run: "
        "'fit' for the factors fitted to the traces, or two factors of your own (each side's "
        "extra seconds per solo second while the other is busy); default: off",
    )
    run.add_argument(
        "--jobs", type=int_option(1, 256), default=1, help="processes to simulate in (default: 1)"
    )
    limits = parser.add_argument_group("the front")
    limits.add_argument(
        "--max-waste",
        type=number_option(0.0, 1.0),
        default=None,
        help="the most wasted share of rollout-seconds a setting may have (default: none)",
    )
    limits.add_argument(
        "--max-bias",
        type=number_option(0.0, 1e6),
        default=None,
        help="the most |1 - selection| a setting may have (default: none)",
    )
    limits.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw goodput against lag and the front into this PNG",
    )


def run_cli(args: argparse.Namespace) -> int:
    """`dew tune TRACE...`: print the fit, then every setting's figures and the front.

    Raises:
        SystemExit: with status 2, through the parser, for a bad option or trace.
    """
    if args.warmup >= args.steps:
        args.parser.error(f"argument --warmup: must be < --steps {args.steps}, got {args.warmup}")
    if args.waste_budget is not None and "auto" not in args.admit:
        admit = ",".join("all" if value is None else str(value) for value in args.admit)
        args.parser.error(
            "argument --waste-budget: it bounds the cut of --admit auto: give --admit auto too, "
            f"got --admit {admit}"
        )
    plot_path = None
    if args.plot is not None:
        try:
            plot_path = _plot_path(args.plot)
        except ValueError as error:
            args.parser.error(f"argument --plot: {error}")
    try:
        traces, fitted, workload = calibrated(
            args.traces,
            warmup=args.warmup,
            steps=args.steps,
            seed=args.seed,
            slots=args.slots,
            contention=args.contention,
        )
    except (OSError, ValueError) as error:
        args.parser.error(f"argument TRACE: {error}")
    print(calibrate.report(fitted))
    budgets = args.waste_budget or (WASTE_BUDGET,)
    recorded = recorded_budgets(traces)
    if args.waste_budget is None and "auto" in args.admit and recorded:
        budgets = recorded
        shown = ", ".join(map(repr, recorded))
        print(f"admit auto at the waste budget the traces recorded: {shown} (--waste-budget)")
    if args.step_time is not None:
        workload = attrs.evolve(workload, step_time=args.step_time, step_times=())
    carry = (False, True) if args.carry_over else (False,)
    if args.carry_over and all(admit is None for admit in args.admit):
        args.parser.error(
            "argument --carry-over: it carries the groups --admit cuts: give --admit a value "
            "other than all"
        )
    if False in args.hedge and not args.carry_over:
        args.parser.error(
            "argument --hedge: 'off' backs up no carried group's stragglers: give --carry-over too"
        )
    grid = Grid(
        args.ahead,
        args.oversample,
        args.admit,
        args.sync_every,
        args.max_lag,
        carry,
        args.hedge,
        budgets,
    )
    try:
        settings = grid.settings(workload.tasks)
    except ValueError as error:
        option = "--admit" if str(error).startswith("admit") else "--max-lag"
        args.parser.error(f"argument {option}: {error}")
    if len(settings) * args.seeds > MAX_RUNS:
        args.parser.error(
            f"the grid's {len(settings)} settings x --seeds {args.seeds} must make at most "
            f"{MAX_RUNS} simulated runs; list fewer values or seeds"
        )
    engine = None
    if args.engine_scaling > 0:
        if len(set(fitted.aheads)) > 1:
            args.parser.error(
                f"argument --engine-scaling: the traces ran at different ahead {fitted.aheads}"
            )
        engine = sized_to_ahead(fitted.aheads[0], args.engine_scaling)
    trainer = None
    if args.trainer_scaling > 0 or args.time_trainer is not None:
        option = "--trainer-scaling" if args.time_trainer is None else "--time-trainer"
        if args.trainer_scaling > 0 and args.time_trainer is not None:
            args.parser.error("argument --time-trainer: not with --trainer-scaling")
        if len(set(fitted.admitted)) > 1:
            args.parser.error(
                f"argument {option}: the traces trained different groups a step {fitted.admitted}"
            )
        recorded = fitted.admitted[0]
        if args.time_trainer is None:
            trainer = sized_to_rows(workload.tasks, args.trainer_scaling, recorded)
        else:
            counts = sorted({recorded, *(admitted(s, workload.tasks) for s in settings)})
            try:
                seconds = time_trainer(args.time_trainer, workload, counts)
            except (ValueError, ImportError, OSError) as error:
                # A bad folder or config, or a task or checkpoint the run needs and this
                # machine lacks (a verifiers environment not installed).
                args.parser.error(f"argument --time-trainer: {error}")
            timed = ", ".join(f"{count} groups {seconds[count]:.4f} s" for count in counts)
            print(f"the trainer's step timed alone on this machine: {timed}")
            trainer = timed_rows(seconds, workload.tasks, recorded)
    try:
        rows = tune(
            workload, grid, seeds=args.seeds, jobs=args.jobs, engine=engine, trainer=trainer
        )
    except ValueError as error:
        # Only a run measured over 0 s is left to refuse here: the grid was checked above.
        option = "--step-time" if args.step_time is not None else "TRACE"
        args.parser.error(f"argument {option}: {error}")
    print(f"simulated {args.seeds} seed(s) per setting: {describe(workload)}")
    limits = {"max_waste": args.max_waste, "max_bias": args.max_bias}
    print(table(rows, **limits))
    if plot_path is not None:
        try:
            plot(rows, plot_path, **limits)
        except OSError as error:
            print(f"dew tune: cannot write {plot_path}: {error.strerror or error}", file=sys.stderr)
            return 1
        print(f"front drawn in {plot_path}")
    return 0


def _plot_path(text: str) -> Path:
    """The file `--plot TEXT` writes: TEXT itself, TEXT.png when it has no suffix (as
    matplotlib would write it), or front.png in TEXT when TEXT is a folder; checked before the
    simulation runs, so that a path that cannot be written is not found out minutes later.

    Raises:
        ValueError: naming the path and what is wrong with it.
    """
    from dew.train._folders import _probe

    path = Path(text)
    if path.is_dir():
        path = path / "front.png"
    elif not path.suffix:
        path = path.with_suffix(".png")
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"{text} must end in {', '.join(PLOT_SUFFIXES)} (or be a folder)")
    if not path.parent.is_dir():
        raise ValueError(f"{path}: the folder {path.parent} does not exist")
    if path.is_dir():
        raise ValueError(f"{path} is a folder")
    _probe(path.parent, str(path), directory=False)
    return path
