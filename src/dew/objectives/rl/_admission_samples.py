"""A sample's lifecycle in the admission core: submitted, finished, failed, timed out, gone
stale, resubmitted or ended, each step logged.

`_Samples` is one part of `_admission._Step`, the working copy of the scheduler's state that
`_admission.run` changes event by event: its methods change that copy's fields (set in
`_Step.__init__`) and collect its commands. Where a sample's end decides its group's, they call
the group's part (`_admission_groups._Groups`: `resolve`, `members`, `drop`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from dew.objectives.rl import _auto
from dew.objectives.rl._admission_values import (
    FINAL,
    Cancel,
    Fail,
    Group,
    GroupState,
    LogEvent,
    Sample,
    SampleState,
    Submit,
)
from dew.objectives.rl.sessions import Label, Session, Status

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
# The most characters of a session's error text a `failed` event keeps: enough for an exception's
# type and message, bounded so that a source which dumps a whole traceback or page on every
# failure cannot grow the event log without bound.
ERROR_TEXT = 300
# Causes that use up one of a sample's max_attempts; stale resubmission does not.
FAILURES = ("infra_error", "cancelled", "timeout", "unscored")


def bounded(text: str | None) -> str | None:
    """An error text cut to ERROR_TEXT characters, saying that it was cut."""
    if text is None or len(text) <= ERROR_TEXT:
        return text
    return text[: ERROR_TEXT - 1] + "…"


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


class _Samples:
    """The sample methods of `_admission._Step`: its bookkeeping (the log, the stored groups,
    the seconds spent) and what ends or renews a submission."""

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

    def see(self, group: Group, complete: bool) -> None:
        """Under admit="auto": note a group's seconds to its completion or cut."""
        if self.config.auto:
            seen = (*self.seen, (self.time - group.started, complete))
            self.seen = seen[-_auto.WINDOW :]

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

    # --- a submission's end ------------------------------------------------------------------

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
