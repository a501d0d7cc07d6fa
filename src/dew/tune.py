"""Choose the scheduler's knobs by their simulated figures on a calibrated workload: `dew tune`.

`tune` simulates every setting of a `Grid` — ahead, oversample, admit, sync_every, max_lag,
carry-over, the hedge and admit="auto"'s waste budget, each setting within max_lag's bound
(max_lag >= ahead + sync_every - 1) — over several seeds of one workload
(`dew.calibrate.Calibration.workload` fits one to recorded runs), and `front` keeps the settings
no other beats on both goodput and mean lag among those within a waste and a selection-bias
limit: the Pareto front a user picks from. `table` prints every setting's figures, `plot` draws
goodput against lag with the front marked.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import logging
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np

from dew import calibrate
from dew._checks import check_int, check_number, int_option, is_number, number_option
from dew._processes import end_with_parent
from dew.replay import Trace, read_trace
from dew.simulate import (
    WASTE_BUDGET,
    Contention,
    Outcome,
    Setting,
    Workload,
    describe,
    percent,
    simulate,
)


def _ints(low: int):
    def check(instance, attribute, value):
        if not value:
            raise ValueError(f"{attribute.name} must hold at least one value")
        for item in value:
            if item is None and attribute.name in ("admit", "max_lag"):
                continue
            if item == "auto" and attribute.name == "admit":
                continue
            if isinstance(item, bool) or not isinstance(item, int) or item < low:
                raise ValueError(f"{attribute.name} values must be ints >= {low}, got {item!r}")

    return check


def _bools(instance, attribute, value):
    if not value:
        raise ValueError(f"{attribute.name} must hold at least one value")
    for item in value:
        if not isinstance(item, bool):
            raise ValueError(f"{attribute.name} values must be bools, got {item!r}")


def _budgets(instance, attribute, value):
    if not value:
        raise ValueError(f"{attribute.name} must hold at least one value")
    for item in value:
        if not (is_number(item) and 0 <= item < 1):
            raise ValueError(f"{attribute.name} values must be numbers within [0, 1), got {item!r}")


@attrs.frozen
class Grid:
    """The knob values `tune` crosses.

    Args:
        ahead: task batches submitted before the trainer needs them.
        oversample: extra rollouts per group.
        admit: groups admitted per batch; None admits every task's group, "auto" lets the
            scheduler choose each call's (within each of `waste_budget`).
        sync_every: updates between weight pushes.
        max_lag: the staleness bound; None takes the least each (ahead, sync_every) allows.
            A value below that least is left out of the settings for that pair.
        carry_over: whether the scheduler carries the groups `admit` leaves out to a later
            call; True is crossed with the admit values only (it carries what admit cuts).
        hedge: whether a carry-over setting backs up its carried groups' stragglers with fresh
            samples (`RolloutScheduler`'s hedge; False is `dew train --no-hedge`); crossed with
            the carry-over settings only, since only they carry.
        waste_budget: under admit="auto", the most of the run's rollout-seconds its cuts may
            throw away (`RolloutScheduler`'s waste_budget, `dew train --waste-budget`); crossed
            with the "auto" settings only, which alone have a budget. Each is within [0, 1).

    Raises:
        ValueError: naming the knob with an empty list or a value out of bounds, carry_over
            True without an admit value to carry the cut of, hedge False without carry_over
            True, or a waste_budget other than the default without admit "auto" (a knob that
            would add no row, or rows named for what they do not do).
    """

    ahead: tuple[int, ...] = attrs.field(default=(0, 1, 2), converter=tuple, validator=_ints(0))
    oversample: tuple[int, ...] = attrs.field(default=(0,), converter=tuple, validator=_ints(0))
    admit: tuple[int | str | None, ...] = attrs.field(
        default=(None,), converter=tuple, validator=_ints(1)
    )
    sync_every: tuple[int, ...] = attrs.field(default=(1, 2), converter=tuple, validator=_ints(1))
    max_lag: tuple[int | None, ...] = attrs.field(
        default=(None,), converter=tuple, validator=_ints(0)
    )
    carry_over: tuple[bool, ...] = attrs.field(
        default=(False,),
        converter=tuple,
        validator=_bools,
    )
    hedge: tuple[bool, ...] = attrs.field(
        default=(True,),
        converter=tuple,
        validator=_bools,
    )
    waste_budget: tuple[float, ...] = attrs.field(
        default=(WASTE_BUDGET,), converter=tuple, validator=_budgets
    )

    def __attrs_post_init__(self):
        if True in self.carry_over and all(admit is None for admit in self.admit):
            raise ValueError(
                "carry_over True needs an admit value other than None: it carries what admit "
                f"cuts, got admit {self.admit}"
            )
        if False in self.hedge and True not in self.carry_over:
            raise ValueError(
                "hedge False backs up no carried group's stragglers: give carry_over True too"
            )
        if "auto" not in self.admit and any(b != WASTE_BUDGET for b in self.waste_budget):
            raise ValueError(
                f"waste_budget bounds the cut of admit 'auto': give admit 'auto' too, got admit "
                f"{self.admit} with waste_budget {self.waste_budget}"
            )

    def settings(self, tasks: int) -> list[Setting]:
        """Every setting of the grid within max_lag's bound, in the grid's order.

        Raises:
            ValueError: when an admit exceeds `tasks`, or no setting is within the bound.
        """
        for admit in self.admit:
            if isinstance(admit, int) and admit > tasks:
                raise ValueError(f"admit must be <= the workload's {tasks} tasks, got {admit}")
        found: dict[tuple, Setting] = {}
        for ahead, sync, lag, over, admit, carry, hedge, budget in itertools.product(
            self.ahead,
            self.sync_every,
            self.max_lag,
            self.oversample,
            self.admit,
            self.carry_over,
            self.hedge,
            self.waste_budget,
        ):
            least = ahead + sync - 1
            lag = least if lag is None else lag
            if lag < least or (carry and admit is None):
                continue
            hedge = hedge or not carry  # without carry-over there is nothing to hedge
            # Only "auto" cuts by a budget: the others keep the scheduler's default.
            budget = float(budget) if admit == "auto" else WASTE_BUDGET
            key = (ahead, sync, lag, over, admit, carry, hedge, budget)
            setting = Setting(
                _name(*key),
                ahead,
                lag,
                over,
                admit,
                sync,
                carry_over=carry,
                waste_budget=budget,
                hedge=hedge,
            )
            found.setdefault(key, setting)
        if not found:
            raise ValueError(
                f"no setting of the grid has max_lag >= ahead + sync_every - 1: max_lag "
                f"{self.max_lag}, ahead {self.ahead}, sync_every {self.sync_every}"
            )
        return list(found.values())


def _name(
    ahead: int,
    sync: int,
    lag: int,
    over: int,
    admit: int | str | None,
    carry: bool,
    hedge: bool = True,
    budget: float = WASTE_BUDGET,
) -> str:
    parts = [f"ahead={ahead}", f"sync={sync}", f"lag={lag}"]
    parts += [f"over={over}"] if over else []
    parts += [f"admit={admit}"] if admit is not None else []
    # Every "auto" row names its budget: the default and a trace's recorded one look alike else.
    parts += [f"budget={budget!r}"] if admit == "auto" else []
    parts += ["carry"] if carry else []
    parts += [] if hedge else ["no-hedge"]
    return " ".join(parts)


@attrs.frozen
class Row:
    """One setting's figures over seeds: means, but the lag's max (the worst over every seed).

    Args:
        setting: the setting.
        outcomes: one per seed, in seed order.
    """

    setting: Setting
    outcomes: tuple[Outcome, ...]

    def _mean(self, figure: str) -> float:
        return float(np.mean([getattr(o, figure) for o in self.outcomes]))

    @property
    def goodput(self) -> float:
        """Admitted samples per second, the mean over seeds."""
        return self._mean("goodput")

    @property
    def goodput_spread(self) -> float:
        """The standard deviation of goodput over seeds."""
        return float(np.std([o.goodput for o in self.outcomes]))

    @property
    def share(self) -> float:
        """Goodput's share of the capacity bound."""
        return self._mean("share")

    @property
    def idle(self) -> float:
        """The trainer's idle share."""
        return self._mean("idle")

    @property
    def lag_mean(self) -> float:
        """The mean lag over every measured step of every seed."""
        return float(np.mean([lag for o in self.outcomes for lag in o.lags]))

    @property
    def lag_max(self) -> int:
        """The largest lag of any measured step of any seed."""
        return max(max(o.lags) for o in self.outcomes)

    @property
    def wasted(self) -> float:
        """The wasted share of rollout-seconds."""
        return self._mean("wasted")

    @property
    def slot_wasted(self) -> float:
        """The wasted share of slot-seconds (from a rollout's start on an engine slot, queueing
        left out; see Outcome.slot_wasted)."""
        return self._mean("slot_wasted")

    @property
    def wasted_seconds(self) -> float:
        """Wasted rollout-seconds per trained second: mean over seeds of wasted over elapsed."""
        return float(np.mean([o.wasted_seconds / o.elapsed for o in self.outcomes]))

    @property
    def selection(self) -> float:
        """The admitted rollouts' mean duration over the population's."""
        return self._mean("selection")

    @property
    def bias(self) -> float:
        """Selection bias: how far `selection` is from 1, either way."""
        return abs(1.0 - self.selection)


def sized_to_ahead(recorded: int, exponent: float = 1.0) -> Callable[[Setting], float]:
    """How much slower a setting's engine decodes than the recorded one's, for an engine sized
    to `ahead` as `dew train`'s is (batch x groups x (ahead + 1) slots) whose decode step costs
    slots**exponent (about 1 on a CPU, which decodes every slot each step; near 0 where a step
    costs the same however full, as on an accelerator with room to spare).

    Args:
        recorded: the recorded run's ahead.
        exponent: how a decode step's cost grows with the engine's slots.

    Raises:
        ValueError: for a recorded ahead below 0 or an exponent that is not finite and >= 0.
    """
    if isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < 0:
        raise ValueError(f"recorded must be an int >= 0, got {recorded!r}")
    if not (isinstance(exponent, int | float) and 0 <= exponent < math.inf):
        raise ValueError(f"exponent must be a finite number >= 0, got {exponent!r}")
    return lambda setting: ((setting.ahead + 1) / (recorded + 1)) ** exponent


def sized_to_rows(
    tasks: int, exponent: float = 1.0, recorded: int | None = None
) -> Callable[[Setting], float]:
    """How much slower a setting's trainer steps than the recorded one's, for a trainer whose
    rows are sized to the groups a step admits as `dew train`'s are (admit x groups rollouts a
    step; a whole batch without admit, with admit="auto" or with carry-over) and whose step
    costs rows**exponent (about 1 for a CPU step over a fixed [rows, width] shape).

    Args:
        tasks: tasks per batch.
        exponent: how a step's cost grows with its rows.
        recorded: the groups a step of the recorded run trained (`Calibration.admitted`);
            None for every task's.

    Raises:
        ValueError: for tasks below 1, recorded not within [1, tasks], or an exponent that is
            not finite and >= 0.
    """
    if isinstance(tasks, bool) or not isinstance(tasks, int) or tasks < 1:
        raise ValueError(f"tasks must be an int >= 1, got {tasks!r}")
    recorded = tasks if recorded is None else recorded
    if isinstance(recorded, bool) or not isinstance(recorded, int) or not 1 <= recorded <= tasks:
        raise ValueError(f"recorded must be an int within [1, {tasks}], got {recorded!r}")
    if not (isinstance(exponent, int | float) and 0 <= exponent < math.inf):
        raise ValueError(f"exponent must be a finite number >= 0, got {exponent!r}")

    return lambda setting: (admitted(setting, tasks) / recorded) ** exponent


def timed_rows(
    seconds: Mapping[int, float], tasks: int, recorded: int | None = None
) -> Callable[[Setting], float]:
    """How much slower a setting's trainer steps than the recorded one's, from its step timed
    at each count of groups a step admits (`dew.train.step_seconds`: rows sized to admit as
    `dew train`'s are), for a trainer whose cost does not follow its rows in proportion.

    Args:
        seconds: a step's seconds for each count of groups admitted, the recorded count's and
            every setting's among them.
        tasks: tasks per batch.
        recorded: the groups a step of the recorded run trained; None for every task's.

    Raises:
        ValueError: for a count missing from `seconds` (the recorded one's now, a setting's
            when the factor is asked for it), or seconds that are not finite and > 0.
    """
    recorded = tasks if recorded is None else recorded
    for count, value in seconds.items():
        if not (isinstance(value, int | float) and 0 < value < math.inf):
            raise ValueError(f"seconds[{count}] must be a finite number > 0, got {value!r}")
    if recorded not in seconds:
        raise ValueError(f"seconds has no step timed at the recorded {recorded} groups")

    def factor(setting: Setting) -> float:
        count = admitted(setting, tasks)
        if count not in seconds:
            raise ValueError(f"seconds has no step timed at {setting.name}'s {count} groups")
        return seconds[count] / seconds[recorded]

    return factor


def admitted(setting: Setting, tasks: int) -> int:
    """The groups a step of `setting` trains, as `dew train` sizes its rows: `admit` of them
    with a fixed admit, else (no admit, admit="auto", carry-over, which may admit a whole
    batch) every task's."""
    if isinstance(setting.admit, int) and not setting.carry_over:
        return setting.admit
    return tasks


def tune(
    workload: Workload,
    grid: Grid,
    *,
    seeds: int = 3,
    jobs: int = 1,
    engine: Callable[[Setting], float] | None = None,
    trainer: Callable[[Setting], float] | None = None,
) -> list[Row]:
    """Simulate every setting of `grid` on `workload` under seeds workload.seed, +1, ...

    Args:
        workload: the engine, rollouts and trainer.
        grid: the knob values to cross.
        seeds: simulated runs per setting.
        jobs: processes to simulate in; the figures do not depend on it.
        engine: per setting, how much slower its engine decodes than the workload's (e.g.
            `sized_to_ahead`); None for the same engine under every setting.
        trainer: per setting, how much slower its trainer steps than the workload's (e.g.
            `sized_to_rows`); None for the same trainer under every setting.

    Returns:
        One row per setting, in the grid's order.

    Raises:
        ValueError: for seeds or jobs below 1, a grid out of the workload's bounds, or a run
            whose measured steps took 0 s (every batch ready before them, and a trainer step
            of 0 s), whose goodput is unbounded.
    """
    for name, value in (("seeds", seeds), ("jobs", jobs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    settings = grid.settings(workload.tasks)
    sized = {}
    for setting in settings:
        sized[setting] = workload if engine is None else workload.engine_scaled(engine(setting))
        if trainer is not None:
            sized[setting] = sized[setting].trainer_scaled(trainer(setting))
    runs = [
        (attrs.evolve(sized[setting], seed=workload.seed + k), setting)
        for setting in settings
        for k in range(seeds)
    ]
    outcomes = list(_simulate_all(runs, jobs))
    return [
        Row(setting, tuple(outcomes[i * seeds : (i + 1) * seeds]))
        for i, setting in enumerate(settings)
    ]


def _quiet_simulate(run: tuple[Workload, Setting]) -> Outcome:
    # Long trainer waits are what the simulation measures, not news to log.
    logging.getLogger("dew.objectives.rl.scheduler").setLevel(logging.ERROR)
    return simulate(*run)


def _simulate_all(runs: Sequence[tuple[Workload, Setting]], jobs: int) -> Iterator[Outcome]:
    """Each run's outcome, in order, simulated here or in `jobs` spawned processes."""
    logger = logging.getLogger("dew.objectives.rl.scheduler")
    level = logger.level
    try:
        if jobs == 1:
            yield from map(_quiet_simulate, runs)
            return
        # Spawned workers: a forked copy of a process that runs JAX threads can deadlock.
        context = multiprocessing.get_context("spawn")
        # The workers end with this process however it ends (a kill -9 included).
        with concurrent.futures.ProcessPoolExecutor(
            jobs, mp_context=context, initializer=end_with_parent, initargs=(os.getpid(),)
        ) as pool:
            yield from pool.map(_quiet_simulate, runs)
    finally:
        logger.setLevel(level)


def feasible(row: Row, *, max_waste: float | None = None, max_bias: float | None = None) -> bool:
    """Whether a row is within the waste and selection-bias limits (None: no limit)."""
    return (max_waste is None or row.wasted <= max_waste) and (
        max_bias is None or row.bias <= max_bias
    )


def front(
    rows: Sequence[Row], *, max_waste: float | None = None, max_bias: float | None = None
) -> list[Row]:
    """The Pareto front over (goodput, higher better; mean lag, lower better) among the rows
    within the limits, best goodput first.

    A row is on it when no feasible row has at least its goodput and at most its mean lag,
    and is better in one of them. Ties in both keep every tied row.
    """
    kept = [r for r in rows if feasible(r, max_waste=max_waste, max_bias=max_bias)]
    on = [
        r
        for r in kept
        if not any(
            o.goodput >= r.goodput
            and o.lag_mean <= r.lag_mean
            and (o.goodput > r.goodput or o.lag_mean < r.lag_mean)
            for o in kept
        )
    ]
    return sorted(on, key=lambda r: (-r.goodput, r.lag_mean))


def best(
    rows: Sequence[Row], *, max_waste: float | None = None, max_bias: float | None = None
) -> Row | None:
    """The feasible row of the highest goodput (ties: lower mean lag, then grid order)."""
    kept = [r for r in rows if feasible(r, max_waste=max_waste, max_bias=max_bias)]
    return min(kept, key=lambda r: (-r.goodput, r.lag_mean), default=None)


def table(
    rows: Sequence[Row], *, max_waste: float | None = None, max_bias: float | None = None
) -> str:
    """Every row's figures, the front's rows starred and the infeasible ones marked '-'.

    Columns: goodput (admitted samples per second, mean over seeds, ± its spread), its share of
    the capacity bound, the trainer's idle share, mean and max lag, the wasted share of
    rollout-seconds, of slot-seconds (`slot waste`) and wasted rollout-seconds per second, and
    selection (the admitted
    rollouts' mean duration over the population's; 1 is unbiased).
    """
    on = {id(r) for r in front(rows, max_waste=max_waste, max_bias=max_bias)}
    width = max(len("setting"), *(len(r.setting.name) for r in rows)) + 2
    lines = [
        f"  {'setting':<{width}}{'goodput/s':>16}{'of bound':>10}{'idle':>7}{'lag mean':>10}"
        f"{'lag max':>9}{'wasted':>8}{'slot waste':>12}{'wasted s/s':>12}{'selection':>11}"
    ]
    for r in rows:
        mark = (
            "*"
            if id(r) in on
            else (" " if feasible(r, max_waste=max_waste, max_bias=max_bias) else "-")
        )
        goodput = f"{r.goodput:.2f} ±{r.goodput_spread:.2f}"
        lines.append(
            f"{mark} {r.setting.name:<{width}}{goodput:>16}{percent(r.share):>10}{r.idle:>7.1%}"
            f"{r.lag_mean:>10.2f}{r.lag_max:>9d}{r.wasted:>8.1%}{percent(r.slot_wasted):>12}"
            f"{r.wasted_seconds:>12.3g}"
            f"{r.selection:>11.3f}"
        )
    limits = [f"wasted <= {max_waste:.1%}"] if max_waste is not None else []
    limits += [f"|1 - selection| <= {max_bias:g}"] if max_bias is not None else []
    chosen = best(rows, max_waste=max_waste, max_bias=max_bias)
    lines.append(
        "* on the Pareto front of goodput and mean lag"
        + (f" within {' and '.join(limits)}; - outside the limits" if limits else "")
    )
    lines.append(
        f"best goodput: {chosen.setting.name} ({chosen.goodput:.2f}/s)"
        if chosen
        else "no setting is within the limits"
    )
    return "\n".join(lines)


def plot(
    rows: Sequence[Row],
    path: str | os.PathLike,
    *,
    max_waste: float | None = None,
    max_bias: float | None = None,
) -> None:
    """Draw goodput against mean lag, one point per setting, the front joined, into a PNG.

    Raises:
        ModuleNotFoundError: without matplotlib (the `plot` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    on = front(rows, max_waste=max_waste, max_bias=max_bias)
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    try:
        for r in rows:
            ok = feasible(r, max_waste=max_waste, max_bias=max_bias)
            axes.scatter(r.lag_mean, r.goodput, color="tab:blue" if ok else "lightgray", zorder=2)
            axes.annotate(r.setting.name, (r.lag_mean, r.goodput), fontsize=7, alpha=0.8)
        ordered = sorted(on, key=lambda r: r.lag_mean)
        axes.plot(
            [r.lag_mean for r in ordered],
            [r.goodput for r in ordered],
            color="tab:orange",
            marker="o",
            label="Pareto front",
            zorder=3,
        )
        axes.set_xlabel("mean lag (updates)")
        axes.set_ylabel("goodput (samples/s)")
        axes.legend()
        figure.tight_layout()
        figure.savefig(os.fspath(path), dpi=120)
    finally:
        pyplot.close(figure)


# --- the command line -----------------------------------------------------------------------------


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
        traces = [read_trace(path) for path in args.traces]
        fitted = calibrate.calibrate(traces, warmup=args.warmup)
        for trace in traces:
            _check_recorded(trace, fitted.tasks, args.warmup)
        if not fitted.mean_duration > 0:
            raise ValueError(
                f"{', '.join(fitted.traces)}: every finished rollout took 0 s on the "
                "scheduler's clock: there is no rollout time to simulate"
            )
        workload = fitted.workload(
            steps=args.steps, seed=args.seed, slots=args.slots, contention=args.contention
        )
    except (OSError, ValueError) as error:
        args.parser.error(f"argument TRACE: {error}")
    print(calibrate.report(fitted))
    budgets = args.waste_budget or (WASTE_BUDGET,)
    recorded = _recorded_budgets(traces)
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
                seconds = _time_trainer(args.time_trainer, workload, counts)
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


def _check_recorded(trace: Trace, tasks: int, warmup: int) -> None:
    """Refuse a trace whose scheduler settings `tune` reads are out of bounds (a hand-edited
    or foreign trace: `read_trace` checks the config's names, not their values), or whose run
    admitted no group after its first `warmup` calls (every group failed or was discarded), of
    which every prediction would read 0 samples a second.

    Raises:
        ValueError: naming the trace and the field and its value, or the calls.
    """
    config = trace.config
    try:
        check_int("groups", config["groups"], low=1)
        check_int("ahead", config["ahead"], low=0)
        admit = config["admit"]
        whole = isinstance(admit, int) and not isinstance(admit, bool)
        if not (admit is None or admit == "auto" or (whole and 1 <= admit <= tasks)):
            raise ValueError(
                f"admit must be null, 'auto' or an int within [1, {tasks}], got {admit!r}"
            )
        if not isinstance(config["carry_over"], bool):
            raise ValueError(f"carry_over must be a bool, got {config['carry_over']!r}")
        check_number("waste_budget", config["waste_budget"], low=0, high=1, high_open=True)
    except ValueError as error:
        raise ValueError(f"{trace.path}: its config's {error}") from None
    delivered = [call for call in trace.calls if call.record is not None][warmup:]
    if not any(call.record.groups for call in delivered):
        raise ValueError(
            f"{trace.path}: its run admitted no group in its {len(delivered)} trainer calls "
            f"after the first {warmup} (every group failed or was discarded): there is no "
            "admitted work to predict"
        )


def _recorded_budgets(traces: Sequence[Trace]) -> tuple[float, ...]:
    """The waste budgets of the traces whose run chose its own cut (admit "auto"), each
    once, in the traces' order: what `dew tune --admit auto` predicts at unless told."""
    budgets = (float(t.config["waste_budget"]) for t in traces if t.config["admit"] == "auto")
    return tuple(dict.fromkeys(budgets))


def _time_trainer(run: str, workload: Workload, counts: Sequence[int]) -> dict[int, float]:
    """`dew.train.step_seconds` of the run in folder `run`, which must be of the traces' batch
    shape; imported only when asked for, since it builds the run's model.

    Raises:
        ValueError: naming the folder whose config is unreadable or of another batch shape, or
            whose run cannot be timed (`step_seconds`).
        ImportError, OSError: for a task or checkpoint of the run's that cannot be loaded here.
    """
    from dew.train import TrainConfig, step_seconds

    config = TrainConfig.from_file(Path(run) / "config.json")
    if (config.batch_size, config.groups) != (workload.tasks, workload.groups):
        raise ValueError(
            f"{run} trained {config.batch_size} tasks x {config.groups} rollouts a batch, the "
            f"traces {workload.tasks} x {workload.groups}: give the folder of the recorded run"
        )
    return step_seconds(run, counts)


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
