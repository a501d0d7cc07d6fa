"""Replaying a trace: `replay` drives a scheduler over the trace's playback (`_replay_source`) and
checks what it delivers against what was recorded."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from dew import _gc
from dew.data import Batch
from dew.objectives.rl.scheduler import MAX_IN_FLIGHT, RolloutScheduler
from dew.replay._divergence import Divergence, ReplayedCall, ReplayResult, _divergences
from dew.replay._format import (
    CONFIG,
    TraceError,
    _describe,
    array_digests,
)
from dew.replay._recorded import RecordedCall, RecordedStream, Trace
from dew.replay._replay_source import NoRescoring, ReplayPublisher, ReplaySource, ReplayStalled
from dew.replay._trace import read_trace


@attrs.frozen
class _Batches:
    """A dataset whose one stream yields replay batches by the scheduler's batch index."""

    indices: tuple[int, ...]

    def stream(self, start: int = 0) -> Iterator[Batch]:
        for index in self.indices[start:]:
            yield _batch(index)


def _batch(index: int) -> dict[str, np.ndarray]:
    return {"batch": np.array([index], np.int64)}


def _configure(trace: Trace, overrides: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(CONFIG))
    if unknown:
        raise ValueError(f"cannot override {', '.join(unknown)}: the configuration is {CONFIG}")
    return {**trace.config, **overrides}


def replay(
    trace: Trace | str | os.PathLike,
    *,
    progress: Callable[[int, int, float], None] | None = None,
    **overrides: Any,
) -> ReplayResult:
    """Replay a trace in a trio run of its own, on a `trio.testing.MockClock` from 0.

    The scheduler is rebuilt from the trace's configuration, `overrides` replacing any of it
    (by CONFIG name, e.g. `max_lag=0`), over a ReplaySource, a ReplayPublisher and NoRescoring.
    The trainer's calls are made at their recorded hand-over times with their recorded batches
    and updates, after reading the tasks() stream as far as the recorded trainer had; the
    scheduler is closed at the recorded end.

    A trace whose recording was cut off (a killed run's, flushed line by line) replays up to its
    last call that returned: its `ReplayResult.cut` says where it ends, and what came after that
    call (rollouts still running, the close) is not compared.

    A run resumed from a checkpoint under carry-over replays too: the carried groups its
    scheduler took back (`restore_state`) are given to the replayed scheduler as its stream
    opens, with the tasks the trace holds for them, so its first call submits them again.

    Args:
        trace: a Trace, or the path of one (plain or gzip).
        progress: called after each replayed call with the calls replayed, the calls the trace
            holds and the replay clock's seconds since the recording's start.
        overrides: scheduler arguments by CONFIG name.

    Returns:
        the replayed calls and the first divergence, if any.

    Raises:
        ValueError: an unknown override, or one the scheduler refuses.
        TraceError: when the trace cannot be read, its header holds a configuration the
            scheduler refuses, it starts before the replay clock's 0, or its run resumed
            carried groups whose tasks and stale cycles it does not hold (a trace written
            before dew recorded them: its stream line has the `restored` count alone).
    """
    trace = trace if isinstance(trace, Trace) else read_trace(trace, partial=True)
    # The trace is read and alive all the replay long: the collector need not walk it.
    with _gc.frozen():
        return trio.run(
            functools.partial(_replay, trace, overrides, progress),
            clock=trio.testing.MockClock(autojump_threshold=0),
        )


async def replay_async(
    trace: Trace | str | os.PathLike,
    *,
    progress: Callable[[int, int, float], None] | None = None,
    **overrides: Any,
) -> ReplayResult:
    """`replay` from inside a trio run, a test's say: it runs in a worker thread, in a trio
    run and on a MockClock of its own, so it starts at the trace's start whatever the caller's
    clock reads (`progress` is called from that thread)."""
    call = functools.partial(replay, trace, progress=progress, **overrides)
    return await trio.to_thread.run_sync(call)


