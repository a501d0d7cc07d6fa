"""The RolloutScheduler's own cost per rollout, beside trio's floor for the same work.

A zero-latency source returns a valid COMPLETED session with one tiny call (2 prompt and 2
completion tokens) at once, so every second spent is the scheduler's. On trio's real clock the
benchmark drives `async with scheduler: await scheduler.step(...)` with steps of a size's
rollouts (`--groups` per task), as many as make about `--rollouts` timed rollouts (ahead=1, the
first step a warm-up that is not timed), and prints admitted rollouts per second. In that
loop, per rollout: the pure core's submission and admission, one trio task in its own cancel
scope inside the batch's nursery, the source call, the session's stamp and check, the finish
event and its ordering at the instant; per step: the hand-over, the delivery through the
memory channel, `pack` into [rows, 64] rows, `session_metrics`, and a rescoring that returns the
behaviour log-probs as they are (no model).

The floor, measured in the same process at the same size: per rollout one bare trio task
started in a nursery, inside a cancel scope, that sends one item through a memory channel, which
the benchmark receives. The floor's own rate falls as a step grows, so each size (32, 128, 512
and 1,024 rollouts a step by default) is judged against the floor at that size. At each size the
async loop, the synchronous facade (`scheduler(batch, variables, updates)` from the trainer's
thread with the trio side in the scheduler's own thread, as a real trainer calls it) and the
floor are measured in turn, `--best-of` times each keeping its best rate; a run's ratios are
scheduler / floor, printed min/median/max over `--runs` runs (target >= 0.5 at every size,
through both facades). Ratios are given by wall clock (what a trainer waits) and by this
process's CPU time (what the work costs, which the load of a shared machine disturbs far less
than the wall clock). The old figure was the async ratio at 1,024 rollouts a step only.

A second table says where a rollout's time goes. At a ratio of 0.5 the scheduler has twice the
floor's time a rollout, so all it does beyond the floor's task must fit in the floor's time once.
The work it must do for every rollout is timed alone, part by part, on the same sessions: the
source building its session, the scheduler's stamp and contract check, the pure admission core
(submission, admission, the event log), and `pack` + `session_metrics`. Their sum beside the
floor shows whether the target is within reach of this work at all; the rest of the async
loop's time is the trio side's plumbing (the tasks' cancel scopes beyond the floor's, events,
commands, delivery). Parts timed alone can cost more than inside the loop (a collection of the
garbage they leave falls on them alone), so at large sizes the rest can come out below zero.
`--profile` runs the async loop at the first size once more under cProfile.

    python benchmarks/scheduler_overhead.py             # 32, 128, 512, 1024 rollouts a step
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
import statistics
import time
from collections.abc import Iterator

import attrs
import numpy as np
import trio

from dew.data import ArrayDataset, Task
from dew.objectives.rl import _admission as core
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import (
    Call,
    Label,
    Session,
    Status,
    check_session,
    pack,
    session_metrics,
)
from dew.simulate import BehaviorObjective

WIDTH = 64
# One session's chain is 4 tokens: a row of WIDTH holds WIDTH // 4 of them.
TOKENS = 4
SIZES = (32, 128, 512, 1024)


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


async def _async_rate(tasks: int, groups: int, steps: int) -> tuple[int, float, float]:
    """Rollouts admitted through `await scheduler.step(...)` after the first step, and the wall
    and CPU seconds they took."""
    scheduler, stream = _scheduler(tasks, groups, steps)
    start, cpu, admitted = time.perf_counter(), time.process_time(), 0
    async with scheduler:
        for updates, batch in _steps(stream, steps):
            if updates == 1:
                start, cpu, admitted = time.perf_counter(), time.process_time(), 0
            await scheduler.step(batch, None, updates)
            admitted += scheduler.last_record.groups * groups
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return admitted, wall, cpu


def _thread_rate(tasks: int, groups: int, steps: int) -> tuple[int, float, float]:
    """The same through `scheduler(...)` from this thread, the trio side in the scheduler's
    (CPU time counts both threads)."""
    scheduler, stream = _scheduler(tasks, groups, steps)
    start, cpu, admitted = time.perf_counter(), time.process_time(), 0
    try:
        for updates, batch in _steps(stream, steps):
            if updates == 1:
                start, cpu, admitted = time.perf_counter(), time.process_time(), 0
            scheduler(batch, None, updates)
            admitted += scheduler.last_record.groups * groups
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        scheduler.close()
    return admitted, wall, cpu


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


def _parts_seconds(tasks: int, groups: int, steps: int) -> dict[str, float]:
    """Seconds per rollout of the work the scheduler must do for each, each part timed alone.

    - source: the benchmark's source building its Call and Session;
    - check: the scheduler's stamp and contract check of the session;
    - admission: the pure core's submission and admission (`core.run` over a step's hand-over,
      then its rollouts finishing), as the loop feeds it with ahead=1;
    - pack+metrics: `pack` and `session_metrics` over a step's groups.
    """
    size = tasks * groups
    labels = [Label(t, s, 0) for t in range(tasks) for s in range(groups)]
    gc.collect()  # as before each loop's measurement
    start = time.perf_counter()
    for _ in range(steps):
        sessions = [_session(label, 0) for label in labels]
    source = time.perf_counter() - start
    task = Task("t")
    start = time.perf_counter()
    for _ in range(steps):
        for session, label in zip(sessions, labels, strict=True):
            check_session(session.stamped(task, label, 0.0, 0.0))
    check = time.perf_counter() - start
    batches = [tuple(Task(f"{b}.{t}") for t in range(tasks)) for b in range(steps + 1)]
    state, admission = core.initial(core.Config(groups=groups, max_lag=1)), 0.0
    for step in range(steps):
        ahead = tuple((b, batches[b]) for b in (step, step + 1))
        start = time.perf_counter()
        state, commands = core.run(state, [core.HandedOver(0.0, step, step, step, True, ahead)])
        admission += time.perf_counter() - start
        # The sessions are the source's, timed above.
        finished = [
            core.Finished(0.0, c.label, _session(c.label, c.version))
            for c in commands
            if isinstance(c, core.Submit)
        ]
        start = time.perf_counter()
        state, commands = core.run(state, finished)
        admission += time.perf_counter() - start
    figures = {"source": source, "check": check, "admission": admission}
    figures["pack+metrics"] = _trainer_side_seconds(tasks, groups, steps) * steps * size
    return {name: seconds / (steps * size) for name, seconds in figures.items()}


async def _floor_rate(rollouts: int, steps: int) -> tuple[int, float, float]:
    """The floor's rollouts, a bare task, cancel scope and channel send each, and the wall and
    CPU seconds they took."""
    send, receive = trio.open_memory_channel(math.inf)

    async def rollout(index: int) -> None:
        with trio.CancelScope():
            await send.send(index)

    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        async with trio.open_nursery() as nursery:
            for index in range(rollouts):
                nursery.start_soon(rollout, index)
        for _ in range(rollouts):
            await receive.receive()
    return rollouts * steps, time.perf_counter() - start, time.process_time() - cpu


def _timed(run, *args) -> tuple[float, float]:
    """(rollouts per wall second, rollouts per CPU second of this process) of one measurement.

    `run` returns (rollouts, wall seconds, CPU seconds) of its timed part.
    """
    gc.collect()  # what the last measurement left behind would tax this one
    rollouts, wall, cpu = run(*args)
    return rollouts / wall, rollouts / cpu


def _measure(size: int, groups: int, steps: int, best_of: int) -> dict[str, tuple[float, float]]:
    """Each loop's best wall and CPU rates at one size, measured in turn `best_of` times."""
    tasks = size // groups
    best: dict[str, tuple[float, float]] = {}
    for _ in range(best_of):
        for name, rate in (
            ("async", _timed(trio.run, _async_rate, tasks, groups, steps)),
            ("thread", _timed(_thread_rate, tasks, groups, steps)),
            ("floor", _timed(trio.run, _floor_rate, size, steps - 1)),
        ):
            old = best.get(name, (0.0, 0.0))
            best[name] = (max(old[0], rate[0]), max(old[1], rate[1]))
    return best


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}/{statistics.median(values):.3f}/{max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(SIZES), help="rollouts a step (32 ... 1024)"
    )
    parser.add_argument("--groups", type=int, default=4, help="rollouts per task (default 4)")
    parser.add_argument(
        "--rollouts", type=int, default=8192, help="timed rollouts per measurement (8192)"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs to report (default 3)")
    parser.add_argument("--best-of", type=int, default=2, help="measurements per run (2)")
    parser.add_argument("--profile", action="store_true", help="profile the scheduler loop")
    parser.add_argument("--smoke", action="store_true", help="a tiny, fast run")
    args = parser.parse_args()
    for name in ("groups", "rollouts", "runs", "best_of"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if args.smoke:
        args.sizes, args.rollouts, args.runs, args.best_of = [32, 128], 512, 1, 1
    for size in args.sizes:
        if size < args.groups or size % args.groups:
            parser.error(f"--sizes {size}: a size must be a multiple of --groups {args.groups}")

    print(
        f"scheduler overhead: zero-latency source, {args.groups} rollouts a task, about "
        f"{args.rollouts} timed rollouts per measurement, {args.runs} runs of best of "
        f"{args.best_of}, real clock; ratios min/median/max over the runs (target >= 0.5)"
    )
    print(
        "  rollouts/step | rollouts/s  async   thread    floor | wall ratio async  thread"
        "      | CPU ratio async  thread"
    )
    verdicts, old, budgets = [], None, []
    for size in args.sizes:
        steps = 1 + max(4, args.rollouts // size)
        runs = [_measure(size, args.groups, steps, args.best_of) for _ in range(args.runs)]
        ratio = {
            (name, clock): [run[name][clock] / run["floor"][clock] for run in runs]
            for name in ("async", "thread")
            for clock in (0, 1)
        }
        median = {
            name: statistics.median(run[name][0] for run in runs)
            for name in ("async", "thread", "floor")
        }
        print(
            f"  {size:13d} | {median['async']:14,.0f} {median['thread']:8,.0f} "
            f"{median['floor']:8,.0f} | {_spread(ratio['async', 0]):>17} "
            f"{_spread(ratio['thread', 0]):>17} | {_spread(ratio['async', 1]):>17} "
            f"{_spread(ratio['thread', 1]):>17}"
        )
        parts = [_parts_seconds(size // args.groups, args.groups, steps - 1) for _ in runs]
        least = {name: min(p[name] for p in parts) for name in parts[0]}
        budgets.append((size, 1 / median["floor"], 1 / median["async"], least))
        verdicts.append(min(min(ratio["async", 0]), min(ratio["thread", 0])) >= 0.5)
        if size == 1024:
            old = _spread(ratio["async", 0])
    print(
        "fair: each size against the floor at that size, both facades (thread: scheduler(...) "
        f"from the trainer's thread, the trainer's path): target met at "
        f"{sum(verdicts)} of {len(verdicts)} sizes (wall clock, every run)"
    )
    if old is not None:
        print(f"old:  async at 1024 rollouts a step only (the floor's slowest size): {old}")
    print(
        "\nwhere a rollout's time goes, us (medians; each part timed alone, its least over the "
        "runs): at 0.5 the scheduler has twice the floor's time, so its own work may take the "
        "floor's time once"
    )
    names = list(budgets[0][3])
    print(
        "  rollouts/step |  floor | " + "  ".join(f"{n:>12}" for n in names) + " |  parts"
        " | async loop  rest (trio plumbing, events)"
    )
    for size, floor, loop, least in budgets:
        parts = sum(least.values())
        print(
            f"  {size:13d} | {1e6 * floor:6.1f} | "
            + "  ".join(f"{1e6 * least[n]:12.1f}" for n in names)
            + f" | {1e6 * parts:6.1f} | {1e6 * loop:10.1f}  {1e6 * (loop - floor - parts):5.1f}"
        )
    if args.profile:
        profile = cProfile.Profile()
        size = args.sizes[0]
        profile.runcall(
            trio.run, _async_rate, size // args.groups, args.groups, 1 + args.rollouts // size
        )
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
