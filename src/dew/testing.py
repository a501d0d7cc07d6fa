"""Helpers for replay tests of session sources: record a run, replay it, check its accounting.

A test records a short run of its source under trio's MockClock (pytest-trio's `autojump_clock`
fixture), checks the records and event log, and replays the trace; see docs/replay.md:

    async def test_my_source_replays(tmp_path, autojump_clock):
        trace = await record_run(MySource(), MyEngine(), tmp_path / "run.trace",
                                 updates=range(8), width=128, rows=8, groups=4)
        for call in trace.calls:
            assert_record_adds_up(call.record, call.events)
        assert_exactly_once([e for call in trace.calls for e in call.events])
        await assert_replays(trace)
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import trio

from dew._checks import check_int
from dew.data import ArrayDataset, Batch, Task
from dew.envs.simulated import SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.objectives.rl.scheduler import (
    LogEvent,
    Publisher,
    RolloutScheduler,
    SchedulerRecord,
    task_ids,
)
from dew.objectives.rl.sessions import Label, SessionSource
from dew.replay import (
    NoRescoring,
    Recorder,
    RecordingPublisher,
    RecordingSource,
    ReplayResult,
    Trace,
    read_trace,
    replay_async,
)

__all__ = [
    "assert_exactly_once",
    "assert_record_adds_up",
    "assert_replays",
    "record_run",
    "run_simulated",
]

# How a submission can end, in the event log.
ENDINGS = ("admitted", "cancelled", "discarded", "failed")
# Cancellations the record's `cancelled` counts; the others resubmit (timeout) or stop the run.
COUNTED_CANCELLATIONS = ("surplus", "stale", "abandoned")


async def record_run(
    source: SessionSource,
    publisher: Publisher,
    path: str | os.PathLike,
    *,
    updates: Iterable[int],
    batch_size: int = 4,
    gap: float = 1.0,
    tasks: Callable[[Batch], Sequence[Task]] = task_ids,
    objective: Any = None,
    variables: Any = None,
    spend: Callable[[float], Awaitable[Any]] = trio.sleep,
    **options: Any,
) -> Trace:
    """Run a scheduler over `source` with a fake trainer, record it to `path`, read it back.

    The trainer reads integer task ids (`batch_size` a batch) from the scheduler's tasks()
    stream, `ahead` batches before it hands each over, makes one call per entry of `updates`
    (the optimizer updates it reports), and spends `gap` seconds of trio's clock between calls,
    as a real trainer's optimizer step would.

    Args:
        source: the source under test.
        publisher: where weight pushes go (e.g. the engine the source calls).
        path: where the trace is written.
        updates: the trainer's updates at each call; its length is the number of calls.
        batch_size: tasks per batch.
        gap: seconds between a call's return and the next hand-over.
        tasks: turns a batch of `task_id` rows into tasks.
        objective: rescores the packed rows; NoRescoring (zeros) by default.
        variables: what the trainer hands over and pushes.
        spend: how the trainer spends its `gap` (trio.sleep; `dew.simulate.SharedCpu`'s
            trainer side for a trainer that shares a CPU with the engine).
        **options: the other RolloutScheduler arguments (width, rows, groups, ...).

    Returns:
        the trace, read back from `path`, which is written afresh (a file there is replaced).

    Raises:
        TypeError: when updates is not an iterable (e.g. a count of calls).
        ValueError: when updates is empty or holds something other than an int >= 0.
        RuntimeError: when not awaited inside a trio run.
    """
    _check_trio("record_run")
    updates = _check_updates(updates)
    recorder = Recorder(path)
    scheduler = RolloutScheduler(
        NoRescoring() if objective is None else objective,
        RecordingSource(source, recorder),
        RecordingPublisher(publisher, recorder),
        tasks=tasks,
        **options,
    )
    rows = (len(updates) + scheduler.ahead) * batch_size
    dataset = ArrayDataset({"task_id": np.arange(rows)}, batch_size)
    async with recorder.record(scheduler):
        stream = recorder.tasks(dataset).stream()
        prefetched = collections.deque(itertools.islice(stream, scheduler.ahead + 1))
        for count in updates:
            batch = prefetched.popleft()
            prefetched.extend(itertools.islice(stream, 1))
            await recorder.step(batch, variables, count)
            await spend(gap)
    return read_trace(path)


def _check_trio(name: str) -> None:
    """Refuse to go on outside a trio run (awaited from asyncio, say), saying what to do."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        raise RuntimeError(
            f"{name} runs inside a trio run (pytest-trio's tests, trio.run); from plain code "
            "call dew.replay.replay(trace), which runs a trio run of its own"
        ) from None


def _check_updates(updates: Iterable[int]) -> list[int]:
    """record_run's `updates` as a list of ints, one per call, or an error saying what is wrong."""
    if not isinstance(updates, Iterable):
        raise TypeError(
            f"updates must be an iterable of ints, one per call (e.g. range(6)), got {updates!r}"
        )
    checked = [check_int(f"updates[{i}]", u, low=0) for i, u in enumerate(updates)]
    if not checked:
        raise ValueError("updates is empty: a run of no calls records nothing to replay")
    return checked