def _scheduler(trace: Trace, config: Mapping[str, Any], source: ReplaySource, publisher):
    """The replayed run's scheduler, built from `config` over the replay's collaborators."""
    return RolloutScheduler(
        NoRescoring(),
        source,
        publisher,
        tasks=lambda batch: trace.batches[int(batch["batch"][0])],
        **config,
    )


def _check_recorded(trace: Trace, source: ReplaySource) -> None:
    """Refuse a header whose configuration no scheduler takes (a damaged or forged trace: sizes
    that would hang or exhaust memory, a float where an int goes) as the trace's fault, before
    any override is applied; and a stream whose restored carried groups cannot be resubmitted.

    Raises:
        TraceError: naming the file, the line and the problem: the scheduler's refusal of the
            header's config; a stream line that counts restored groups without holding them
            (a trace written before dew recorded them), or that restores more rollouts than a
            task batch may start (MAX_IN_FLIGHT).
    """
    try:
        scheduler = _scheduler(trace, trace.config, source, ReplayPublisher())
    except (TypeError, ValueError) as error:
        problem = f"the header's config is one no scheduler takes: {error}"
        raise TraceError(trace.path, 1, problem) from None
    samples = scheduler.config.samples
    scheduler.close()
    for index, stream in enumerate(trace.streams):
        if stream.restored != len(stream.resumed):
            problem = (
                f"stream {index} resumed {stream.restored} carried groups from a checkpoint, and "
                "the trace holds their count but not their tasks and stale cycles (it was "
                "written before dew recorded them), which replay needs to resubmit them; "
                "replay a trace recorded from the run's start, or record the resume again"
            )
        elif stream.restored * samples > MAX_IN_FLIGHT:
            problem = (
                f"stream {index} restores {stream.restored} carried groups of {samples} "
                f"rollouts, more than the {MAX_IN_FLIGHT} a scheduler starts for a task batch"
            )
        else:
            continue
        if stream.line is None:
            raise ValueError(f"{trace.path}: {problem}")
        raise TraceError(trace.path, stream.line, problem)


async def _replay(
    trace: Trace | str | os.PathLike,
    overrides: Mapping[str, Any],
    progress: Callable[[int, int, float], None] | None,
) -> ReplayResult:
    trace = trace if isinstance(trace, Trace) else read_trace(trace, partial=True)
    config = _configure(trace, overrides)
    if trio.current_time() > trace.start:
        # No clock a scheduler records on reads before 0, where a replay's starts.
        raise TraceError(
            trace.path,
            1,
            f"the recording starts at time {trace.start!r}, before the replay clock's "
            f"{trio.current_time()!r}, which cannot go back to it (a damaged trace?)",
        )
    source = ReplaySource(trace)
    if trace.facade == "async":
        starts, ends = {}, [time for time, _ in trace.pushes]
    else:
        starts, ends = _thread_pushes(trace)
    publisher = ReplayPublisher(ends, source.sleep_until)
    _check_recorded(trace, source)
    scheduler = _scheduler(trace, config, source, publisher)
    source.settled = scheduler._settled
    calls: list[ReplayedCall] = []
    stalled: list[Divergence] = []
    # Streams opened before the scheduler ran logged no reopening: open them before it runs.
    streams = [_open(scheduler, stream) for stream in trace.streams if not stream.running]
    try:
        async with source, scheduler:
            await _drive(trace, scheduler, source, calls, streams, starts, progress)
    except ReplayStalled as error:
        step = len(calls)
        recorded = trace.calls[step].returned if step < len(trace.calls) else trace.end
        returned = "returned" if recorded is None else f"returned at {recorded!r}"
        stalled.append(Divergence(step, "call", returned, str(error), time=error.time))
    closing = scheduler.closing_events
    found = _divergences(trace, calls, publisher.pushes, source.notes, closing) + stalled
    divergence = min(
        found, key=lambda d: (d.step, math.inf if d.time is None else d.time), default=None
    )
    return ReplayResult(trace.path, tuple(calls), divergence, start=trace.start, cut=trace.cut)


