"""The RolloutScheduler's own cost per rollout, beside trio's floor for the same work.

A zero-latency source returns a valid COMPLETED session with one tiny call (2 prompt and 2
completion tokens) at once, so every second spent is the scheduler's. On trio's real clock the
benchmark drives `async with scheduler: await scheduler.step(...)` for `--steps` steps of
`--tasks` tasks x `--groups` rollouts (ahead=1, the first step a warm-up that is not timed) and
prints admitted rollouts per second. In that loop, per rollout: the pure core's submission and
admission, one trio task in its own cancel scope inside the batch's nursery, the source call,
the session's stamp and check, the finish event and its ordering at the instant; per step: the
hand-over, the delivery through the memory channel, `pack` into [rows, 64] rows,
`session_metrics`, and a rescoring that returns the behaviour log-probs as they are (no model).

The floor, measured in the same run: per rollout one bare trio task started in a nursery, inside
a cancel scope, that sends one item through a memory channel, which the benchmark receives.
Scheduler and floor are measured in turn `--repeats` times and each keeps its best rate, which
the load of a shared machine disturbs least. It prints both rates and their ratio (target >=
0.5), and splits the scheduler's time per rollout into `pack` + `session_metrics` (timed alone
on the same groups, best of the repeats too) and the rest. It measures the same loop through the
synchronous facade too, `scheduler(batch, variables, updates)` from the trainer's thread with
the trio side in the scheduler's own thread, as a real trainer calls it. `--profile` runs the
async loop once more under cProfile and prints where its time goes.

    python benchmarks/scheduler_overhead.py             # 256 tasks x 4, 10 steps, best of 5
    python benchmarks/scheduler_overhead.py --profile   # and where the time goes
    python benchmarks/scheduler_overhead.py --smoke     # a tiny, fast run
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import math
import pstats
import time
from collections.abc import Iterator

import attrs
import numpy as np
import trio

from dew.data import ArrayDataset, Task
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Call, Label, Session, Status, pack, session_metrics
from dew.simulate import BehaviorObjective

WIDTH = 64
# One session's chain is 4 tokens: a row of WIDTH holds WIDTH // 4 of them.
TOKENS = 4


# Every session's call shares these read-only arrays, as a prompt set's rollouts share their
# prompt: the source's own cost is kept to the Call and Session it must build.
_PROMPT = np.array([1, 2], np.int32)
_COMPLETION = np.array([3, 4], np.int32)
_LOGPROBS = np.array([-0.5, -0.25], np.float32)
for _array in (_PROMPT, _COMPLETION, _LOGPROBS):
    _array.flags.writeable = False


def _session(label: Label, version: int) -> Session:
    """A COMPLETED session of one call of 2 prompt and 2 completion tokens, served at version."""
    call = Call(prompt=_PROMPT, completion=_COMPLETION, logprobs=_LOGPROBS, version=version)
    return Session(Status.COMPLETED, (call,), reward=float(label.sample))


@attrs.define(eq=False)
class _Instant:
    """A source and publisher in one: each rollout is one tiny call under the served version."""

    version: int = 0

    def load(self, variables, version: int) -> None:
        self.version = version

    async def run(self, task: Task, label: Label) -> Session:
        return _session(label, self.version)


def _scheduler(tasks: int, groups: int, steps: int) -> tuple[RolloutScheduler, Iterator]:
    """A scheduler over the instant source, and its registering stream of steps + 1 batches."""
    instant = _Instant()
    scheduler = RolloutScheduler(
        BehaviorObjective(),
        instant,
        instant,
        width=WIDTH,
        rows=math.ceil(tasks * groups * TOKENS / WIDTH),
        groups=groups,
        ahead=1,
        max_lag=1,
    )
    dataset = ArrayDataset({"task_id": np.arange((steps + 1) * tasks)}, batch_size=tasks)
    return scheduler, scheduler.tasks(dataset).stream(0)


def _steps(stream: Iterator, steps: int) -> Iterator[tuple[int, dict]]:
    """(updates, batch) per step, the stream read one batch ahead as a trainer's prefetch does
    (the scheduler submits only what the stream registered)."""
    prefetched = collections.deque([next(stream)])
    for updates in range(steps):
        prefetched.append(next(stream))
        yield updates, prefetched.popleft()


async def _async_rate(tasks: int, groups: int, steps: int) -> float:
    """Admitted rollouts per second through `await scheduler.step(...)`, after the first step."""
    scheduler, stream = _scheduler(tasks, groups, steps)
    start, admitted = time.perf_counter(), 0
    async with scheduler:
        for updates, batch in _steps(stream, steps):
            if updates == 1:
                start, admitted = time.perf_counter(), 0
            await scheduler.step(batch, None, updates)
            admitted += scheduler.last_record.groups * groups
        seconds = time.perf_counter() - start
    return admitted / seconds


def _thread_rate(tasks: int, groups: int, steps: int) -> float:
    """The same through `scheduler(...)` from this thread, the trio side in the scheduler's."""
    scheduler, stream = _scheduler(tasks, groups, steps)
    start, admitted = time.perf_counter(), 0
    try:
        for updates, batch in _steps(stream, steps):
            if updates == 1:
                start, admitted = time.perf_counter(), 0
            scheduler(batch, None, updates)
            admitted += scheduler.last_record.groups * groups
        seconds = time.perf_counter() - start
    finally:
        scheduler.close()
    return admitted / seconds


