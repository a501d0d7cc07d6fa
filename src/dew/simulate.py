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

from dew._checks import at_least, int_at_least, positive
from dew.data import ArrayDataset, Task
from dew.envs.simulated import SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.objectives.rl.scheduler import LogEvent, RolloutScheduler
from dew.objectives.rl.sessions import Label, Session, SessionSource

# Every chain the default SimulatedConfig draws is at most 32 prompt + 4 x 64 completion + 3 x 8
# environment tokens, and every session at most 4 x 96 tokens: one row of this width per sample
# holds a step's rollouts with room to spare, so no group is ever cut for lack of room.
WIDTH = 512
# The terminal events of a submission whose work is thrown away.
WASTED = ("cancelled", "discarded", "failed")


@attrs.frozen
class Workload:
    """The engine, the rollouts and the trainer every setting of a simulation shares.

    Args:
        seed: seeds the simulated sessions (durations, statuses, tokens).
        steps: trainer steps per setting.
        slots: calls the engine decodes at once (C).
        tasks: tasks per batch, one group each.
        groups: rollouts per task that train together.
        duration_mean: mean seconds of a rollout's model time.
        duration_sigma: sigma of the lognormal duration's log: the tail's weight.
        step_time: seconds the trainer spends on each step (T), during which it waits on nothing.

    Raises:
        ValueError: naming the field, its bound and the value.
    """

    seed: int = attrs.field(default=0, validator=int_at_least(0))
    steps: int = attrs.field(default=30, validator=int_at_least(1))
    slots: int = attrs.field(default=64, validator=int_at_least(1))
    tasks: int = attrs.field(default=16, validator=int_at_least(1))
    groups: int = attrs.field(default=4, validator=int_at_least(1))
    duration_mean: float = attrs.field(default=10.0, validator=positive)
    duration_sigma: float = attrs.field(default=1.0, validator=at_least(0.0))
    step_time: float = attrs.field(default=10.0, validator=at_least(0.0))

    @classmethod
    def smoke(cls, seed: int = 0) -> Workload:
        """A tiny workload that runs every setting in about a second, for CI."""
        return cls(seed=seed, steps=6, slots=16, tasks=4, groups=4)


@attrs.frozen
class Setting:
    """One way to run the scheduler: its RolloutScheduler arguments and the name a table shows.

    Raises:
        ValueError: naming the field, its bound and the value; or max_lag below ahead, which the
            scheduler itself refuses.
    """

    name: str
    ahead: int = attrs.field(validator=int_at_least(0))
    max_lag: int = attrs.field(validator=int_at_least(0))
    oversample: int = attrs.field(default=0, validator=int_at_least(0))
    admit: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least(1))
    )

    def __attrs_post_init__(self):
        if self.max_lag < self.ahead:
            raise ValueError(f"max_lag must be >= ahead {self.ahead}, got {self.max_lag}")


