"""A group's way to the trainer in the admission core: hedged, completed or cut, carried over
to a later call, and delivered with its batch.

`_Groups` is one part of `_admission._Step`, the working copy of the scheduler's state that
`_admission.run` changes event by event: its methods change that copy's fields (set in
`_Step.__init__`) and collect its commands. They end samples through the sample part
(`_admission_samples._Samples`: `end`, `end_group`, `put`, `log`, `see`) and, under
admit="auto", read the call's chosen cut (`_Step.past_budget`, `choice`).
"""

from __future__ import annotations

from dew.objectives.rl._admission_values import (
    FINAL,
    Deliver,
    Fail,
    Group,
    GroupState,
    Sample,
    SampleState,
)
from dew.objectives.rl._rewards import uniform_group
from dew.objectives.rl.sessions import Label

# Under carry_over (with hedge), a group still running when the call two before its last
# admissible one hands over gets a fresh sample beside each of its running ones (a hedge): a
# straggler whose group would otherwise pass max_lag and be resubmitted whole. A hedge is a
# fallback, not a race: it replaces its original only where the original has not finished by the
# group's last admissible call, since keeping whichever finishes first would keep the shorter of
# two (selection bias). Two calls ahead: one gives a hedge too few seconds to finish, three run
# hedges beside more originals that finish in time, which is waste (benchmarks/long_tail.py;
# docs/concepts.md, "Carry-over").
HEDGE = 2
# Under admit="auto" with carry_over, a call at which no cut fits the waste budget, while the
# run's measured slot waste is past the budget by more than this, waits for its batch's own
# groups (see deliver_carrying). Without it a heavy tail's run stayed over its budget for good
# (benchmarks/long_tail.py --workloads, seed 0, 100 steps: 16.6 % and 24.2 % on sigma 1.5 and
# 2.0 against 0.15): its calls, filled with complete carried groups, carried the batch's own
# toward their bound. Waiting for a whole batch costs its slowest rollout's seconds (on sigma
# 2.0, a minute and more), so the run first spends most of the point over its budget that
# issue 46 allows (at half a point the waits cost sigma 1.5 at a 0.25 budget 0.09 of the bound).
WHOLE_PAST = 0.009


class _Groups:
    """The group methods of `_admission._Step`: hedges, completion and the cut, carry-over,
    delivery, and the stream's end."""

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

    # --- delivery ----------------------------------------------------------------------------

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
