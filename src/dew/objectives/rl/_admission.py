"""The scheduler's admission logic as a pure function: `step(state, event) -> (state, commands)`.

The trio shell in `scheduler.py` turns happenings (a rollout finished, a deadline hit, the trainer
handed over a batch, the stream was reopened) into events, feeds them here, and carries out the
commands that come back (submit a rollout, cancel one with a reason, deliver a batch's groups,
fail the trainer). Nothing here touches trio, threads or clocks: replay and property tests drive
this module directly, and equal inputs give equal outputs.

Every submission ends exactly once, and says how in the event log (`LogEvent`):
- `admitted`: delivered to the trainer in a complete group;
- `cancelled` (reason): stopped in flight;
- `discarded` (reason): finished, but its result was thrown away: `stale` (past the bound) or
  `uniform` (its group's rewards were all equal, under `filter_uniform`);
- `failed` (cause): finished with a failing status (infra_error, cancelled, unscored).
Under `carry_over`, a group that `admit` leaves out of its batch is `carried` instead of
cancelled: it keeps running and is admitted at a later call, ahead of that call's own groups,
or ends as above (stale resubmission, abandoned, reopened, closed, broken).
A failed, timed-out or stale submission is followed by a new `submitted` event whose reason is
the cause (infra_error, cancelled, timeout, stale or unscored), unless the sample is out of
attempts: then its group is `abandoned` and the group's other submissions end.

`_Step`, the working of `run`, is in three parts: here the state it copies, the hand-over and the
cut chosen under admit="auto"; a sample's lifecycle in `_admission_samples`; a group's way to the
trainer (hedges, completion, carry-over, delivery) in `_admission_groups`.

The core's values, events, commands and constants are all importable from here: its users take
them as `core.X`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from dew.objectives.rl import _auto
from dew.objectives.rl._admission_groups import HEDGE, WHOLE_PAST, _Groups  # noqa: F401
from dew.objectives.rl._admission_samples import (  # noqa: F401
    ERROR_TEXT,
    FAILURES,
    HOLD_AFTER,
    _Samples,
    admissible_failure,
    bounded,
    session_version,
)
from dew.objectives.rl._admission_values import (  # noqa: F401
    FINAL,
    Cancel,
    Closed,
    Command,
    Config,
    Deliver,
    Event,
    Fail,
    Finished,
    Group,
    GroupState,
    HandedOver,
    LogEvent,
    Reopened,
    Sample,
    SampleState,
    SourceFailed,
    State,
    Submit,
    TimedOut,
)
from dew.objectives.rl.sessions import Label

CAUSES = ("infra_error", "cancelled", "stale", "timeout", "unscored")
REASONS = ("surplus", "stale", "timeout", "reopened", "closed", "abandoned", "broken")
DISCARDS = ("stale", "uniform")
"""Why a finished result is thrown away (a `discarded` event's reason)."""


def initial(config: Config) -> State:
    return State(config=config)


def push_due(served: int | None, updates: int, sync_every: int) -> bool:
    """Whether the weights must be pushed: at the first call, or once the served version falls
    sync_every updates behind."""
    return served is None or updates - served >= sync_every


def step(state: State, event: Event) -> tuple[State, list[Command]]:
    """Apply one event; return the new state and the commands to carry out, in order."""
    return run(state, [event])


def run(state: State, events: Sequence[Event]) -> tuple[State, list[Command]]:
    """Apply events one after the other: the same as successive `step`s, with one working copy
    of the state for all of them."""
    work = _Step(state)
    for event in events:
        work.time = event.time
        if isinstance(event, HandedOver):
            work.hand_over(event)
        elif isinstance(event, Finished):
            work.finish(event.label, event.session, event.slot)
        elif isinstance(event, TimedOut):
            work.time_out(event.label)
        elif isinstance(event, SourceFailed):
            work.source_failed(event.label, event.error)
        elif isinstance(event, Reopened):
            work.log("reopened")
            work.reopen()
            work.next_group = max(work.next_group, event.next_group)
        elif isinstance(event, Closed):
            work.stop_all("closed")
            work.closed = True
        else:
            raise TypeError(f"unknown event {event!r}")
        work.deliver_if_ready()
    return work.frozen(), work.commands


class _Step(_Samples, _Groups):
    """The working of `run`: a private copy of the state to change in place, and the commands
    collected on the way. The state handed in is never changed."""

    def __init__(self, state: State):
        self.config = state.config
        self.updates, self.served = state.updates, state.served
        self.next_group, self.last_submitted = state.next_group, state.last_submitted
        self.waiting, self.closed = state.waiting, state.closed
        self.carried = list(state.carried)
        self.held = list(state.held)
        self.seen, self.steps = state.seen, state.steps
        self.delivered_at, self.choice = state.delivered_at, state.choice
        self.spent, self.slot_spent = state.spent, state.slot_spent
        self.stretch = state.stretch
        self.groups = dict(state.groups)
        self.batches = dict(state.batches)
        self.unsettled = dict(state.unsettled)
        self.time = 0.0
        self.commands: list[Command] = []

    def frozen(self) -> State:
        return State(
            config=self.config,
            updates=self.updates,
            served=self.served,
            next_group=self.next_group,
            last_submitted=self.last_submitted,
            groups=self.groups,
            batches=self.batches,
            unsettled=self.unsettled,
            waiting=self.waiting,
            closed=self.closed,
            carried=tuple(self.carried),
            held=tuple(self.held),
            seen=self.seen,
            steps=self.steps,
            delivered_at=self.delivered_at,
            choice=self.choice,
            spent=self.spent,
            slot_spent=self.slot_spent,
            stretch=self.stretch,
        )

    # --- events ------------------------------------------------------------------------------

    def hand_over(self, event: HandedOver) -> None:
        self.updates, self.served, self.waiting = event.updates, event.served, event.batch
        self.log("handed_over", version=event.updates)
        if event.pushed:
            self.log("pushed", version=event.served)
        started = dict(event.started)
        if event.slots and self.config.auto:
            self.note_slots(dict(event.slots))
        for group in list(self.groups.values()):
            if group.state in (GroupState.RUNNING, GroupState.COMPLETE):
                self.sweep_stale(group, started)
        if self.config.carry_over and self.config.hedge:
            for group in list(self.groups.values()):
                if group.state is GroupState.RUNNING:
                    self.hedge(group)
                    # At its last admissible call a group's finished hedges stand in.
                    self.resolve(self.groups[group.id])
        for index, task in enumerate(event.carried):
            # A resumed run's carried groups: of the call before this one, so this one admits
            # them once complete.
            group_id = self.next_group
            self.next_group += 1
            samples = tuple(
                Sample(Label(group_id, i, 0), event.served, self.time)
                for i in range(self.config.samples)
            )
            stale = event.stale[index] if index < len(event.stale) else 0
            group = Group(
                group_id,
                event.batch - 1,
                task,
                samples,
                carried=True,
                started=self.time,
                stale_before=stale,
            )
            self.groups[group_id] = group
            self.carried.append(group_id)
            for sample in samples:
                self.submit(group, sample, None)
            if stale >= HOLD_AFTER:
                self.held.append(group_id)
                self.log("held", group, reason="resumed")
        for batch, tasks in event.tasks:
            if batch <= self.last_submitted:
                continue
            ids = tuple(range(self.next_group, self.next_group + len(tasks)))
            self.next_group += len(tasks)
            self.last_submitted = batch
            self.batches[batch] = ids
            self.unsettled[batch] = 0
            for group_id, task in zip(ids, tasks, strict=True):
                samples = tuple(
                    Sample(Label(group_id, i, 0), event.served, self.time)
                    for i in range(self.config.samples)
                )
                group = self.put(Group(group_id, batch, task, samples, started=self.time))
                for sample in samples:
                    self.submit(group, sample, None)
        if self.config.auto:
            self.choose(event.batch)

    def choose(self, batch: int) -> None:
        """Under admit="auto": choose the cut of the batch the trainer now waits on, from this
        run's durations and step times, and cut at once if enough of it is complete."""
        if self.delivered_at is not None:
            self.steps = (*self.steps, self.time - self.delivered_at)[-_auto.STEP_WINDOW :]
        if batch not in self.batches:
            self.choice = None
            return
        members = self.members(batch)
        running = [
            _auto.Running(self.time - g.started, self.calls_left(g))
            for g in members
            if g.state is GroupState.RUNNING
        ]
        carried = [self.groups[i] for i in self.carried if self.groups[i].batch < batch]
        size = len(self.batches[batch])
        raised, budget = False, self.config.waste_budget
        if self.config.carry_over:
            # One admit held for a stretch of calls, re-chosen from the measured slot waste.
            before = self.stretch
            self.stretch = _auto.hold(
                self.stretch,
                size=size,
                max_lag=self.config.max_lag,
                budget=budget,
                slot_spent=(
                    self.slot_spent[0] / self.config.samples,
                    self.slot_spent[1] / self.config.samples,
                ),
            )
            raised = before is not None and self.stretch.admit > before.admit
        self.choice = _auto.choose(
            size=size,
            complete=sum(g.state is GroupState.COMPLETE for g in members),
            running=running,
            carried_complete=sum(g.state is GroupState.COMPLETE for g in carried),
            carried_running=[
                self.time - g.started for g in carried if g.state is GroupState.RUNNING
            ],
            seen=self.seen,
            steps=self.steps,
            budget=self.config.waste_budget,
            carry_over=self.config.carry_over,
            # In group-seconds, as the estimate's: a group holds `samples` slots.
            spent=(self.spent[0] / self.config.samples, self.spent[1] / self.config.samples),
            slot_spent=(
                self.slot_spent[0] / self.config.samples,
                self.slot_spent[1] / self.config.samples,
            ),
            admits=None if self.stretch is None else (self.stretch.admit,),
        )
        if self.config.carry_over:
            held = self.stretch.admit
            if self.choice.admit != held:  # no estimate for it (too few groups yet, or none ends)
                self.choice = _auto.Choice(
                    held,
                    step=self.choice.step,
                    observed=self.choice.observed,
                    wasted=self.choice.wasted,
                    slot_wasted=self.choice.slot_wasted,
                )
            self.choice = attrs.evolve(
                self.choice,
                # No admit fits the budget: the whole batch, and even it was measured past it
                # lately, or the run is still past its budget.
                over_budget=held == size
                and (self.stretch.overspent(size) or (self.choice.slot_wasted or 0.0) > budget),
                stretch_wasted=self.stretch.wasted,
            )
        if not self.config.carry_over:
            self.cut(batch)
        elif raised or (self.choice.over_budget and self.past_budget()):
            self.drain(batch)

    def past_budget(self, margin: float = 0.0) -> bool:
        """Under admit="auto": whether the run's measured slot waste, as the call's choice saw
        it, is past the waste budget by more than margin."""
        return (
            self.choice is not None
            and (self.choice.slot_wasted or 0.0) > self.config.waste_budget + margin
        )

    def drain(self, batch: int) -> None:
        """Under carry_over, at a call where no cut keeps the run within its waste budget and
        the run is past it, measured, or where the admit auto holds steps up (its stretch
        overspent, _auto.hold): cancel running carried groups, those whose samples have run
        least first, until a batch's worth of carried groups is left in play. (While the
        run is still within its budget the drained work would be waste the budget did not need:
        a run that drained on the estimate alone spent 23.0 % of its slot-seconds against 0.2
        in tests/test_auto_cut.py's queueing engine, 19.9 % without.)

        Cutting nothing alone cannot bring the run back within its budget: a call admits at
        most a batch while each call submits one, so the carried groups left in play by earlier
        cuts stay in play for good, and all of them queue for the engine's slots and so use up
        their staleness window waiting (waste). Cancelling the excess is the one way to shrink
        that backlog; the groups that have run least throw the least away. A held group (see
        HOLD_AFTER) is never drained: the call waits for it."""
        size = len(self.batches[batch])
        excess = len(self.carried) - size
        if excess <= 0:
            return
        running = [
            g
            for i in self.carried
            if (g := self.groups[i]).state is GroupState.RUNNING and i not in self.held
        ]

        def ran(group: Group) -> float:
            return sum(
                self.time - s.submitted for s in group.samples if s.state is SampleState.RUNNING
            )

        drained = sorted(running, key=lambda g: (ran(g), g.id))[:excess]
        for group in drained:
            self.see(group, False)
            self.end_group(group, GroupState.SURPLUS, "surplus")
        if drained:
            self.choice = attrs.evolve(self.choice, drained=len(drained))

    def note_slots(self, slots: Mapping[Label, float]) -> None:
        """Under admit="auto": note when running submissions got an engine slot, as their
        engines said (`HandedOver.slots`), for their slot-seconds."""
        for label, at in slots.items():
            found = self.running(label)
            if found is not None and found[1].slot is None:
                group, sample = found
                self.put_sample(group, attrs.evolve(sample, slot=at))