def _thread_pushes(trace: Trace) -> tuple[dict[int, float], list[float]]:
    """When a thread trace's calls reached the scheduler, and when its pushes ended.

    The trainer's thread reads no trio clock: a call's time in the trace is its `handed_over`
    event, which an awaited push (`load_async`) puts at the push's end. A call whose log says
    it `pushed` made the next push, which began when the call reached the scheduler
    (`Trace.push_starts`). Replay makes the call then and lets its push last until the recorded
    hand-over, so what happened during the push (a rollout that ended under the version being
    pushed) happens again. A push the trace holds no start of, or a synchronous one (its
    hand-over is its start), is instant at its call's hand-over.

    Returns:
        step -> the call's time, for the calls whose push began before their hand-over; and
        per push, when it ends (-inf for an instant one).
    """
    starts: dict[int, float] = {}
    ends = [-math.inf] * len(trace.pushes)
    pushing = (call for call in trace.calls if any(e.kind == "pushed" for e in call.events))
    for index, (call, began) in enumerate(zip(pushing, trace.push_starts, strict=False)):
        if None not in (began, call.handed_over) and began < call.handed_over:
            starts[call.step] = began
            ends[index] = call.handed_over
    return starts, ends


def _open(scheduler: RolloutScheduler, stream: RecordedStream) -> Iterator[Batch]:
    """Open a recorded stream in the replayed scheduler, its groups numbered from the recorded
    one's first (a resumed run's), with the carried groups the recorded one resubmitted from a
    checkpoint: the trace holds their tasks, no dataset does."""
    if stream.next_group:
        scheduler.restore_state({"carried": [], "stale": [], "next_group": stream.next_group})
    batches = scheduler.tasks(_Batches(stream.batches)).stream()
    if stream.resumed:
        scheduler._resume_groups(stream.resumed)
    return batches


async def _call(scheduler: RolloutScheduler, call: RecordedCall) -> ReplayedCall:
    """Make a recorded call: what it returned, or what it raised."""
    try:
        packed = await scheduler.step(_batch(call.batch), None, call.updates)
    except Exception as error:
        return ReplayedCall(None, scheduler.last_events, {}, _describe(error), trio.current_time())
    return ReplayedCall(
        scheduler.last_record,
        scheduler.last_events,
        array_digests(packed),
        None,
        trio.current_time(),
    )


async def _drive(
    trace: Trace,
    scheduler: RolloutScheduler,
    source: ReplaySource,
    calls: list[ReplayedCall],
    streams: list[Iterator[Batch]],
    starts: Mapping[int, float],
    progress: Callable[[int, int, float], None] | None,
) -> None:
    """The replay's trainer: open streams, read them, hand batches over, as recorded; a cut
    trace's replay stops after its last call.

    Args:
        streams: the streams opened so far (before the scheduler ran).
        starts: step -> when a thread trace's call reached the scheduler, where that is
            before its hand-over (its push's start, see `_thread_pushes`).
        progress: called after each call (see `replay`).
    """
    read = 0

    async def open_streams(through: int) -> None:
        nonlocal read
        while len(streams) <= through:
            stream = trace.streams[len(streams)]
            if stream.time is not None:
                await source.sleep_until(stream.time)
            streams.append(_open(scheduler, stream))
            read = 0

    for call in trace.calls:
        if call.stream is not None:
            await open_streams(call.stream)
            for _ in range(call.read - read):
                next(streams[call.stream])
            read = max(read, call.read)
        # A call from the trainer's thread that raised has no time: hand it over as soon as
        # the replay gets to it, but not before the recording began.
        at = starts.get(call.step, call.handed_over)
        await source.sleep_until(trace.start if at is None else at)
        calls.append(await _call(scheduler, call))
        if progress is not None:
            progress(len(calls), len(trace.calls), trio.current_time() - trace.start)
    if trace.cut is not None:
        return
    await open_streams(len(trace.streams) - 1)
    await source.sleep_until(trace.end)
