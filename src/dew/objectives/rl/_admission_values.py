"""The admission core's values: its rules (`Config`), what it knows (`State`, its groups and
samples), the events it takes and the commands it gives (see `_admission`, whose `step` maps
one to the other).

All are frozen attrs values, so a state and its events compare and replay alike; `_admission`
changes them with their `with_*` helpers and `attrs.evolve`, never in place.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from dew.data import Task
from dew.objectives.rl._auto import Choice, Stretch
from dew.objectives.rl.sessions import Label, Session


@attrs.frozen
class Config:
    """The admission rules of one scheduler (see RolloutScheduler for their meaning)."""

    groups: int
    oversample: int = 0
    admit: int | str | None = None  # "auto": each call's, chosen by `_auto.choose`
    max_lag: int = 1
    max_attempts: int = 3
    truncation: str = "mask"
    filter_uniform: bool = False
    carry_over: bool = False
    waste_budget: float = 0.2  # under admit="auto": the most waste the run's cuts may cost
    hedge: bool = True  # under carry_over: back up a group's stragglers before its bound

    @property
    def samples(self) -> int:
        return self.groups + self.oversample

    @property
    def auto(self) -> bool:
        return self.admit == "auto"


class SampleState(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"  # an admissible result waits in `result`
    ENDED = "ended"  # cancelled as surplus, or out of attempts


class GroupState(enum.Enum):
    RUNNING = "running"
    COMPLETE = "complete"
    SURPLUS = "surplus"
    ABANDONED = "abandoned"
    BROKEN = "broken"
    UNIFORM = "uniform"  # complete, its rewards all equal: discarded under filter_uniform


FINAL = (
    GroupState.COMPLETE,
    GroupState.SURPLUS,
    GroupState.ABANDONED,
    GroupState.BROKEN,
    GroupState.UNIFORM,
)


@attrs.frozen
class Sample:
    """One sample of a group: its current submission and what came of it."""

    label: Label  # of its latest submission; each submission has a new attempt
    version: int  # the version served at its latest submission
    submitted: float  # the time of its latest submission
    failures: int = 0
    state: SampleState = SampleState.RUNNING
    result: Session | None = None
    backs: int | None = None  # a hedge's: the index of the original sample it backs up
    # When its first call got an engine slot, as the engine said it (note_progress), once the
    # core has heard: its slot-seconds count from there (None: from its submission).
    slot: float | None = None

    @property
    def index(self) -> int:
        return self.label.sample

    @property
    def attempt(self) -> int:
        return self.label.attempt

    # The core replaces samples and groups on every event: these are attrs.evolve without its
    # reflection, which dominated the core's cost.
    def with_state(self, state: SampleState, result: Session | None = None) -> Sample:
        return Sample(
            self.label,
            self.version,
            self.submitted,
            self.failures,
            state,
            result,
            self.backs,
            self.slot,
        )


@attrs.frozen
class Group:
    """One task's group of rollouts."""

    id: int
    batch: int
    task: Task
    samples: tuple[Sample, ...]
    state: GroupState = GroupState.RUNNING
    completed: float | None = None
    # Cut from its batch under carry_over: no longer its batch's member, admitted at a later
    # call's delivery (its batch's number stays, the call it came from).
    carried: bool = False
    started: float = 0.0  # its first submission's time
    # A resumed run's carried group: the stale cycles its task had run before the checkpoint
    # (see HOLD_AFTER), which its own samples' count on from.
    stale_before: int = 0

    @property
    def stale(self) -> int:
        """The most stale cycles any of its samples has run (see HOLD_AFTER)."""
        return self.stale_before + max(s.attempt - s.failures for s in self.samples)

    def with_samples(self, samples: tuple[Sample, ...]) -> Group:
        return Group(
            self.id,
            self.batch,
            self.task,
            samples,
            self.state,
            self.completed,
            self.carried,
            self.started,
            self.stale_before,
        )

    def with_state(self, state: GroupState, completed: float | None = None) -> Group:
        return Group(
            self.id,
            self.batch,
            self.task,
            self.samples,
            state,
            completed,
            self.carried,
            self.started,
            self.stale_before,
        )

    def as_carried(self) -> Group:
        return Group(
            self.id,
            self.batch,
            self.task,
            self.samples,
            self.state,
            self.completed,
            True,
            self.started,
            self.stale_before,
        )


