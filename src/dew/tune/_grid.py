"""The grid of scheduler settings `dew tune` simulates, and its simulation: `Grid` lists the
settings within max_lag's bound, `tune` simulates each over several seeds of one workload
(here or in spawned processes) into a `Row` of its figures, and `sized_to_ahead`,
`sized_to_rows` and `timed_rows` scale the engine's and the trainer's speed with a setting.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import attrs
import numpy as np

from dew._checks import is_number
from dew._processes import end_with_parent
from dew.simulate import WASTE_BUDGET, Outcome, Setting, Workload, simulate


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
        waste_budget: under admit="auto", the most of the run's slot-seconds its cuts may
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
