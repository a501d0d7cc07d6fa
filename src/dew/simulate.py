"""The long tail, simulated: what ahead, max_lag, oversample and admit buy a trainer.

A trainer that waits for every rollout of a step waits on the slowest: with heavy-tailed
rollout durations most of the engine idles while a few long rollouts finish, and the engine
idles again while the trainer trains. `long_tail` runs the RolloutScheduler under trio's mock
clock against a SimulatedEngine of `slots` decode slots serving SimulatedSource rollouts whose
model time is lognormal, beside a fake trainer that spends `step_time` seconds of trio's clock on
each step, once per scheduler setting (synchronous, one or two batches ahead, oversampling, a
partial admit), and `report` tabulates what each delivered. The runs are deterministic: a pure
function of the workload.

No model is involved: `BehaviorObjective` hands the simulated engine's behaviour log-probs back
as the trainer's proximal rescoring, which would cost no time on the mock clock in any case.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np
import trio
import trio.testing

from dew._checks import as_tuple, at_least, check_number, in_range, int_at_least, positive
from dew.data import ArrayDataset, Task
from dew.envs.simulated import ObservedRollout, SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.objectives.rl._session import oldest_call
from dew.objectives.rl.scheduler import LogEvent, RolloutScheduler
from dew.objectives.rl.sessions import Label, Session, SessionSource, Status

# Every chain the default SimulatedConfig draws is at most 32 prompt + 4 x 64 completion + 3 x 8
# environment tokens, and every session at most 4 x 96 tokens: one row of this width per sample
# holds a step's rollouts with room to spare, so no group is ever cut for lack of room.
WIDTH = 512
# The terminal events of a submission whose work is thrown away.
WASTED = ("cancelled", "discarded", "failed")
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


@attrs.frozen
class BehaviorObjective:
    """The objective of a run without a trainer model: proximal log-probs are the behaviour's.

    The scheduler asks its objective only for `packed_log_probs`, to rescore the packed rows
    under the trainer's weights; where there are none (a simulation, a benchmark of the
    scheduler itself) returning the behaviour log-probs keeps the batch well formed at no cost.
    """

    def packed_log_probs(self, variables, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """float32[rows, width]: the batch's `behavior_logprobs`, as they are."""
        return batch["behavior_logprobs"]


@attrs.define(eq=False)
class _Timed:
    """A SessionSource that notes when each submission starts and stops running, and when it
    started on an engine slot.

    Args:
        source: runs the rollouts.
        spans: label -> (start, end) on trio's clock, end at its return or cancellation.
        slots: label -> when its first call got a slot (oldest_call), for those that got one.
    """

    source: SessionSource
    spans: dict[Label, tuple[float, float]] = attrs.Factory(dict)
    slots: dict[Label, float] = attrs.Factory(dict)

    async def run(self, task: Task, label: Label) -> Session:
        start = trio.current_time()
        try:
            return await self.source.run(task, label)
        finally:
            self.spans[label] = (start, trio.current_time())
            first = oldest_call()
            if first is not None:
                self.slots[label] = first[0]


@attrs.define(eq=False)
class SharedCpu:
    """The CPU the simulated trainer and engine share: each spends its seconds of solo work at
    rate 1 while the other side is idle and 1 / (1 + its Contention factor) while it is busy.

    A side is busy while at least one of its `spend` calls runs. Every time a side turns busy or
    idle, the other side's spenders wake and go on at their new rate, so a step that overlaps
    the engine for part of its time is stretched for that part alone. On trio's mock clock the
    result is a pure function of when each side works.

    Args:
        contention: the two factors.
    """

    contention: Contention
    running: dict[str, int] = attrs.field(factory=lambda: {"trainer": 0, "engine": 0})
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def rate(self, side: str) -> float:
        """How fast `side` works now: solo seconds per second of the clock."""
        other = "engine" if side == "trainer" else "trainer"
        return 1.0 / (1.0 + getattr(self.contention, side)) if self.running[other] else 1.0

    async def spend(self, side: str, seconds: float) -> None:
        """Spend `seconds` of `side`'s solo work, stretched while the other side is busy."""
        self._enter(side, 1)
        try:
            left = seconds
            while left > 0:
                rate, changed, start = self.rate(side), self._changed, trio.current_time()
                with trio.move_on_after(left / rate) as scope:
                    await changed.wait()
                if scope.cancelled_caught:
                    break
                left -= (trio.current_time() - start) * rate
        finally:
            self._enter(side, -1)

    def _enter(self, side: str, change: int) -> None:
        before = self.running[side]
        self.running[side] += change
        if (before == 0) != (self.running[side] == 0):
            self._changed.set()
            self._changed = trio.Event()


