"""Replaying a trace: the source that plays rollouts back, the clock it keeps, `replay`."""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import math
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from dew import _gc
from dew._trio import exit_unwrapped
from dew.data import Batch, Task
from dew.objectives.rl.scheduler import MAX_IN_FLIGHT, RolloutScheduler
from dew.objectives.rl.sessions import Label, Session, Status, note_progress
from dew.replay._divergence import Divergence, ReplayedCall, ReplayNote, ReplayResult, _divergences
from dew.replay._format import (
    CONFIG,
    RecordedSourceError,
    TraceError,
    _describe,
    array_digests,
)
from dew.replay._recorded import RecordedCall, RecordedStream, Trace
from dew.replay._trace import read_trace

# Real seconds every task must stay blocked before the replay clock moves: any positive cushion
# lets the scheduler's own zero-cushion waits settle an instant first.
_SETTLE = 1e-9


class ReplayStalled(RuntimeError):
    """A replayed run waits on what the trace never ended: every task waits and nothing is due,
    or nothing but the scheduler's own timers until the recording's end plus its length.

    Args:
        time: the replay's clock when it stalled.
    """

    def __init__(self, time: float, why: str):
        super().__init__(f"at time {time!r} {why}: the replayed run waits on what never ends")
        self.time = time


class NoRescoring:
    """The objective replay gives the scheduler: every proximal log-prob is 0.

    A trace holds no weights to rescore with, and rescoring is not what replay checks; it costs
    nothing and compiles nothing. Replay compares every packed array but `proximal_logprobs`.
    """

    def packed_log_probs(self, variables: Any, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """float32[rows, width] zeros, the shape of `batch["tokens"]`."""
        return np.zeros(np.shape(batch["tokens"]), np.float32)


@attrs.define(eq=False)
class ReplayPublisher:
    """A Publisher for replay: it accepts every push and keeps them, as (time, version).

    Args:
        ends: when each recorded push ended: the k-th push lasts until the k-th of them, as a
            publisher's async push (`load_async`) did in the recorded run (an async trace's
            push lines; a thread trace's hand-overs, see `_thread_pushes`); empty, or where an
            end has passed, a push is instant.
        sleep_until: the replay's clock keeper (`ReplaySource.sleep_until`), which `ends` need.
    """

    ends: Sequence[float] = ()
    sleep_until: Callable[[float], Awaitable[None]] | None = None
    pushes: list[tuple[float, int]] = attrs.field(factory=list, init=False)

    def load(self, variables: Any, version: int) -> None:
        """Keep the push as (the clock's time, version); the weights go nowhere."""
        self.pushes.append((trio.current_time(), int(version)))

    async def load_async(self, variables: Any, version: int) -> None:
        """`load`, once the clock reaches the recorded end of this push where that is later
        (and without a checkpoint where it is not, as a synchronous push)."""
        index = len(self.pushes)
        if index < len(self.ends) and self.ends[index] > trio.current_time():
            await self.sleep_until(self.ends[index])
        self.load(variables, version)


class ReplaySource:
    """A SessionSource that plays a trace's rollouts back, on trio's MockClock, exactly.

    A rollout is found by (task name, label). Submitted when it was recorded (at its `submitted`
    event where a call's log holds one, else at its recorded start), it ends at its recorded
    end; submitted at another time, its recorded duration later. It returns its
    recorded session (calls and versions as recorded; the scheduler stamps it), raises what was
    recorded (as RecordedSourceError), or, recorded as cancelled, waits until cancelled. Use it
    as an async context manager: inside, it keeps trio's MockClock (which must run at rate 0),
    landing every jump exactly on the recorded times, which MockClock's own jumps can miss by an
    ulp.

    What the replayed run does that the recording did not is kept in `notes`: a rollout the
    trace never ran (it returns INFRA_ERROR at once), one recorded as cancelled still running
    after its recorded cancellation. A rollout a cut trace (`Trace.cut`) never saw end was still
    running when the recording stopped: it runs until cancelled.

    `settled`, when set (`replay` sets it to its scheduler's own check), says whether the
    scheduler has applied everything posted to it: the clock then moves as soon as that is so,
    rather than after a real-time cushion that costs a millisecond per instant.

    Args:
        trace: a Trace, or the path of one.

    Raises:
        ReplayStalled: (out of the `async with`) when every task waits and nothing is due, or
            nothing until the recording's end plus its length.
    """

    def __init__(self, trace: Trace | str | os.PathLike):
        self.trace = trace if isinstance(trace, Trace) else read_trace(trace, partial=True)
        self.notes: list[ReplayNote] = []
        # When the scheduler submitted each rollout, by its log: on the real clock the source's
        # own reading of its start comes a moment later.
        self._submitted = {
            e.label: e.time for c in self.trace.calls for e in c.events if e.kind == "submitted"
        }
        # Times the clock should land on: ends of sleeps, and recorded cancellations (the
        # scheduler's deadline that caused one lands on it); each with how many wait on it, and
        # all of them in a heap that may still hold times no one waits on any more (the clock
        # keeper drops those when they come to its top).
        self._targets: collections.Counter[float] = collections.Counter()
        self._target_heap: list[float] = []
        # The sleeps among them: one event per time, which the clock keeper sets when it lands
        # there (trio's own deadlines would cost each sleep a cancel scope and a place in trio's
        # deadline list), how many sleep on it, and the times in a heap as above.
        self._wakeups: dict[float, trio.Event] = {}
        self._sleeping: collections.Counter[float] = collections.Counter()
        self._wakeup_heap: list[float] = []
        self._cancellations: dict[Label, tuple[float, str]] = {}
        # A replay that still waits this long after the recording ended waits on nothing the
        # trace holds.
        self._horizon = self.trace.end + (self.trace.end - self.trace.start)
        self._stack: contextlib.AsyncExitStack | None = None
        self.settled: Callable[[], bool] | None = None

    async def __aenter__(self) -> ReplaySource:
        clock = trio.lowlevel.current_clock()
        if not isinstance(clock, trio.testing.MockClock) or clock.rate != 0:
            raise RuntimeError(
                f"ReplaySource needs trio.testing.MockClock at rate 0, got {clock!r}"
            )
        if self._stack is not None:
            raise RuntimeError("the ReplaySource is already in use")
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(self._keep_time, clock)
        stack.callback(nursery.cancel_scope.cancel)
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info) -> bool | None:
        stack, self._stack = self._stack, None
        # The clock keeper is the nursery's one child: a lone error is the body's own, or the
        # keeper's ReplayStalled, and reaches the caller as itself.
        return await exit_unwrapped(stack, *exc_info)

    async def sleep_until(self, time: float) -> None:
        """Sleep until `time` on the replay's clock, landing on it exactly."""
        if time <= trio.current_time():
            await trio.lowlevel.checkpoint()
            return
        wakeup = self._wakeups.get(time)
        if wakeup is None:
            wakeup = self._wakeups[time] = trio.Event()
            heapq.heappush(self._wakeup_heap, time)
        self._sleeping[time] += 1
        self._target(time)
        try:
            await wakeup.wait()
        finally:
            self._untarget(time)
            self._sleeping[time] -= 1
            if not self._sleeping[time]:
                del self._sleeping[time]
                self._wakeups.pop(time, None)

    def _target(self, time: float) -> None:
        if not self._targets[time]:
            heapq.heappush(self._target_heap, time)
        self._targets[time] += 1

    def _untarget(self, time: float) -> None:
        self._targets[time] -= 1
        if not self._targets[time]:
            del self._targets[time]

    def _next_target(self, now: float) -> float:
        """The earliest time after `now` that something waits on, or inf."""
        return _earliest_after(self._target_heap, self._targets, now)

    def _next_wakeup(self, now: float) -> float:
        """The earliest time after `now` that a sleep ends, or inf."""
        return _earliest_after(self._wakeup_heap, self._wakeups, now)

    async def run(self, task: Task, label: Label) -> Session:
        """Play back the recorded rollout of (task name, label)."""
        if self._stack is None:
            raise RuntimeError("run a ReplaySource inside `async with source:`")
        now = trio.current_time()
        recorded = self.trace.sessions.get(label)
        if recorded is None and self.trace.cut is not None:
            # A cut trace holds no end of a rollout still running when the recording stopped.
            await trio.sleep_forever()
        if recorded is None or recorded.task.name != task.name:
            self.notes.append(ReplayNote(now, task.name, label, "never ran", f"ran at {now!r}"))
            return Session(Status.INFRA_ERROR, error="replay: this rollout is not in the trace")
        shift = 0.0
        # Its run began at its submission, or where the scheduler held it queued for a slot
        # (align_starts), when it let it start.
        began = recorded.started
        if began is None:
            began = self._submitted.get(label, recorded.submitted)
        if now == began:
            end = recorded.ended
        else:
            began = recorded.submitted if recorded.started is None else recorded.started
            shift = now - began
            end = now + (recorded.ended - began)
        if recorded.first_call is not None:
            # Its engine said when its first call started: say it alike, for the scheduler
            # counts a running rollout's lag from it.
            time, version = recorded.first_call
            await self.sleep_until(time if not shift else now + (time - began))
            note_progress(version=version)
        if recorded.outcome == "cancelled":
            # Returns only by trio.Cancelled.
            await self._until_cancelled(label, task.name, end)
        if end > now:
            await self.sleep_until(end)
        if recorded.outcome == "returned":
            return recorded.session
        raise RecordedSourceError(recorded.error)

    async def _until_cancelled(self, label: Label, task: str, time: float) -> None:
        self._cancellations[label] = (time, task)
        self._target(time)
        try:
            await trio.sleep_forever()
        finally:
            self._cancellations.pop(label, None)
            self._untarget(time)

    async def _settle(self) -> None:
        """Wait until every task waits and the scheduler has applied what was posted to it.

        Without `settled`, a real-time cushion orders this wait after the scheduler's own
        zero-cushion one; but trio sleeps at least a millisecond for any positive cushion, a
        millisecond of real time per instant replayed, most of a replay's time. With it, this
        wait wakes beside the scheduler's and waits again until the scheduler has nothing left
        to apply and no task can run.
        """
        if self.settled is None:
            await trio.testing.wait_all_tasks_blocked(_SETTLE)
            return
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if self.settled() and trio.lowlevel.current_statistics().tasks_runnable == 0:
                return

    async def _keep_time(self, clock: trio.testing.MockClock, task_status=trio.TASK_STATUS_IGNORED):
        """Move the clock whenever every task waits: onto the next recorded time if that comes
        before the next thing due (a trio deadline, or the end of a replayed sleep) or is it (to
        the ulp), waking the sleeps that end there, else by the deadline's distance as
        MockClock would."""
        task_status.started()
        while True:
            await self._settle()
            now = trio.current_time()
            for label, (time, task) in list(self._cancellations.items()):
                if time <= now:
                    self.notes.append(
                        ReplayNote(time, task, label, f"cancelled at {time!r}", "still running")
                    )
                    del self._cancellations[label]
            distance = trio.lowlevel.current_statistics().seconds_to_next_deadline
            deadline = now + distance
            due = min(deadline, self._next_wakeup(now))
            if due == math.inf:
                raise ReplayStalled(now, "every task waits and nothing is due")
            target = self._next_target(now)
            # A recorded time the clock would pass is visited: a deadline within an ulp or so
            # of it lands on it, and a recorded cancellation before the next deadline is
            # checked there.
            visit = math.isfinite(target) and (
                target < due or abs(target - due) <= 4 * math.ulp(target)
            )
            if min(target, due) > self._horizon:
                # Only the scheduler's own timers are left, e.g. its long-wait log's doubling.
                raise ReplayStalled(
                    now,
                    f"nothing is due before {self._horizon!r}, the recording's end plus its length",
                )
            if visit:
                _jump_to(clock, target)
                wakeup = self._wakeups.pop(target, None)
                if wakeup is not None:
                    wakeup.set()
            else:
                clock.jump(distance)


def _earliest_after(heap: list[float], live: Mapping[float, object], now: float) -> float:
    """The earliest time in `heap` after `now` that `live` still holds, or inf; the others are
    dropped from the heap's top on the way (the clock never goes back, so a time at or before
    `now` is never the answer again)."""
    while heap and (heap[0] <= now or heap[0] not in live):
        heapq.heappop(heap)
    return heap[0] if heap else math.inf


def _jump_to(clock: trio.testing.MockClock, target: float) -> None:
    """Jump a rate-0 MockClock from below `target` so that it reads exactly `target`.

    From a time within [target / 2, target] both the difference and the sum are exact
    (Sterbenz); from further below, base + (target - base) can round past target, or no jump at
    all reads exactly target, so the clock first steps to three quarters of the way, short of
    every deadline.
    """
    if clock.current_time() < target / 2:
        clock.jump(0.75 * target - clock.current_time())
    clock.jump(target - clock.current_time())


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
