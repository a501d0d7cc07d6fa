"""What a trace holds, read back: its rollouts, trainer calls, `tasks()` streams and the run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from dew.data import Task
from dew.objectives.rl.scheduler import LogEvent, SchedulerRecord
from dew.objectives.rl.sessions import Label, Session


@attrs.frozen
class RecordedSession:
    """One rollout the recorded source ran, and how it ended.

    Args:
        task, label: what the scheduler asked for.
        submitted, ended: the scheduler's clock when the run started and when it returned,
            raised or was cancelled.
        outcome: one of OUTCOMES.
        session: the returned session (unstamped), for `returned`.
        error: what was raised, or why the returned value could not be held, for `raised` and
            `invalid`.
        first_call: when its oldest call started and its version, where its engine said so
            (note_progress): the scheduler counts a running rollout's lag from it.
        started: when the scheduler let it start, where it held it queued for a slot
            (align_starts): its run began then, not at its submission.
    """

    task: Task
    label: Label
    submitted: float
    ended: float
    outcome: str
    session: Session | None = attrs.field(default=None, eq=False)
    error: str | None = None
    first_call: tuple[float, int] | None = None
    started: float | None = None


@attrs.frozen
class RecordedCall:
    """One recorded trainer call.

    Args:
        step: its index among the run's calls.
        batch: the scheduler's index of the batch handed over.
        updates: the trainer's updates at the call.
        stream: the tasks() stream open at the call (None if none was).
        read: batches that stream had yielded at the hand-over.
        handed_over, returned: the scheduler's clock at the call and at its return (for a call
            from the trainer's thread, its `handed_over` event and its delivery; None when such a
            call raised).
        record, events: the call's SchedulerRecord and event log.
        arrays: per key of the returned packed batch, the digest of that array alone.
        raised: what the call raised instead, if it did.
    """

    step: int
    batch: int
    updates: int
    stream: int | None
    read: int
    handed_over: float | None
    returned: float | None
    record: SchedulerRecord | None
    events: tuple[LogEvent, ...]
    arrays: Mapping[str, str]
    raised: str | None


@attrs.frozen
class RecordedStream:
    """One `tasks()` stream the trainer opened.

    Args:
        time: the scheduler's clock when it was opened; None when no scheduler's clock ran (it
            was opened before the scheduler's first call from the trainer's thread) or when no
            delivered call's log holds its `reopened` event.
        running: whether the scheduler's trio side ran when it was opened (the open then logged
            a `reopened` event and cancelled what was in flight).
        batches: the batch indices it yielded, in order.
        restored: how many carried groups a checkpoint gave the scheduler (`restore_state`),
            which it submitted again at the first call after this stream opened.
        resumed: those groups, each as ((stream position, index in its batch), task, stale
            cycles), which a replay gives its scheduler; empty in a trace written before dew
            recorded them (`restored` counts them, and such a trace cannot be replayed).
        next_group: the id a resumed run's scheduler gave its first group from this stream on
            (its checkpoint's `next_group`), which a replay gives its scheduler; 0 otherwise.
        line: the stream's line in the trace file.
    """

    time: float | None
    running: bool
    batches: tuple[int, ...]
    restored: int = 0
    resumed: tuple[tuple[tuple[int, int], Task, int], ...] = ()
    next_group: int = 0
    line: int | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Trace:
    """A recorded run, read back.

    Args:
        path: the file it was read from.
        facade: how the trainer called the scheduler, one of FACADES.
        config: the scheduler's configuration, by CONFIG name.
        start: the scheduler's clock when the recording began (a thread trace's first time).
        batches: batch index -> its tasks.
        streams: per stream id, in order of opening.
        sessions: label -> the recorded rollout.
        pushes: every weight push, as (time, version).
        calls: the trainer calls, in order.
        end: the time the scheduler was closed (a thread trace's last time).
        closing_events: the scheduler's `closing_events`: its event log after the last call's,
            through the close.
        cut: for a trace whose recording was cut off (a killed run's, read with `partial`),
            where it ends; its `end` is then its last call's return and `closing_events` empty.
        push_starts: per push, when it began (None where the trace does not say: written
            before dew recorded it). The scheduler knows a push's version from its start, so
            a rollout may end under it before the push's end.
    """

    path: str
    facade: str
    config: Mapping[str, Any]
    start: float
    batches: Mapping[int, tuple[Task, ...]]
    streams: tuple[RecordedStream, ...]
    sessions: Mapping[Label, RecordedSession]
    pushes: tuple[tuple[float, int], ...]
    calls: tuple[RecordedCall, ...]
    end: float
    closing_events: tuple[LogEvent, ...]
    cut: str | None = None
    push_starts: tuple[float | None, ...] = ()