@attrs.define(eq=False)
class SharingEngine(SimulatedEngine):
    """A SimulatedEngine whose calls decode on a SharedCpu, slowed while the trainer steps."""

    cpu: SharedCpu = attrs.field(kw_only=True)

    async def _decode(self, seconds: float) -> None:
        await self.cpu.spend("engine", seconds)


def simulate(workload: Workload, setting: Setting) -> Outcome:
    """Run one setting over workload under trio's mock clock and measure it.

    Runs its own `trio.run`, so it is called from outside one (a notebook cell, a script).

    Raises:
        ValueError: if setting.admit is above workload.tasks, or if the measured steps took
            0 s (every batch ready before them, and a trainer step of 0 s): their goodput is
            unbounded.
    """
    if isinstance(setting.admit, int) and setting.admit > workload.tasks:
        raise ValueError(
            f"admit must be <= the workload's {workload.tasks} tasks, got {setting.admit}"
        )
    outcome = trio.run(
        _simulate, workload, setting, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    if not outcome.elapsed > 0:
        raise ValueError(
            f"{setting.name} (seed {workload.seed}) trained its "
            f"{workload.steps - workload.warmup} measured steps in 0 s: every batch was ready "
            "before them and the trainer's steps take 0 s, so its goodput is unbounded; give "
            "the trainer's steps some time"
        )
    return outcome


def long_tail(
    workload: Workload, *, done: Callable[[int, Outcome], None] | None = None
) -> list[Outcome]:
    """Simulate every setting of `settings(workload)`, in order.

    Args:
        done: called with each setting's index and outcome as it ends (progress for a table
            that takes minutes).
    """
    outcomes = []
    for index, setting in enumerate(settings(workload)):
        outcomes.append(simulate(workload, setting))
        if done is not None:
            done(index, outcomes[-1])
    return outcomes


# The CPU-seconds a simulated rollout costs `long_tail`, measured on one core of a CI machine
# (2 vCPUs): its scheduling, each engine call it makes, and each rollout of its group (a rollout
# of a group of 4 took 0.4 ms, of a group of 4096 1.3 ms; one of 64 calls 8.6 ms).
ROLLOUT_SECONDS = 3e-4
CALL_SECONDS = 1.3e-4
GROUP_SECONDS = 2.2e-7


def estimated_seconds(workload: Workload) -> float:
    """About how many CPU-seconds `long_tail(workload)` takes, from the rollouts each setting
    starts (its batches, ahead included, of groups, oversample included), their engine calls
    and their groups' sizes; within a factor of about 1.5 of what it took on the machine the
    costs were measured on. A command checks it before it starts: a table within every
    option's bounds could otherwise simulate for hours without a line.
    """
    if workload.observed:
        calls = float(np.mean([len(rollout.seconds) for rollout in workload.observed]))
    else:
        calls = sum(workload.calls) / 2
    total = 0.0
    for setting in settings(workload):
        group = workload.groups + setting.oversample
        rollouts = (workload.steps + setting.ahead) * workload.tasks * group
        total += rollouts * (ROLLOUT_SECONDS + CALL_SECONDS * calls + GROUP_SECONDS * group)
    return total


async def _simulate(workload: Workload, setting: Setting) -> Outcome:
    if workload.contention is None:
        cpu, engine = None, SimulatedEngine(slots=workload.slots)
    else:
        cpu = SharedCpu(workload.contention)
        engine = SharingEngine(slots=workload.slots, cpu=cpu)
    simulated = SimulatedSource(engine, workload.sessions())
    source = _Timed(simulated)
    samples = workload.tasks * workload.groups
    records = []
    scheduler = RolloutScheduler(
        BehaviorObjective(),
        source,
        engine,
        width=WIDTH,
        rows=samples,
        groups=workload.groups,
        oversample=setting.oversample,
        admit=setting.admit,
        max_lag=setting.max_lag,
        ahead=setting.ahead,
        sync_every=setting.sync_every,
        log=records.append,
        carry_over=setting.carry_over,
        waste_budget=setting.waste_budget,
        hedge=setting.hedge,
        align_starts=_aligned(workload, setting),
    )
    scheduler.long_wait = None  # a simulated trainer waits by design: nothing to report
    # The trainer prefetches `ahead` batches, as far as the scheduler may read ahead of it.
    batches = workload.steps + setting.ahead
    dataset = scheduler.tasks(
        ArrayDataset({"task_id": np.arange(batches * workload.tasks)}, batch_size=workload.tasks)
    )
    events: list[LogEvent] = []
    async with scheduler:
        stream = dataset.stream(0)
        prefetched = collections.deque()
        for updates in range(workload.steps):
            if updates == workload.warmup:
                start = trio.current_time()
            while len(prefetched) <= setting.ahead:
                prefetched.append(next(stream))
            await scheduler.step(prefetched.popleft(), None, updates)
            if updates >= workload.warmup:
                events.extend(scheduler.last_events)
            if cpu is None:
                await trio.sleep(workload.step_seconds(updates))
            else:
                await cpu.spend("trainer", workload.step_seconds(updates))
        elapsed = trio.current_time() - start

    measured = records[workload.warmup :]
    # Carry-over admits a batch's cut groups at later calls: the trainer takes a whole batch's
    # worth a call on average, as without admit.
    full = setting.admit is None or setting.admit == "auto" or setting.carry_over
    admitted_groups = workload.tasks if full else setting.admit
    wasted, spent, durations = _account(
        events, source.spans, simulated.model_time, from_submission=True
    )
    slot_wasted, slot_spent, _ = _account(
        events, _on_slots(source.spans, source.slots), simulated.model_time
    )
    engine_bound = math.inf if workload.slots is None else workload.slots / workload.population_mean
    trainer_bound = (
        admitted_groups * workload.groups / workload.step_time
        if workload.step_time > 0
        else math.inf
    )
    return Outcome(
        setting=setting,
        elapsed=elapsed,
        admitted=sum(record.groups for record in measured) * workload.groups,
        bound=min(engine_bound, trainer_bound),
        waited=sum(record.waited for record in measured),
        lags=tuple(record.lag for record in measured),
        wasted=wasted / spent if spent > 0 else 0.0,
        wasted_seconds=wasted,
        selection=(float(np.mean(durations)) / workload.population_mean if durations else math.nan),
        cut=sum(record.cut for record in measured),
        length_ratio=_length_ratio(measured),
        slot_wait=engine.queued / engine.granted if engine.granted else math.nan,
        slot_wasted=slot_wasted / slot_spent if slot_spent > 0 else 0.0,
    )


def _aligned(workload: Workload, setting: Setting) -> int | None:
    """The scheduler's align_starts for a setting that aligns starts: the engine's slots.

    Raises:
        ValueError: for an engine of unbounded slots, where no slot is ever freed to wait.
    """
    if not setting.align_starts:
        return None
    if workload.slots is None:
        raise ValueError(
            f"setting {setting.name!r}: align_starts needs an engine of bounded slots, got "
            "slots None"
        )
    return workload.slots


def _length_ratio(records) -> float:
    """The admitted over the started mean seconds, each averaged over the records that have
    them (see Outcome.length_ratio)."""
    pairs = [
        (r.metrics["bias/seconds/admitted_mean"], r.metrics["bias/seconds/started_mean"])
        for r in records
        if "bias/seconds/started_mean" in r.metrics
    ]
    if not pairs:
        return math.nan
    admitted, started = np.mean(pairs, axis=0)
    return float(admitted / started) if started > 0 else math.nan


def _on_slots(
    spans: Mapping[Label, tuple[float, float]], slots: Mapping[Label, float]
) -> dict[Label, tuple[float, float]]:
    """Each submission's span from its start on a slot to its end; one that never got a slot,
    an empty span at its end."""
    return {label: (slots.get(label, end), end) for label, (_, end) in spans.items()}


def _account(
    events: Sequence[LogEvent],
    spans: Mapping[Label, tuple[float, float]],
    model_time: Callable[[Task, Label], float],
    *,
    from_submission: bool = False,
) -> tuple[float, float, list[float]]:
    """Seconds thrown away and spent, over every submission that ended, each over its span,
    and the model times of the admitted ones.

    A submission ends in exactly one of admitted, cancelled, discarded or failed; one still in
    flight when the run ends has no such event and counts nowhere. One whose source never ran
    (cancelled while the scheduler held it queued for a slot, under align_starts) has an empty
    span at its end; `from_submission` counts each from its submission event where the log
    holds it, the scheduler's queueing included, as the engine's is.
    """
    ends = {e.label: e for e in events if e.kind in ("admitted", *WASTED)}
    submitted = (
        {e.label: e.time for e in events if e.kind == "submitted"} if from_submission else {}
    )
    wasted = spent = 0.0
    admitted = []
    for label, end_event in ends.items():
        begin, end = spans.get(label, (end_event.time, end_event.time))
        begin = min(begin, submitted.get(label, begin))
        spent += end - begin
        if end_event.kind in WASTED:
            wasted += end - begin
        else:
            admitted.append(model_time(Task(end_event.task), label))
    return wasted, spent, admitted


def describe(workload: Workload) -> str:
    """One line on a workload: the engine, the rollouts, the batch, the trainer and the run."""
    engine = "unbounded slots" if workload.slots is None else f"C={workload.slots} slots"
    if workload.observed:
        rollouts = (
            f"{len(workload.observed)} observed rollouts resampled, mean "
            f"{workload.population_mean:.3g}s"
        )
    else:
        low, high = workload.calls
        calls = f"{low}" if low == high else f"{low}-{high}"
        rollouts = (
            f"lognormal rollouts mean {workload.duration_mean:g}s sigma "
            f"{workload.duration_sigma:g}, {calls} call{'s' if high > 1 else ''} each"
        )
    warmup = f" (the first {workload.warmup} not measured)" if workload.warmup else ""
    shared = workload.contention
    cpu = (
        f", sharing a CPU (trainer +{shared.trainer:.0%}, engine +{shared.engine:.0%} while "
        "both run)"
        if shared is not None
        else ""
    )
    return (
        f"{engine}, {rollouts}, {workload.tasks} tasks x {workload.groups} rollouts per step, "
        f"T={workload.step_time:.4g}s{cpu}, {workload.steps} steps{warmup}, seed {workload.seed}"
    )


def percent(share: float) -> str:
    """A share as a table shows it: "nan" where it is undefined, never a made-up 0.0%."""
    return f"{share:.1%}" if math.isfinite(share) else "nan"


def report(workload: Workload, outcomes: Sequence[Outcome]) -> str:
    """The table of a simulation's outcomes, one row per setting, under a line on the workload.

    Columns: goodput (admitted samples per simulated second), its share of the capacity bound,
    the trainer's idle share, the mean and max over steps of a step's lag (its oldest admitted
    call's), the wasted share of rollout-seconds and of slot-seconds (Outcome.slot_wasted), the
    admitted rollouts' mean duration over
    the population mean (selection bias; see Outcome), and their mean seconds over those of
    everything their batches started (the same bias as a trainer's record measures it: see
    Outcome.length_ratio), and the mean seconds an engine call waited for a slot. A last line
    gives the goodput of `ahead=1` over `sync` where both were run (undefined, saying why,
    where sync admitted nothing).
    """
    lines = [
        describe(workload),
        f"{'setting':<26}{'goodput/s':>10}{'of bound':>10}{'idle':>7}"
        f"{'lag mean':>10}{'lag max':>9}{'wasted':>8}{'slot waste':>12}{'admitted/mean':>15}"
        f"{'admitted/started':>18}{'slot wait':>11}",
    ]
    for o in outcomes:
        lines.append(
            f"{o.setting.name:<26}{o.goodput:>10.2f}{percent(o.share):>10}{o.idle:>7.1%}"
            f"{np.mean(o.lags):>10.2f}{max(o.lags):>9d}{o.wasted:>8.1%}{percent(o.slot_wasted):>12}"
            f"{o.selection:>15.2f}{o.length_ratio:>18.2f}{o.slot_wait:>10.2f}s"
        )
    by_name = {o.setting.name: o for o in outcomes}
    if "sync" in by_name and "ahead=1" in by_name:
        sync = by_name["sync"]
        if sync.goodput > 0:
            ratio = by_name["ahead=1"].goodput / sync.goodput
            lines.append(f"ahead=1 goodput / sync goodput: {ratio:.2f}x")
        else:
            lines.append(
                "ahead=1 goodput / sync goodput: undefined: sync admitted no sample in its "
                f"{len(sync.lags)} measured steps"
            )
    return "\n".join(lines)
