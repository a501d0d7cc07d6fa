"""Running a long-tail simulation: one setting over a workload under trio's mock clock.

`simulate` runs the RolloutScheduler against a SimulatedEngine beside a fake trainer that spends
each step's seconds on the clock (on a `SharedCpu` with the engine, under contention), notes
when each submission ran (`_Timed`) and accounts the seconds thrown away from the scheduler's
log; `long_tail` runs every setting; `estimated_seconds` says beforehand what that costs.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np
import trio
import trio.testing

from dew.data import ArrayDataset, Task
from dew.envs.simulated import SimulatedEngine, SimulatedSource
from dew.objectives.rl._session import oldest_call
from dew.objectives.rl.scheduler import LogEvent, RolloutScheduler
from dew.objectives.rl.sessions import Label, Session, SessionSource
from dew.simulate._workload import Contention, Outcome, Setting, Workload, settings

# Every chain the default SimulatedConfig draws is at most 32 prompt + 4 x 64 completion + 3 x 8
# environment tokens, and every session at most 4 x 96 tokens: one row of this width per sample
# holds a step's rollouts with room to spare, so no group is ever cut for lack of room.
WIDTH = 512
# The terminal events of a submission whose work is thrown away.
WASTED = ("cancelled", "discarded", "failed")


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
