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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from dew.objectives.rl import _auto
from dew.objectives.rl._admission_values import (
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
from dew.objectives.rl._rewards import uniform_group
from dew.objectives.rl.sessions import Label, Session, Status

# Under carry_over (with hedge), a group still running when the call two before its last
# admissible one hands over gets a fresh sample beside each of its running ones (a hedge): a
# straggler whose group would otherwise pass max_lag and be resubmitted whole. A hedge is a
# fallback, not a race: it replaces its original only where the original has not finished by the
# group's last admissible call, since keeping whichever finishes first would keep the shorter of
# two (selection bias). Two calls ahead: one gives a hedge too few seconds to finish, three run
# hedges beside more originals that finish in time, which is waste (benchmarks/long_tail.py;
# docs/concepts.md, "Carry-over").
HEDGE = 2
# Under carry_over, a carried group one of whose samples has gone stale this many times is held:
# the next call waits for it. Without the hold, a task whose rollouts always outlive the window
# (a hard problem, long every time) would be resubmitted stale for good, never trained, while
# its slots burn. A group of the population's durations goes stale with some chance p a window,
# so k windows in a row (p^k) is the task, not the tail's bad luck, once k is large enough: on
# the reference long-tail workload (benchmarks/long_tail.py, seeds 0..4, 300 steps), holding
# at 3 cost carry-over at max_lag 3 a share of 0.054 of the bound and auto at max_lag 5 0.020,
# where ordinary groups go stale often; at 5 it cost 0.004 and 0.002. The trainer waiting stops
# the group's lag from growing, so it completes within max_lag however long it runs.
HOLD_AFTER = 5
# Under admit="auto" with carry_over, a call at which no cut fits the waste budget, while the
# run's measured slot waste is past the budget by more than this, waits for its batch's own
# groups (see deliver_carrying). Without it a heavy tail's run stayed over its budget for good
# (benchmarks/long_tail.py --workloads, seed 0, 100 steps: 16.6 % and 24.2 % on sigma 1.5 and
# 2.0 against 0.15): its calls, filled with complete carried groups, carried the batch's own
# toward their bound. Waiting for a whole batch costs its slowest rollout's seconds (on sigma
# 2.0, a minute and more), so the run first spends most of the point over its budget that
# issue 46 allows (at half a point the waits cost sigma 1.5 at a 0.25 budget 0.09 of the bound).
WHOLE_PAST = 0.009
CAUSES = ("infra_error", "cancelled", "stale", "timeout", "unscored")
# The most characters of a session's error text a `failed` event keeps: enough for an exception's
# type and message, bounded so that a source which dumps a whole traceback or page on every
# failure cannot grow the event log without bound.
ERROR_TEXT = 300
REASONS = ("surplus", "stale", "timeout", "reopened", "closed", "abandoned", "broken")
DISCARDS = ("stale", "uniform")
"""Why a finished result is thrown away (a `discarded` event's reason)."""
# Causes that use up one of a sample's max_attempts; stale resubmission does not.
FAILURES = ("infra_error", "cancelled", "timeout", "unscored")


def bounded(text: str | None) -> str | None:
    """An error text cut to ERROR_TEXT characters, saying that it was cut."""
    if text is None or len(text) <= ERROR_TEXT:
        return text
    return text[: ERROR_TEXT - 1] + "…"


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


def admissible_failure(session: Session, truncation: str) -> str | None:
    """The failure cause of a finished session, or None when it is admissible."""
    if session.status in (Status.COMPLETED, Status.AGENT_ERROR):
        return None
    if session.status is Status.TRUNCATED:
        return "unscored" if truncation == "score" and session.reward is None else None
    return "infra_error" if session.status is Status.INFRA_ERROR else "cancelled"


def session_version(session: Session, submitted_version: int) -> int:
    """A rollout is as stale as its oldest call; one without calls as its submission."""
    oldest = session.min_version
    return submitted_version if oldest is None else oldest


class _Step:
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

    # --- bookkeeping -------------------------------------------------------------------------

    def log(
        self,
        kind: str,
        group: Group | None = None,
        label: Label | None = None,
        version: int | None = None,
        reason: str | None = None,
        error: str | None = None,
    ) -> None:
        if group is None:
            event = LogEvent(kind, self.time, version, None, None, label, reason, error)
        else:
            event = LogEvent(
                kind, self.time, version, group.id, group.task.name, label, reason, error
            )
        self.commands.append(event)

    def put(self, group: Group) -> Group:
        """Store a group's new value, counting the batch's groups that are not yet final. A
        carried group is no batch's member: one that ends other than complete is forgotten."""
        if group.carried:
            if group.state in FINAL and group.state is not GroupState.COMPLETE:
                del self.groups[group.id]
                self.carried.remove(group.id)
                if group.id in self.held:
                    self.held.remove(group.id)
            else:
                self.groups[group.id] = group
            return group
        old = self.groups.get(group.id)
        settled = group.state in FINAL
        if old is None:
            self.unsettled[group.batch] = self.unsettled.get(group.batch, 0) + (not settled)
        elif (old.state in FINAL) != settled:
            self.unsettled[group.batch] += -1 if settled else 1
        self.groups[group.id] = group
        return group

    def put_sample(self, group: Group, sample: Sample) -> Group:
        samples = group.samples[: sample.index] + (sample,) + group.samples[sample.index + 1 :]
        return self.put(group.with_samples(samples))

    def submit(self, group: Group, sample: Sample, cause: str | None) -> None:
        """Start a sample's submission (its caller stores the sample in its group)."""
        assert self.served is not None, "nothing is submitted before the first push"
        label = sample.label
        self.commands.append(Submit(group.task, label, group.batch, self.served, self.time))
        self.log("submitted", group, label, version=self.served, reason=cause)

    def resubmit(self, group: Group, sample: Sample, cause: str) -> Group:
        failures = sample.failures + (cause in FAILURES)
        label = Label(group.id, sample.index, sample.attempt + 1)
        fresh = Sample(label, self.served, self.time, failures, backs=sample.backs)
        self.submit(group, fresh, cause)
        # A sample's resubmissions beyond its failures (FAILURES) are its stale ones.
        stale = group.stale_before + label.attempt - failures
        if group.carried and stale >= HOLD_AFTER and group.id not in self.held:
            self.held.append(group.id)
            self.log("held", group)
        return self.put_sample(group, fresh)

    def account(self, sample: Sample, wasted: bool, ran: bool = True) -> None:
        """Under admit="auto": add a submission's seconds, from its submission to now (or, for
        a result discarded later, to its finish), to the run's spent and, thrown away, wasted
        seconds; `ran` False for a finished one, whose seconds were counted at its finish. The
        same from its start on a slot to the run's slot-seconds."""
        if not self.config.auto:
            return
        end = self.time
        if sample.result is not None and sample.result.finished is not None:
            end = sample.result.finished
        seconds = max(0.0, end - sample.submitted)
        lost, total = self.spent
        self.spent = (lost + seconds * wasted, total + seconds * ran)
        start = sample.submitted if sample.slot is None else max(sample.submitted, sample.slot)
        seconds = max(0.0, end - start)
        lost, total = self.slot_spent
        self.slot_spent = (lost + seconds * wasted, total + seconds * ran)

    def end(self, group: Group, sample: Sample, reason: str) -> Group:
        """Stop a sample that is still in play: cancel it in flight or discard its result."""
        label = sample.label
        if sample.state is SampleState.RUNNING:
            self.account(sample, True)
            self.commands.append(Cancel(label, reason))
            self.log("cancelled", group, label, version=sample.version, reason=reason)
        elif sample.state is SampleState.FINISHED:
            self.account(sample, True, ran=False)
            self.log("discarded", group, label, version=sample.version, reason=reason)
        return self.put_sample(group, sample.with_state(SampleState.ENDED))

    def end_group(self, group: Group, state: GroupState, reason: str) -> Group:
        for sample in group.samples:
            group = self.end(group, sample, reason)
        return self.put(group.with_state(state, group.completed))

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

    def calls_left(self, group: Group) -> int:
        """The calls after this one that may admit the group before its oldest submission
        passes max_lag."""
        oldest = min(sample.version for sample in group.samples)
        return max(0, self.config.max_lag - (self.updates - oldest))

    def admit_of(self, batch: int) -> int | None:
        """The groups of `batch` its call waits for: `admit`, or under "auto" the cut chosen for
        the batch the trainer waits on (None, no cut, for a batch not yet waited on)."""
        if not self.config.auto:
            return self.config.admit
        if self.choice is None or batch != self.waiting:
            return None
        return self.choice.admit

    def see(self, group: Group, complete: bool) -> None:
        """Under admit="auto": note a group's seconds to its completion or cut."""
        if self.config.auto:
            seen = (*self.seen, (self.time - group.started, complete))
            self.seen = seen[-_auto.WINDOW :]

    def hedge(self, group: Group) -> None:
        """Under carry_over with hedge: a carried group with at most HEDGE calls left before its
        oldest submission passes max_lag gets one more sample beside each still running, once,
        which backs that one up (see `usable`). Carried only: at its batch's own call (at a
        small max_lag, as few as two calls before its bound) most of a group's samples have
        only just started, and hedging them would double the work in flight."""
        if (
            not group.carried
            or len(group.samples) > self.config.samples
            or self.calls_left(group) > HEDGE
        ):
            return
        for sample in list(group.samples):
            if sample.state is SampleState.RUNNING:
                index = len(group.samples)
                fresh = Sample(
                    Label(group.id, index, 0), self.served, self.time, backs=sample.index
                )
                self.submit(group, fresh, None)
                group = self.put(group.with_samples(group.samples + (fresh,)))

    def usable(self, group: Group) -> list[Sample]:
        """The finished samples a group would train on: each original's own result, or, once
        the group is at its last admissible call and the original is still running (or ended),
        its hedge's. Before that a finished hedge waits: keeping whichever of the two finished
        first would keep the shorter (selection bias), so a hedge stands in only for an
        original that would otherwise make the whole group stale."""
        originals = group.samples[: self.config.samples]
        found = [s for s in originals if s.state is SampleState.FINISHED]
        backups = {
            s.backs: s
            for s in group.samples[self.config.samples :]
            if s.state is SampleState.FINISHED
        }
        if backups and len(found) < self.config.groups:
            last = self.calls_left(group) == 0
            for sample in originals:
                if sample.index in backups and (last or sample.state is SampleState.ENDED):
                    if sample.state is not SampleState.FINISHED:
                        found.append(backups[sample.index])
        return found

    def resolve(self, group: Group) -> None:
        """Complete a hedged group whose finished samples and hedges now make it whole."""
        if len(self.usable(group)) >= self.config.groups:
            self.complete(group)

    def sweep_stale(self, group: Group, started: Mapping[Label, int]) -> None:
        """Resubmit what is already past the bound, by its oldest call's version: for a running
        one, the version `started` gives it (its engine's word), else its submission's."""
        updates, max_lag = self.updates, self.config.max_lag
        for sample in group.samples:
            if (
                sample.state is SampleState.RUNNING
                and updates - started.get(sample.label, sample.version) > max_lag
            ):
                group = self.end(group, sample, "stale")
                group = self.resubmit(group, sample, "stale")
            elif (
                sample.state is SampleState.FINISHED
                and updates - session_version(sample.result, sample.version) > max_lag
            ):
                group = self.end(group, sample, "stale")
                group = self.resubmit(group, sample, "stale")
                group = self.put(group.with_state(GroupState.RUNNING))

    def note_slots(self, slots: Mapping[Label, float]) -> None:
        """Under admit="auto": note when running submissions got an engine slot, as their
        engines said (`HandedOver.slots`), for their slot-seconds."""
        for label, at in slots.items():
            found = self.running(label)
            if found is not None and found[1].slot is None:
                group, sample = found
                self.put_sample(group, attrs.evolve(sample, slot=at))

    def running(self, label: Label) -> tuple[Group, Sample] | None:
        """The group and sample of a submission still in flight, or None if it already ended."""
        group = self.groups.get(label.group)
        if group is None or group.state in FINAL or label.sample >= len(group.samples):
            return None
        sample = group.samples[label.sample]
        if sample.state is not SampleState.RUNNING or sample.attempt != label.attempt:
            return None
        return group, sample

    def finish(self, label: Label, session: Session, slot: float | None = None) -> None:
        found = self.running(label)
        if found is None:
            return
        group, sample = found
        if slot is not None and sample.slot is None and self.config.auto:
            sample = attrs.evolve(sample, slot=slot)
            group = self.put_sample(group, sample)
        cause = admissible_failure(session, self.config.truncation)
        if cause is not None:
            self.account(sample, True)
            self.fail(group, sample, cause, "failed", bounded(session.error))
            return
        updates = self.updates
        if (
            updates is not None
            and updates - session_version(session, sample.version) > self.config.max_lag
        ):
            self.account(sample, True)
            self.log("discarded", group, label, version=sample.version, reason="stale")
            self.resubmit(group, sample, "stale")
            return
        self.account(sample, False)
        finished = sample.with_state(SampleState.FINISHED, session)
        group = self.put_sample(group, finished)
        if sample.backs is None:
            # An original that finished needs no backup: its hedges end as surplus.
            for other in group.samples:
                if other.backs == sample.index:
                    group = self.end(group, other, "surplus")
        self.resolve(group)

    def time_out(self, label: Label) -> None:
        found = self.running(label)
        if found is not None:
            group, sample = found
            self.account(sample, True)
            self.commands.append(Cancel(label, "timeout"))
            self.fail(group, sample, "timeout", "cancelled")

    def fail(
        self, group: Group, sample: Sample, cause: str, kind: str, error: str | None = None
    ) -> None:
        """A failed attempt, logged with its error text: resubmit it, or give the group up once
        the sample is out of attempts."""
        label = sample.label
        self.log(kind, group, label, version=sample.version, reason=cause, error=error)
        if sample.failures + 1 < self.config.max_attempts:
            self.resubmit(group, sample, cause)
            return
        group = self.put_sample(group, sample.with_state(SampleState.ENDED))
        self.log("abandoned", group, label, reason=cause)
        self.end_group(group, GroupState.ABANDONED, "abandoned")

    def complete(self, group: Group) -> None:
        """The group has its `groups` rollouts: cancel the rest, and with `admit`, once enough
        groups of its batch are complete, the batch's other groups.

        Under `filter_uniform`, a group whose training rewards are all equal is discarded
        instead: its advantages would all be 0, so it would take rows and train nothing. It
        does not count toward `admit`, so the batch's later groups take its place."""
        kept = {s.index for s in self.usable(group)[: self.config.groups]}
        for sample in group.samples:
            if sample.index not in kept and sample.state is not SampleState.ENDED:
                group = self.end(group, sample, "surplus")
        if self.config.filter_uniform:
            results = [s.result for s in group.samples if s.state is SampleState.FINISHED]
            if uniform_group(results, self.config.truncation):
                self.see(group, True)
                for sample in group.samples:
                    group = self.end(group, sample, "uniform")
                self.put(group.with_state(GroupState.UNIFORM, self.time))
                return
        self.see(group, True)
        self.put(group.with_state(GroupState.COMPLETE, self.time))
        if not group.carried and not self.config.carry_over:
            # Under carry_over the cut waits for the batch's call (see deliver_carrying).
            self.cut(group.batch)

    def cut(self, batch: int) -> None:
        """Without carry_over: once `admit` of the batch's groups are complete, cancel the
        others."""
        admit = self.admit_of(batch)
        if admit is None:
            return
        members = self.members(batch)
        if sum(g.state is GroupState.COMPLETE for g in members) >= admit:
            for other in members:
                if other.state is GroupState.RUNNING:
                    self.see(other, False)
                    self.end_group(other, GroupState.SURPLUS, "surplus")

    def members(self, batch: int) -> list[Group]:
        """A batch's own groups: those it still holds, carried ones left out."""
        groups = (self.groups.get(i) for i in self.batches[batch])
        return [g for g in groups if g is not None and not g.carried]

    def carry(self, group: Group) -> None:
        """Take a group its batch's call left out of the batch, which no longer waits on it: it
        keeps running (or waits, complete) and a later call admits it."""
        if group.state not in FINAL:
            self.unsettled[group.batch] -= 1
        self.groups[group.id] = group.as_carried()
        self.carried.append(group.id)
        self.log("carried", group)

    def source_failed(self, label: Label, error: BaseException) -> None:
        """A source that raises is broken, whenever it raises: its batch is stopped (when the
        submission was still in play) and the error goes to the trainer."""
        found = self.running(label)
        if found is None:
            self.commands.append(Fail(None, error))
            return
        if found[0].carried:
            # No batch waits on a carried group: it ends, and the trainer hears at once.
            self.end_group(found[0], GroupState.BROKEN, "broken")
            self.commands.append(Fail(None, error))
            return
        batch = found[0].batch
        for group in self.members(batch):
            self.end_group(group, GroupState.BROKEN, "broken")
        self.drop(batch)
        self.commands.append(Fail(batch, error))

    def drop(self, batch: int) -> None:
        """Forget a batch that was delivered or broken."""
        for group_id in self.batches.pop(batch):
            group = self.groups.get(group_id)
            if group is not None and not group.carried:
                del self.groups[group_id]
        del self.unsettled[batch]
        if self.waiting == batch:
            self.waiting = None

    def reopen(self) -> None:
        """The stream was opened again: what the old one left in flight is cancelled, and a
        trainer still waiting on one of its batches is told, since that batch never comes."""
        waiting = self.waiting
        self.stop_all("reopened")
        if waiting is not None:
            error = RuntimeError(
                f"the tasks() stream was reopened while the trainer waited for batch {waiting}"
            )
            self.commands.append(Fail(None, error))

    def stop_all(self, reason: str) -> None:
        for group in list(self.groups.values()):
            self.end_group(group, GroupState.BROKEN, reason)
        self.groups, self.batches, self.unsettled, self.waiting = {}, {}, {}, None
        self.carried, self.held, self.choice, self.delivered_at = [], [], None, None

    def deliver_if_ready(self) -> None:
        batch = self.waiting
        if batch is None or batch not in self.unsettled:
            return
        if self.config.carry_over:
            self.deliver_carrying(batch)
            return
        if self.unsettled[batch] != 0:
            return
        members = self.members(batch)
        own = sorted(
            (g for g in members if g.state is GroupState.COMPLETE),
            key=lambda g: (g.completed, g.id),
        )
        self.deliver(batch, [], own, sum(g.state is GroupState.UNIFORM for g in members))

    def deliver_carrying(self, batch: int) -> None:
        """Under carry_over: answer the call once `admit` of its batch's own groups are
        complete, or once complete groups fill it, carried ones counted; oldest first (carried
        ones in the order they were cut, then the batch's own by completion), up to the task
        batch size. The batch's groups left out, running or complete, are carried."""
        members = self.members(batch)
        own = sorted(
            (g for g in members if g.state is GroupState.COMPLETE),
            key=lambda g: (g.completed, g.id),
        )
        # Held groups first (see HOLD_AFTER), then the others in the order they were cut.
        order = [*self.held, *(i for i in self.carried if i not in self.held)]
        carried = [
            g
            for i in order
            if (g := self.groups[i]).state is GroupState.COMPLETE and g.batch < batch
        ]
        size = len(self.batches[batch])
        admit = self.admit_of(batch)
        # Under auto, where no cut fits the budget, the least wasteful is the whole batch and
        # the run is past its budget (WHOLE_PAST), complete carried groups do not fill the
        # call: filling it would carry the batch's own groups toward their bound, the waste
        # the budget cannot afford. Waiting for them carries none, so the run's measured share
        # falls back within its budget.
        whole = admit == size and self.past_budget(WHOLE_PAST) and self.choice.over_budget
        ready = self.unsettled[batch] == 0 or (
            not whole
            and ((admit is not None and len(own) >= admit) or len(carried) + len(own) >= size)
        )
        if not ready or any(self.groups[i].state is GroupState.RUNNING for i in self.held):
            return
        taken = (carried + own)[:size]
        ready_carried = taken[: min(len(carried), size)]
        own_taken = taken[len(ready_carried) :]
        for group in ready_carried:
            del self.groups[group.id]
            self.carried.remove(group.id)
            if group.id in self.held:
                self.held.remove(group.id)
        kept = {g.id for g in own_taken}
        for group in members:
            if group.id not in kept and group.state in (GroupState.RUNNING, GroupState.COMPLETE):
                self.carry(group)
        uniform = sum(g.state is GroupState.UNIFORM for g in members)
        self.deliver(batch, ready_carried, own_taken, uniform)

    def deliver(self, batch: int, carried: list[Group], own: list[Group], uniform: int) -> None:
        """Admit `carried` then `own`, forget the batch, and hand its groups to the trainer."""
        groups = []
        for group in carried + own:
            sessions = tuple(s.result for s in group.samples if s.state is SampleState.FINISHED)
            for sample in group.samples:
                if sample.state is SampleState.FINISHED:
                    self.log("admitted", group, sample.label, version=sample.version)
            groups.append(sessions)
        self.drop(batch)
        ages = tuple(batch - g.batch for g in carried)
        choice, self.choice, self.delivered_at = self.choice, None, self.time
        self.commands.append(Deliver(batch, tuple(groups), uniform, ages, choice))