async def run_simulated(
    path: str | os.PathLike,
    *,
    updates: Iterable[int],
    config: SimulatedConfig | None = None,
    slots: int | None = None,
    **options: Any,
) -> Trace:
    """record_run over a SimulatedSource on a SimulatedEngine of `slots` decode slots.

    Args:
        path: where the trace is written.
        updates: the trainer's updates at each call.
        config: how the simulated sessions are drawn; SimulatedConfig() by default.
        slots: calls the engine decodes at once; None for no limit.
        **options: record_run's and the scheduler's other arguments.
    """
    engine = SimulatedEngine(slots=slots)
    return await record_run(
        SimulatedSource(engine, config or SimulatedConfig()),
        engine,
        path,
        updates=updates,
        **options,
    )


async def assert_replays(trace: Trace | str | os.PathLike, **overrides: Any) -> ReplayResult:
    """Replay a trace and fail with its first divergence.

    The replay runs in a worker thread, in a trio run and on a MockClock of its own, so the
    caller's clock may read anything.

    The replay plays the recorded rollouts back and never runs the source again: it checks
    that the scheduler makes the same run of them, not that the source is deterministic.

    Raises:
        AssertionError: saying where the replay parted from the recording.
        RuntimeError: when not awaited inside a trio run.
    """
    _check_trio("assert_replays")
    result = await replay_async(trace, **overrides)
    if not result.matched:
        raise AssertionError(str(result))
    return result


def _describe(event: LogEvent) -> str:
    return f"{event.kind} of task {event.task!r} {event.label} at {event.time}"


def assert_exactly_once(events: Iterable[LogEvent]) -> frozenset[Label]:
    """Check that every submission in an event log ends at most once, and after it began.

    A submission ends admitted, cancelled, discarded or failed. A log cut at a trainer call
    holds submissions still in flight; they are returned, for the caller to check. A
    resubmission must follow its previous attempt's end, with the next attempt number.

    Args:
        events: an event log in order, e.g. every call's events of a run concatenated.

    Returns:
        the labels submitted and not yet ended.

    Raises:
        AssertionError: naming the event that breaks the rule.
    """
    open_: set[Label] = set()
    ended: set[Label] = set()
    for event in events:
        if not isinstance(event, LogEvent):
            raise TypeError(
                "events must be LogEvents (e.g. every call's `call.events` concatenated), "
                f"got {type(event).__name__}"
            )
        label = event.label
        if event.kind == "submitted":
            if label in open_ or label in ended:
                raise AssertionError(f"submitted twice: {_describe(event)}")
            previous = Label(label.group, label.sample, label.attempt - 1)
            if label.attempt > 0 and previous not in ended:
                raise AssertionError(
                    f"resubmitted before attempt {previous.attempt} ended: {_describe(event)}"
                )
            if (label.attempt > 0) != (event.reason is not None):
                raise AssertionError(f"a resubmission must say its cause: {_describe(event)}")
            open_.add(label)
        elif event.kind in ENDINGS:
            if label not in open_:
                fault = "ended twice" if label in ended else "ended unsubmitted"
                raise AssertionError(f"{fault}: {_describe(event)}")
            open_.remove(label)
            ended.add(label)
    return frozenset(open_)


def assert_record_adds_up(record: SchedulerRecord, events: Sequence[LogEvent]) -> None:
    """Check that a call's SchedulerRecord counts what its event log says.

    resubmitted counts the log's resubmissions by cause; cancelled its surplus, stale and
    abandoned cancellations; abandoned and cut its abandoned and cut events; groups the groups
    admitted less those cut; and lag is updates - version.

    Raises:
        AssertionError: naming the field that does not add up.
        TypeError: when record is not a SchedulerRecord (e.g. a RecordedCall: pass its
            `call.record` and `call.events`).
    """
    if not isinstance(record, SchedulerRecord):
        raise TypeError(
            "record must be a SchedulerRecord (a RecordedCall's `call.record`), "
            f"got {type(record).__name__}"
        )
    resubmitted = collections.Counter(
        e.reason for e in events if e.kind == "submitted" and e.reason is not None
    )
    expected: Mapping[str, Any] = {
        "resubmitted": dict(resubmitted),
        "cancelled": sum(
            e.kind == "cancelled" and e.reason in COUNTED_CANCELLATIONS for e in events
        ),
        "abandoned": sum(e.kind == "abandoned" for e in events),
        "cut": sum(e.kind == "cut" for e in events),
        "groups": len({e.group for e in events if e.kind == "admitted"})
        - sum(e.kind == "cut" for e in events),
        "lag": record.updates - record.version,
    }
    for name, value in expected.items():
        got = getattr(record, name)
        if name == "resubmitted":
            # The record names every cause; the log only those that happened.
            got = {cause: count for cause, count in got.items() if count}
        if got != value:
            raise AssertionError(f"record.{name} is {got!r}, the event log says {value!r}")
