"""The values of a long-tail simulation: the workload every setting shares, the settings it
compares, and what each delivered.

`Workload` says what the engine, the rollouts and the trainer are; `Setting` is one way to run
the scheduler over it (`settings` lists those `long_tail` compares); `Outcome` is what a setting
delivered. Frozen values with validators that name the field: `_run` runs them, `_report`
tabulates them, and `dew.calibrate` fits a `Workload` to recorded runs.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from dew._checks import as_tuple, at_least, check_number, in_range, int_at_least, positive
from dew.envs.simulated import ObservedRollout, SimulatedConfig
from dew.objectives.rl.sessions import Status

# RolloutScheduler's waste_budget default, which a setting without admit="auto" keeps.
WASTE_BUDGET = 0.2


@attrs.frozen
class Contention:
    """How much the trainer's and the engine's work slow each other on the CPU they share.

    On one machine the trainer's step (packing, rescoring, the update) and the engine's decode
    steps run on the same cores: each runs at its own speed while the other is idle and slower
    while both run. The simulation spends each side's seconds as solo work at rate 1 while the
    other side is idle and at rate 1 / (1 + factor) while it is busy (the engine busy while any
    call decodes, the trainer while it steps), so how much two runs slow each other follows from
    how much they overlap, which each setting changes (none at ahead 0, more at ahead 2).

    Args:
        trainer: while the engine is busy, a second of the trainer's solo work takes
            1 + trainer seconds.
        engine: while the trainer is busy, a second of a call's solo decoding takes
            1 + engine seconds.

    Raises:
        ValueError: naming the factor that is not a finite number >= 0.
    """

    trainer: float = attrs.field(default=0.0, validator=at_least(0.0))
    engine: float = attrs.field(default=0.0, validator=at_least(0.0))


@attrs.frozen
class Workload:
    """The engine, the rollouts and the trainer every setting of a simulation shares.

    Args:
        seed: seeds the simulated sessions (durations, statuses, tokens).
        steps: trainer steps per setting.
        slots: calls the engine decodes at once (C); None for an engine that never queues a
            call (one sized for every rollout in flight, as `dew train`'s is).
        tasks: tasks per batch, one group each.
        groups: rollouts per task that train together.
        duration_mean: mean seconds of a rollout's model time.
        duration_sigma: sigma of the lognormal duration's log: the tail's weight.
        calls: (low, high): each rollout makes from low to high engine calls, drawn uniformly,
            that share its duration; each waits for a slot of its own, and the rollout's version
            is its first call's. (1, 1): one call per rollout, the issue-23 reference workload.
        step_time: seconds the trainer spends on each step (T), during which it waits on nothing.
        warmup: steps run before the figures start counting: a recorded run's first steps
            compile and are not what the run is like, so a comparison with one leaves them out.
        observed: rollouts to resample instead of drawing lognormal durations (see
            SimulatedConfig.observed); duration_mean, duration_sigma and calls are then not
            used, and the population's mean duration is the observed rollouts' weighted mean.
        step_times: when given, step k (from warmup) spends step_times[(k - warmup) mod their
            count] instead of step_time: a recorded run's own step times, in its order, so a
            trainer that slows or speeds up over training does so in the simulation too
            (step_time, their mean, still sets the capacity bound).
        contention: how the trainer's and the engine's work slow each other while both run
            (see Contention); the step times and the rollouts' seconds are then solo work, which
            the simulation stretches while the other side is busy. None: they never do.

    Raises:
        ValueError: naming the field, its bound and the value.
    """

    seed: int = attrs.field(default=0, validator=int_at_least(0))
    steps: int = attrs.field(default=30, validator=int_at_least(1))
    slots: int | None = attrs.field(
        default=64, validator=attrs.validators.optional(int_at_least(1))
    )
    tasks: int = attrs.field(default=16, validator=int_at_least(1))
    groups: int = attrs.field(default=4, validator=int_at_least(1))
    duration_mean: float = attrs.field(default=10.0, validator=positive)
    duration_sigma: float = attrs.field(default=1.0, validator=at_least(0.0))
    calls: tuple[int, int] = attrs.field(default=(1, 4), converter=as_tuple)
    step_time: float = attrs.field(default=10.0, validator=at_least(0.0))
    warmup: int = attrs.field(default=0, validator=int_at_least(0))
    observed: tuple[ObservedRollout, ...] = attrs.field(default=(), converter=tuple)
    step_times: tuple[float, ...] = attrs.field(default=(), converter=tuple)
    contention: Contention | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(Contention))
    )

    def __attrs_post_init__(self):
        for i, seconds in enumerate(self.step_times):
            if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                raise ValueError(f"step_times[{i}] must be a number >= 0, got {seconds!r}")
            if not 0 <= seconds < math.inf:
                raise ValueError(f"step_times[{i}] must be a finite number >= 0, got {seconds!r}")
        if self.warmup >= self.steps:
            raise ValueError(f"warmup must be < steps {self.steps}, got {self.warmup}")
        # Checks every observed rollout's type, naming the first that is not one.
        self.sessions()

    @property
    def population_mean(self) -> float:
        """The mean seconds of a rollout's model time over the population drawn from: of the
        rollouts that run to their end, for observed ones (a failure that stops partway is
        never admitted, so it is no part of what admission selects from)."""
        if not self.observed:
            return self.duration_mean
        whole = [r for r in self.observed if r.status is not Status.INFRA_ERROR] or self.observed
        weights = np.array([rollout.weight for rollout in whole])
        durations = np.array([rollout.duration for rollout in whole])
        return float(weights @ durations / weights.sum())

    def engine_scaled(self, factor: float) -> Workload:
        """This workload on an engine `factor` times slower: every rollout's seconds (or the
        lognormal's mean) multiplied by it.

        Raises:
            ValueError: unless factor is a finite number > 0.
        """
        check_number("factor", factor, low=0, low_open=True)
        observed = tuple(
            attrs.evolve(
                r,
                seconds=tuple(s * factor for s in r.seconds),
                failing=None if r.failing is None else r.failing * factor,
            )
            for r in self.observed
        )
        return attrs.evolve(self, duration_mean=self.duration_mean * factor, observed=observed)

    def trainer_scaled(self, factor: float) -> Workload:
        """This workload with a trainer `factor` times slower: every step time multiplied by it.

        Raises:
            ValueError: unless factor is a finite number > 0.
        """
        check_number("factor", factor, low=0, low_open=True)
        return attrs.evolve(
            self,
            step_time=self.step_time * factor,
            step_times=tuple(t * factor for t in self.step_times),
        )

    def step_seconds(self, step: int) -> float:
        """The seconds the trainer spends on step `step`."""
        if not self.step_times:
            return self.step_time
        return self.step_times[(step - self.warmup) % len(self.step_times)]

    def sessions(self) -> SimulatedConfig:
        """How this workload's simulated sessions are drawn."""
        return SimulatedConfig(
            seed=self.seed,
            duration_mean=self.duration_mean,
            duration_sigma=self.duration_sigma,
            calls=self.calls,
            observed=self.observed,
        )

    @classmethod
    def smoke(cls, seed: int = 0) -> Workload:
        """A tiny workload that runs every setting in about a second, for CI."""
        return cls(seed=seed, steps=6, slots=16, tasks=4, groups=4)


def _admit(instance, attribute, value):
    """admit: None, "auto" or an int >= 1."""
    if value is not None and value != "auto":
        int_at_least(1)(instance, attribute, value)


def _as_int(value):
    """A numpy integer as the int it is (every later check of admit tests for an int)."""
    return int(value) if isinstance(value, np.integer) else value


@attrs.frozen
class Setting:
    """One way to run the scheduler: its RolloutScheduler arguments and the name a table shows.

    Raises:
        ValueError: naming the field, its bound and the value; max_lag below
            ahead + sync_every - 1, which the scheduler itself refuses; or a knob that would
            change nothing, and so mislabel the row (carry_over without admit, hedge off
            without carry_over, a waste_budget without admit="auto"), as `dew train` refuses.
    """

    name: str
    ahead: int = attrs.field(validator=int_at_least(0))
    max_lag: int = attrs.field(validator=int_at_least(0))
    oversample: int = attrs.field(default=0, validator=int_at_least(0))
    admit: int | str | None = attrs.field(default=None, converter=_as_int, validator=_admit)
    sync_every: int = attrs.field(default=1, validator=int_at_least(1))
    carry_over: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    waste_budget: float = attrs.field(
        default=WASTE_BUDGET, validator=in_range(0, 1, high_open=True)
    )
    hedge: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # Start rollouts aligned to pushes (RolloutScheduler's align_starts, given the workload's
    # slots).
    align_starts: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self):
        if self.carry_over and self.admit is None:
            raise ValueError("carry_over needs admit: it carries the groups admit leaves out")
        if not self.hedge and not self.carry_over:
            raise ValueError("hedge backs up carried groups' stragglers: give carry_over too")
        if self.admit != "auto" and self.waste_budget != WASTE_BUDGET:
            raise ValueError(
                f"waste_budget bounds the cut of admit='auto': give admit='auto', got admit "
                f"{self.admit!r} with waste_budget {self.waste_budget!r}"
            )
        least = self.ahead + self.sync_every - 1
        if self.max_lag < least:
            raise ValueError(
                f"max_lag must be >= ahead + sync_every - 1 = {least}, got {self.max_lag}"
            )


