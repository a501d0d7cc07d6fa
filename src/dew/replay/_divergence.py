"""Comparing a replay with its recording: where the two runs first part."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from dew.objectives.rl.scheduler import LogEvent, SchedulerRecord
from dew.objectives.rl.sessions import Label
from dew.replay._format import RESCORED, UNCOMPARED
from dew.replay._recorded import RecordedCall, Trace


@attrs.frozen
class ReplayNote:
    """Something a replayed rollout did that the recording did not: at `time`, for `label`,
    what the recording did and what the replay does."""

    time: float
    task: str
    label: Label
    recorded: str
    replayed: str


@attrs.frozen
class ReplayedCall:
    """One trainer call as the replay made it: its record, event log, its packed arrays'
    digests (or what it raised), and when it returned."""

    record: SchedulerRecord | None
    events: tuple[LogEvent, ...]
    arrays: Mapping[str, str]
    raised: str | None
    returned: float


@attrs.frozen
class Divergence:
    """Where a replay first parts from its recording.

    Args:
        step: the trainer call.
        field: what differs: `events[i].<field>` (`events[i].task` for the same submission
            of another task), `events[i]` (the events are about different things, or one log
            is longer),
            `record.<field>` (with `[key]` for resubmitted and metrics), `packed[key]`,
            `raised`, `call` (one run made fewer calls, or the replay stalled), `push[i]`, or
            `rollout of task ...` (a rollout the recording never ran, or one it cancelled that
            the replay did not).
        recorded, replayed: the two values.
        time: the scheduler's clock where they part.
        event: the index in the step's event log, for event fields.
        kind: the event's kind.
        label: the rollout concerned, where one is.
        group: its group, where one is.
    """

    step: int
    field: str
    recorded: Any
    replayed: Any
    time: float | None = None
    event: int | None = None
    kind: str | None = None
    label: Label | None = None
    group: int | None = None

    @property
    def sample(self) -> int | None:
        """The sample index of the rollout concerned, where one is."""
        return None if self.label is None else self.label.sample

    def __str__(self) -> str:
        return self.describe()

    def describe(self, start: float | None = None) -> str:
        """The divergence in one line; with the recording's `start`, its time as seconds into
        the run (a real-clock trace's times are the clock's readings, far from 0)."""
        where = [f"step {self.step}"]
        if self.label is not None:
            where.append(str(self.label))
        elif self.group is not None:
            where.append(f"group {self.group}")
        if self.event is not None:
            where.append(f"event {self.event} ({self.kind})")
        if self.time is not None and start is not None:
            where.append(f"{self.time - start:.6g}s into the run (time {self.time!r})")
        elif self.time is not None:
            where.append(f"time {self.time!r}")
        return (
            f"{', '.join(where)}: {self.field}: recorded {_show(self.recorded)}, "
            f"replayed {_show(self.replayed)}"
        )


def _show(value: Any) -> str:
    """A divergence's value as the report prints it: an event as a log line, else its repr."""
    if not isinstance(value, LogEvent):
        return repr(value)
    what = [value.kind]
    if value.label is not None:
        what.append(str(value.label))
    elif value.group is not None:
        what.append(f"group {value.group}")
    if value.reason is not None:
        what.append(f"({value.reason})")
    return f"{' '.join(what)} at {value.time!r}"


@attrs.frozen
class ReplayResult:
    """What a replay found.

    Args:
        path: the trace's file.
        calls: the replayed trainer calls.
        divergence: the first place the replay parts from the recording; None if it matched.
        start: the recording's start on the scheduler's clock; the report gives times from it.
        cut: where a cut-off trace ends (`Trace.cut`); its replay went that far, no further.
    """

    path: str
    calls: tuple[ReplayedCall, ...]
    divergence: Divergence | None
    start: float = 0.0
    cut: str | None = None

    @property
    def matched(self) -> bool:
        """Whether the replay reproduced the recording: no divergence."""
        return self.divergence is None

    @property
    def steps(self) -> int:
        """Trainer calls the replay made."""
        return len(self.calls)

    @property
    def groups(self) -> int:
        """Groups the replayed calls admitted, over every call."""
        return sum(c.record.groups for c in self.calls if c.record is not None)

    @property
    def events(self) -> int:
        """Events in the replayed calls' logs, together."""
        return sum(len(c.events) for c in self.calls)

    def __str__(self) -> str:
        if self.matched:
            text = (
                f"{self.path}: replay matched: {self.steps} steps, {self.groups} groups, "
                f"{self.events} events"
            )
        else:
            text = f"{self.path}: replay diverged at {self.divergence.describe(self.start)}"
        if self.cut is not None:
            text += (
                f"\n{self.path}: the recording was cut off: {self.cut}; replayed as far as it "
                f"goes, {self.steps} calls"
            )
        return text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _event_divergence(
    step: int, recorded: Sequence[LogEvent], replayed: Sequence[LogEvent], log: str = "events"
) -> Divergence | None:
    """The first event where two logs differ: the whole events where they are about different
    things (kind, group, task, label), else the one field (time, version, reason). `log` names
    the log in the divergence's field (a call's `events`, or `closing_events`)."""
    for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
        if a == b:
            continue
        name = next(
            f.name for f in attrs.fields(LogEvent) if getattr(a, f.name) != getattr(b, f.name)
        )
        if name == "task" and a.label == b.label:
            # The same submission of another task (a resumed run's carried group restored
            # differently, say): the names say it, where the two events would print alike.
            field, values = f"{log}[{i}].task", (a.task, b.task)
        elif name in ("kind", "group", "task", "label"):
            field, values = f"{log}[{i}]", (a, b)
        else:
            field, values = f"{log}[{i}].{name}", (getattr(a, name), getattr(b, name))
        return Divergence(
            step,
            field,
            *values,
            time=min(a.time, b.time),
            event=i,
            kind=a.kind,
            label=a.label,
            group=a.group,
        )
    if len(recorded) == len(replayed):
        return None
    i = min(len(recorded), len(replayed))
    extra = recorded[i] if len(recorded) > i else replayed[i]
    return Divergence(
        step,
        f"{log}[{i}]",
        recorded[i] if len(recorded) > i else None,
        replayed[i] if len(replayed) > i else None,
        time=extra.time,
        event=i,
        kind=extra.kind,
        label=extra.label,
        group=extra.group,
    )