def _trainer_side_seconds(tasks: int, groups: int, steps: int) -> float:
    """Seconds per rollout that `pack` and `session_metrics` take over one step's groups.

    The same work the scheduler does on the trainer's side of each step, on the same sessions,
    timed alone, so the scheduler's rate can be split into its trio side and its trainer side.
    """
    groups_of = [[_session(Label(t, s, 0), 0) for s in range(groups)] for t in range(tasks)]
    sessions = [session for group in groups_of for session in group]
    rows = math.ceil(tasks * groups * TOKENS / WIDTH)
    start = time.perf_counter()
    for _ in range(steps):
        session_metrics(sessions, pack(groups_of, width=WIDTH, rows=rows), version=0)
    return (time.perf_counter() - start) / (steps * tasks * groups)


async def _floor_rate(rollouts: int, steps: int) -> float:
    """Rollouts per second of the floor: a bare task, cancel scope and channel send each."""
    send, receive = trio.open_memory_channel(math.inf)

    async def rollout(index: int) -> None:
        with trio.CancelScope():
            await send.send(index)

    start = time.perf_counter()
    for _ in range(steps):
        async with trio.open_nursery() as nursery:
            for index in range(rollouts):
                nursery.start_soon(rollout, index)
        for _ in range(rollouts):
            await receive.receive()
    return rollouts * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=256, help="tasks per batch (default 256)")
    parser.add_argument("--groups", type=int, default=4, help="rollouts per task (default 4)")
    parser.add_argument("--steps", type=int, default=10, help="steps, the first untimed (10)")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many (default 5)")
    parser.add_argument("--profile", action="store_true", help="profile the scheduler loop")
    parser.add_argument("--smoke", action="store_true", help="a tiny, fast run")
    args = parser.parse_args()
    if args.smoke:
        args.tasks, args.steps, args.repeats = 16, 3, 1

    rollouts = args.tasks * args.groups
    scheduler = thread = floor = 0.0
    trainer_side = math.inf
    for _ in range(args.repeats):
        # Each run starts from a collected heap: what one leaves behind would tax the next.
        gc.collect()
        scheduler = max(scheduler, trio.run(_async_rate, args.tasks, args.groups, args.steps))
        gc.collect()
        thread = max(thread, _thread_rate(args.tasks, args.groups, args.steps))
        gc.collect()
        floor = max(floor, trio.run(_floor_rate, rollouts, args.steps - 1))
        gc.collect()
        trainer_side = min(
            trainer_side, _trainer_side_seconds(args.tasks, args.groups, args.steps - 1)
        )
    trio_side = 1 / (1 / scheduler - trainer_side)
    print(
        f"scheduler overhead: zero-latency source, {args.tasks} tasks x {args.groups} rollouts "
        f"per step, {args.steps - 1} timed steps, best of {args.repeats}, real clock"
    )
    print(f"  scheduler  {scheduler:>12,.0f} admitted rollouts/s (await scheduler.step)")
    print(f"  floor      {floor:>12,.0f} rollouts/s (task + cancel scope + channel send)")
    print(f"  ratio      {scheduler / floor:>12.3f} (target >= 0.5)")
    print(
        f"  split      {1e6 / scheduler:.0f} us per rollout, of which pack + session_metrics "
        f"{1e6 * trainer_side:.0f} us (timed alone on the same groups)"
    )
    print(f"  without    {trio_side:>12,.0f} rollouts/s, ratio {trio_side / floor:.3f}")
    print(
        f"  thread     {thread:>12,.0f} admitted rollouts/s (scheduler(...) from the trainer's "
        f"thread), ratio {thread / floor:.3f}"
    )
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(trio.run, _async_rate, args.tasks, args.groups, args.steps)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