def settings(workload: Workload) -> tuple[Setting, ...]:
    """The settings a long-tail simulation compares.

    Synchronous on-policy training; one and two batches ahead at the least max_lag each allows;
    and, one batch ahead, the two ways to cut the tail: two extra rollouts per group, and
    admitting the first three quarters of a batch's groups to complete; and that cut with
    carry-over within max_lag 3, which trains the groups it leaves out at later steps, and
    beside it the cut the scheduler chooses itself each call (`admit="auto"`).
    """
    admit = max(1, 3 * workload.tasks // 4)
    return (
        Setting("sync", ahead=0, max_lag=0),
        Setting("ahead=1", ahead=1, max_lag=1),
        Setting("ahead=2", ahead=2, max_lag=2),
        Setting("ahead=1 oversample=2", ahead=1, max_lag=1, oversample=2),
        Setting(f"ahead=1 admit={admit}", ahead=1, max_lag=1, admit=admit),
        Setting(f"ahead=1 admit={admit} carry", ahead=1, max_lag=3, admit=admit, carry_over=True),
        Setting("ahead=1 admit=auto carry", ahead=1, max_lag=3, admit="auto", carry_over=True),
    )


@attrs.frozen
class Outcome:
    """What one setting delivered over a simulated run, from the workload's warmup step on.

    Args:
        setting: the setting run.
        elapsed: seconds of trio's clock the trainer ran, waits and steps together.
        admitted: samples the trainer received (packed into its steps).
        bound: the capacity bound in samples per second, min(slots / mean duration, admitted
            samples per step / step_time): no run beats the trainer's side, and none beats the
            engine's but by admitting rollouts shorter than the mean.
        waited: seconds the trainer waited on the scheduler.
        lags: each step's lag, updates behind of its oldest admitted call.
        wasted: share of the rollout-seconds of every submission that ended in the measured
            steps that went to submissions cancelled, discarded or failed. A rollout-second
            runs from the submission to its end (return or cancellation), slot queueing
            included; work still in flight when the run ends counts nowhere.
        wasted_seconds: those wasted rollout-seconds themselves.
        slot_wasted: the same share in slot-seconds: a submission's run from its start on an
            engine slot (its first call's, as the engine says it through note_progress) to its
            end, its queueing before that left out; one that never got a slot spent none. What
            the engines, rather than the queue, gave to work thrown away.
        selection: the admitted rollouts' mean model time (the seconds they decode, slot
            queueing left out) over the population's mean duration: below 1 where
            completion-time selection favours short rollouts, about 1 where nothing is
            selected. NaN when no rollout was admitted.
        cut: groups cut for lack of room in the packed rows (0 by construction of the rows).
        length_ratio: the admitted rollouts' mean seconds (submission to finish) over those
            of every rollout their batches started (a cancelled one's until its cancellation,
            a lower bound), each averaged over steps as the records' `bias/seconds/
            admitted_mean` and `bias/seconds/started_mean`: the selection bias as a trainer's
            record shows it, below 1 where the cut favours short rollouts (the simulated
            sessions' tokens do not follow their durations, so seconds, not tokens, show it
            here). NaN when no step admitted any.
        slot_wait: the mean seconds an engine call waited for a slot, over the whole run
            (warmup included); NaN if no call got one.
    """

    setting: Setting
    elapsed: float
    admitted: int
    bound: float
    waited: float
    lags: tuple[int, ...]
    wasted: float
    wasted_seconds: float
    selection: float
    cut: int
    length_ratio: float = math.nan
    slot_wait: float = math.nan
    slot_wasted: float = math.nan

    @property
    def goodput(self) -> float:
        """Admitted samples per simulated second."""
        return self.admitted / self.elapsed

    @property
    def share(self) -> float:
        """Goodput's share of the capacity bound; NaN where there is none (unbounded slots and
        a trainer step of 0 s), rather than a made-up 0."""
        return self.goodput / self.bound if math.isfinite(self.bound) else math.nan

    @property
    def idle(self) -> float:
        """The trainer's idle share: waited over elapsed."""
        return self.waited / self.elapsed