def _call_divergence(
    recorded: RecordedCall, replayed: ReplayedCall, *, real_clock: bool
) -> Divergence | None:
    """Where a replayed call first differs from its recording: what it raised, its event log
    (but, for `real_clock`, that of a call that raised), its record (but, for `real_clock`,
    `waited`), its packed arrays."""
    step = recorded.step
    end = min((t for t in (recorded.returned, replayed.returned) if t is not None), default=None)
    if recorded.raised != replayed.raised:
        # An event that differs before either log ends came before the call raised.
        found = _event_divergence(step, recorded.events, replayed.events)
        if found is not None and found.event < min(len(recorded.events), len(replayed.events)):
            return found
        return Divergence(step, "raised", recorded.raised, replayed.raised, time=end)
    if real_clock and recorded.raised is not None:
        # Its log runs up to a failure seen on the real clock a moment after the source raised,
        # a moment the trace does not hold.
        return None
    found = _event_divergence(step, recorded.events, replayed.events)
    if found is not None or recorded.raised is not None:
        return found
    for field in attrs.fields(SchedulerRecord):
        if real_clock and field.name == "waited":
            continue
        a, b = getattr(recorded.record, field.name), getattr(replayed.record, field.name)
        if isinstance(a, Mapping):
            for key in sorted(set(a) | set(b)):
                if key.startswith(UNCOMPARED):
                    continue
                if not _same(a.get(key), b.get(key)):
                    name = f"record.{field.name}[{key!r}]"
                    return Divergence(step, name, a.get(key), b.get(key), time=end)
        elif not _same(a, b):
            return Divergence(step, f"record.{field.name}", a, b, time=end)
    for key in sorted(set(recorded.arrays) | set(replayed.arrays)):
        if key not in RESCORED and recorded.arrays.get(key) != replayed.arrays.get(key):
            return Divergence(
                step,
                f"packed[{key!r}]",
                recorded.arrays.get(key),
                replayed.arrays.get(key),
                time=end,
            )
    return None


def _divergences(
    trace: Trace,
    calls: Sequence[ReplayedCall],
    pushes: Sequence[tuple[float, int]],
    notes: Sequence[ReplayNote],
    closing: Sequence[LogEvent],
) -> list[Divergence]:
    """Where the replay parts from the recording: the first call that differs, the first push,
    every note, the closing events; the earliest by (step, time) is the first divergence. A
    thread trace's pushes are compared by version, and its notes up to its last call's return;
    its close came at a time of the real clock that no trace holds, so its closing events are
    not compared; nor are a cut trace's, which it does not hold."""

    def step_at(time: float) -> int:
        """The call in progress at `time` in the replay."""
        return next((i for i, c in enumerate(calls) if c.returned >= time), len(calls))

    real_clock = trace.facade == "thread"
    if real_clock or trace.cut is not None:
        # A cut trace holds nothing past its last call either.
        returned = max((c.returned for c in trace.calls if c.returned is not None), default=None)
        notes = [n for n in notes if returned is not None and n.time <= returned]
    found: list[Divergence] = []
    for recorded, replayed in zip(trace.calls, calls, strict=False):
        divergence = _call_divergence(recorded, replayed, real_clock=real_clock)
        if divergence is not None:
            found.append(divergence)
            break
    if len(trace.calls) != len(calls):
        step = min(len(trace.calls), len(calls))
        made = {True: "made", False: "not made"}
        found.append(
            Divergence(step, "call", made[step < len(trace.calls)], made[step < len(calls)])
        )
    for i, (a, b) in enumerate(zip(trace.pushes, pushes, strict=False)):
        if (a[1] != b[1]) if real_clock else (a != b):
            time = min(a[0], b[0])
            found.append(Divergence(step_at(time), f"push[{i}]", a, b, time=time))
            break
    if not real_clock and trace.cut is None:
        divergence = _event_divergence(
            len(trace.calls), trace.closing_events, closing, log="closing_events"
        )
        if divergence is not None:
            found.append(divergence)
    for note in notes:
        found.append(
            Divergence(
                step_at(note.time),
                f"rollout of task {note.task!r}",
                note.recorded,
                note.replayed,
                time=note.time,
                label=note.label,
                group=note.label.group,
            )
        )
    return found