def settings(workload: Workload) -> tuple[Setting, ...]:
    """The settings a long-tail simulation compares.

    Synchronous on-policy training; one and two batches ahead at the least max_lag each allows;
    and, one batch ahead, the two ways to cut the tail: two extra rollouts per group, and
    admitting the first three quarters of a batch's groups to complete.
    """
    admit = max(1, 3 * workload.tasks // 4)
    return (
        Setting("sync", ahead=0, max_lag=0),
        Setting("ahead=1", ahead=1, max_lag=1),
        Setting("ahead=2", ahead=2, max_lag=2),
        Setting("ahead=1 oversample=2", ahead=1, max_lag=1, oversample=2),
        Setting(f"ahead=1 admit={admit}", ahead=1, max_lag=1, admit=admit),
    )


@attrs.frozen
class Outcome:
    """What one setting delivered over a simulated run.

    Args:
        setting: the setting run.
        elapsed: seconds of trio's clock the trainer ran, waits and steps together.
        admitted: samples the trainer received (packed into its steps).
        bound: the capacity bound in samples per second, min(slots / duration_mean, admitted
            samples per step / step_time): no run beats the trainer's side, and none beats the
            engine's but by admitting rollouts shorter than the mean.
        waited: seconds the trainer waited on the scheduler.
        lags: each step's lag, updates behind of its oldest admitted call.
        wasted: share of the rollout-seconds of every ended submission that went to
            submissions cancelled, discarded or failed. A rollout-second runs from the
            submission to its end (return or cancellation), slot queueing included; work still
            in flight when the run ends counts nowhere.
        selection: the admitted rollouts' mean model time (the seconds they decode, slot
            queueing left out) over duration_mean, the population's: below 1 where
            completion-time selection favours short rollouts, about 1 where nothing is
            selected.
        cut: groups cut for lack of room in the packed rows (0 by construction of the rows).
    """

    setting: Setting
    elapsed: float
    admitted: int
    bound: float
    waited: float
    lags: tuple[int, ...]
    wasted: float
    selection: float
    cut: int

    @property
    def goodput(self) -> float:
        """Admitted samples per simulated second."""
        return self.admitted / self.elapsed

    @property
    def share(self) -> float:
        """Goodput's share of the capacity bound."""
        return self.goodput / self.bound

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
    """A SessionSource that notes when each submission starts and stops running.

    Args:
        source: runs the rollouts.
        spans: label -> (start, end) on trio's clock, end at its return or cancellation.
    """

    source: SessionSource
    spans: dict[Label, tuple[float, float]] = attrs.Factory(dict)

    async def run(self, task: Task, label: Label) -> Session:
        start = trio.current_time()
        try:
            return await self.source.run(task, label)
        finally:
            self.spans[label] = (start, trio.current_time())


def simulate(workload: Workload, setting: Setting) -> Outcome:
    """Run one setting over workload under trio's mock clock and measure it.

    Runs its own `trio.run`, so it is called from outside one (a notebook cell, a script).

    Raises:
        ValueError: if setting.admit is above workload.tasks.
    """
    if setting.admit is not None and setting.admit > workload.tasks:
        raise ValueError(
            f"admit must be <= the workload's {workload.tasks} tasks, got {setting.admit}"
        )
    return trio.run(
        _simulate, workload, setting, clock=trio.testing.MockClock(autojump_threshold=0)
    )


def long_tail(workload: Workload) -> list[Outcome]:
    """Simulate every setting of `settings(workload)`, in order."""
    return [simulate(workload, setting) for setting in settings(workload)]


async def _simulate(workload: Workload, setting: Setting) -> Outcome:
    engine = SimulatedEngine(slots=workload.slots)
    config = SimulatedConfig(
        seed=workload.seed,
        duration_mean=workload.duration_mean,
        duration_sigma=workload.duration_sigma,
    )
    simulated = SimulatedSource(engine, config)
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
        log=records.append,
    )
    # The trainer prefetches `ahead` batches, as far as the scheduler may read ahead of it.
    batches = workload.steps + setting.ahead
    dataset = scheduler.tasks(
        ArrayDataset({"task_id": np.arange(batches * workload.tasks)}, batch_size=workload.tasks)
    )
    events: list[LogEvent] = []
    start = trio.current_time()
    async with scheduler:
        stream = dataset.stream(0)
        prefetched = collections.deque()
        for updates in range(workload.steps):
            while len(prefetched) <= setting.ahead:
                prefetched.append(next(stream))
            await scheduler.step(prefetched.popleft(), None, updates)
            events.extend(scheduler.last_events)
            await trio.sleep(workload.step_time)
        elapsed = trio.current_time() - start

    admitted_groups = workload.tasks if setting.admit is None else setting.admit
    wasted, spent, durations = _account(events, source.spans, simulated.model_time)
    return Outcome(
        setting=setting,
        elapsed=elapsed,
        admitted=sum(record.groups for record in records) * workload.groups,
        bound=min(
            workload.slots / workload.duration_mean,
            admitted_groups * workload.groups / workload.step_time
            if workload.step_time > 0
            else math.inf,
        ),
        waited=sum(record.waited for record in records),
        lags=tuple(record.lag for record in records),
        wasted=wasted / spent if spent > 0 else 0.0,
        selection=float(np.mean(durations)) / workload.duration_mean,
        cut=sum(record.cut for record in records),
    )


def _account(
    events: Sequence[LogEvent],
    spans: Mapping[Label, tuple[float, float]],
    model_time: Callable[[Task, Label], float],
) -> tuple[float, float, list[float]]:
    """Rollout-seconds thrown away and spent, over every submission that ended, and the model
    times of the admitted ones.

    A submission ends in exactly one of admitted, cancelled, discarded or failed; one still in
    flight when the run ends has no such event and counts nowhere.
    """
    ends = {e.label: e for e in events if e.kind in ("admitted", *WASTED)}
    wasted = spent = 0.0
    admitted = []
    for label, end_event in ends.items():
        begin, end = spans[label]
        spent += end - begin
        if end_event.kind in WASTED:
            wasted += end - begin
        else:
            admitted.append(model_time(Task(end_event.task), label))
    return wasted, spent, admitted


def report(workload: Workload, outcomes: Sequence[Outcome]) -> str:
    """The table of a simulation's outcomes, one row per setting, under a line on the workload.

    Columns: goodput (admitted samples per simulated second), its share of the capacity bound,
    the trainer's idle share, the mean and max over steps of a step's lag (its oldest admitted
    call's), the wasted share of rollout-seconds, and the admitted rollouts' mean duration over
    the population mean (selection bias; see Outcome). A last line
    gives the goodput of `ahead=1` over `sync` where both were run.
    """
    lines = [
        f"C={workload.slots} slots, lognormal rollouts mean {workload.duration_mean:g}s "
        f"sigma {workload.duration_sigma:g}, {workload.tasks} tasks x {workload.groups} "
        f"rollouts per step, T={workload.step_time:g}s, {workload.steps} steps, "
        f"seed {workload.seed}",
        f"{'setting':<22}{'goodput/s':>10}{'of bound':>10}{'idle':>7}"
        f"{'lag mean':>10}{'lag max':>9}{'wasted':>8}{'admitted/mean':>15}",
    ]
    for o in outcomes:
        lines.append(
            f"{o.setting.name:<22}{o.goodput:>10.2f}{o.share:>10.1%}{o.idle:>7.1%}"
            f"{np.mean(o.lags):>10.2f}{max(o.lags):>9d}{o.wasted:>8.1%}{o.selection:>15.2f}"
        )
    by_name = {o.setting.name: o for o in outcomes}
    if "sync" in by_name and "ahead=1" in by_name:
        ratio = by_name["ahead=1"].goodput / by_name["sync"].goodput
        lines.append(f"ahead=1 goodput / sync goodput: {ratio:.2f}x")
    return "\n".join(lines)