@attrs.frozen
class State:
    """Everything the core knows: the groups in play and where the trainer is."""

    config: Config
    updates: int | None = None  # the trainer's updates at its latest hand-over
    served: int | None = None  # the version the engines serve
    next_group: int = 0
    last_submitted: int = -1  # the newest batch submitted
    groups: Mapping[int, Group] = attrs.field(factory=dict)
    batches: Mapping[int, tuple[int, ...]] = attrs.field(factory=dict)  # batch -> group ids
    unsettled: Mapping[int, int] = attrs.field(factory=dict)  # batch -> groups not yet final
    waiting: int | None = None  # the batch the trainer waits on
    closed: bool = False
    carried: tuple[int, ...] = ()  # ids of carried groups still in play, oldest cut first
    held: tuple[int, ...] = ()  # ids of carried groups the next call waits for (HOLD_AFTER)
    # Under admit="auto": this run's recent groups, (seconds from first submission to completion
    # or cut, whether they completed); its recent step times (a delivery to the next
    # hand-over); the latest delivery's time; and the cut chosen for the batch waited on.
    seen: tuple[tuple[float, bool], ...] = ()
    steps: tuple[float, ...] = ()
    delivered_at: float | None = None
    choice: Choice | None = None
    # Under admit="auto": the rollout-seconds (submission to end) of the submissions that
    # ended, thrown away and all: what the run's cuts, hedges, staleness and queueing cost.
    spent: tuple[float, float] = (0.0, 0.0)
    # The same in slot-seconds, each submission from its start on an engine slot (its first
    # call's, as the engine said it) to its end, its queueing left out; one whose engine never
    # said counts from its submission (dew simulate's slot waste, as the core can know it).
    # The budget bounds this one: what the engines, not their queues, gave to work thrown away.
    slot_spent: tuple[float, float] = (0.0, 0.0)
    # Under admit="auto" with carry_over: the admit held and how its stretch stands (_auto.hold).
    stretch: Stretch | None = None


# Events: what happened. `time` is the scheduler's clock.


@attrs.frozen
class HandedOver:
    """The trainer handed over `batch` at `updates`, the engines now serve `served`; `tasks`
    holds that batch and the registered batches after it, up to `ahead` of them."""

    time: float
    batch: int
    updates: int
    served: int
    pushed: bool
    tasks: tuple[tuple[int, tuple[Task, ...]], ...]
    # Tasks of groups a checkpoint recorded as carried: a resumed run submits them again, as
    # carried groups of the call before this one; `stale` holds each one's stale cycles before
    # the checkpoint (none given: 0), from which its count towards HOLD_AFTER goes on.
    carried: tuple[Task, ...] = ()
    stale: tuple[int, ...] = ()
    # The running rollouts whose engine said which version their oldest call started under
    # before this instant (note_progress), with that version: their lag counts from it, as a
    # finished rollout's does. A running rollout not named counts from its submission.
    started: tuple[tuple[Label, int], ...] = ()
    # The same rollouts with when that call started: when each got an engine slot.
    slots: tuple[tuple[Label, float], ...] = ()


@attrs.frozen
class Finished:
    time: float
    label: Label
    session: Session
    # When its first call got an engine slot, where its engine said so (note_progress).
    slot: float | None = None


@attrs.frozen
class TimedOut:
    time: float
    label: Label


@attrs.frozen
class SourceFailed:
    """The source raised instead of returning a session: it is broken."""

    time: float
    label: Label
    error: BaseException = attrs.field(eq=False)


@attrs.frozen
class Reopened:
    """The trainer opened the task stream again. `next_group`: the least id the groups it
    submits from then on take (a resumed run's, from its checkpoint: its groups, and so their
    sampling keys, are numbered on from where the checkpointed run's were)."""

    time: float
    next_group: int = 0


@attrs.frozen
class Closed:
    time: float


Event = HandedOver | Finished | TimedOut | SourceFailed | Reopened | Closed


# Commands: what the shell must do.


@attrs.frozen
class Submit:
    """Start a rollout at `time` (its submission: its deadline and latency count from here)."""

    task: Task
    label: Label
    batch: int
    version: int
    time: float


@attrs.frozen
class Cancel:
    label: Label
    reason: str


@attrs.frozen
class Deliver:
    """Hand batch's admitted groups, in admission order, to the trainer; `uniform` counts the
    batch's groups discarded because their rewards were all equal; under carry_over, the
    carried groups it admits come first, `carried` giving each one's age in calls."""

    batch: int
    groups: tuple[tuple[Session, ...], ...]
    uniform: int = 0
    carried: tuple[int, ...] = ()  # the age in calls of each carried group, first in `groups`
    choice: Choice | None = None  # under admit="auto": the call's cut and its estimate


@attrs.frozen
class Fail:
    """Raise `error` to the trainer once `batch`'s rollouts have stopped; with batch None (a
    source that raised for a submission already ended, say while it was being cancelled), at
    once."""

    batch: int | None
    error: BaseException = attrs.field(eq=False)


@attrs.frozen
class LogEvent:
    """One line of the scheduler's event log.

    kind is one of submitted, admitted, cancelled, discarded, failed (per submission), abandoned,
    carried, held, cut (per group), handed_over (version = the trainer's updates), pushed or
    reopened; reason is the cause or reason where the kind has one. error is the failed
    session's own error text (an exception's type and message, as a source reports it), at most
    ERROR_TEXT characters; it is carried from the session, which a trace already holds, so
    events compare without it.
    """

    kind: str
    time: float
    version: int | None = None
    group: int | None = None
    task: str | None = None
    label: Label | None = None
    reason: str | None = None
    error: str | None = attrs.field(default=None, eq=False)


Command = Submit | Cancel | Deliver | Fail | LogEvent
