"""Playing a trace back: `ReplaySource` runs each rollout as the trace recorded it, on a clock
it keeps in step with the recording; `ReplayPublisher` takes pushes as they were timed, and
`NoRescoring` stands in for the objective. `replay` (`_replay`) drives a scheduler over them.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from dew._trio import exit_unwrapped
from dew.data import Task
from dew.objectives.rl.sessions import Label, Session, Status, note_progress
from dew.replay._divergence import ReplayNote
from dew.replay._format import RecordedSourceError
from dew.replay._recorded import Trace
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
