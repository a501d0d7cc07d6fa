"""A hostile compliance audit of RolloutScheduler against its documented contract
(docs/scheduler.md and the module's docstrings), sentence by sentence: each test here either
pins a defect the audit found (and failed without its fix) or pins a sentence of the page no
other test pinned, named in its docstring.

Found and fixed:
- an `admit` given as a numpy integer above the task batch size was not refused (the check
  looked for a Python int), so it silently cut nothing;
- a `tasks` function that returns no sequence of tasks (None, a string, a list holding
  something else) was refused without saying what it returned, or not by name at all;
- a batch read ahead whose tasks are refused was refused at an earlier batch's call without
  saying which batch it was about; the refusal now names its stream position.
"""

from __future__ import annotations

import collections
import copy
import pickle

import numpy as np
import pytest
import trio

from _scripted import OBJECTIVE, PARAMS, ROWS, WIDTH, Engine, Plan, Scripted, dataset
from dew.data import Task
from dew.objectives.rl.scheduler import RolloutScheduler, task_ids


def scheduler(source, engine, **kwargs) -> RolloutScheduler:
    kwargs.setdefault("groups", 2)
    sched = RolloutScheduler(OBJECTIVE, source, engine, width=WIDTH, rows=ROWS, **kwargs)
    sched.long_wait = None
    return sched


async def train(sched: RolloutScheduler, data, steps: int, *, step_time: float = 1.0):
    """A fake trainer whose prefetch reads `ahead` batches beyond the one it hands over, making
    one update per call; returns the records."""
    stream = sched.tasks(data).stream(0)
    queue = collections.deque(next(stream) for _ in range(sched.ahead + 1))
    records = []
    for updates in range(steps):
        await sched.step(queue.popleft(), PARAMS, updates)
        records.append(sched.last_record)
        queue.extend(b for b in [next(stream, None)] if b is not None)
        await trio.sleep(step_time)
    return records


# The constructor and its arguments ------------------------------------------------------------


async def test_a_numpy_integer_admit_beyond_the_task_batch_is_refused_as_an_int_is(
    autojump_clock,
):
    """`admit` below the task batch size cuts; one above it can cut nothing and is refused at
    the first batch. Given as a numpy integer (as a config read with numpy gives it) it was
    taken, and silently cut nothing; it is now an int like any other."""
    engine = Engine()
    async with scheduler(Scripted(engine), engine, admit=np.int64(3), ahead=0, max_lag=0) as s:
        assert type(s.admit) is int and type(s.config.admit) is int
        with pytest.raises(ValueError, match=r"admit must be within 1\.\.2"):
            await train(s, dataset(size=2), 1)


@pytest.mark.parametrize(
    "made, named",
    [
        (lambda batch: None, "got None"),
        (lambda batch: "0 1", "got '0 1'"),
        (lambda batch: [Task("0"), "1"], r"got an element '1' \(str\)"),
    ],
)
async def test_a_tasks_function_that_returns_no_sequence_of_tasks_is_refused_by_name(
    autojump_clock, made, named
):
    """'tasks turns one registered batch into its tasks': one that returns something else is
    refused naming `tasks` and what it returned (before, None gave "'NoneType' object is not
    iterable", naming neither, and a wrong element went unnamed)."""
    engine = Engine()
    async with scheduler(Scripted(engine), engine, tasks=made, ahead=0, max_lag=0) as s:
        with pytest.raises(ValueError, match=f"tasks must turn a batch into .*{named}"):
            await train(s, dataset(size=2), 1)


def refuse_task_3(batch) -> list[Task]:
    if 3 in batch["task_id"]:
        raise ValueError("task 3 has no prompt")
    return task_ids(batch)


async def test_a_batch_read_ahead_whose_tasks_are_refused_is_named_by_its_stream_position(
    autojump_clock,
):
    """'when the trainer hands over batch i the scheduler submits batches i + 1 ... i + ahead':
    so a batch whose tasks are refused is refused at the call of an earlier one, whose own
    tasks are fine. The refusal names the batch it is about by its stream position (before, it
    read as if the batch handed over were at fault)."""
    engine = Engine()
    async with scheduler(Scripted(engine), engine, tasks=refuse_task_3) as sched:
        stream = sched.tasks(dataset(batches=3, size=2)).stream(0)
        first, _ = next(stream), next(stream)
        with pytest.raises(
            ValueError, match=r"^the batch at position 1 of the tasks\(\) stream: task 3 has no"
        ):
            await sched.step(first, PARAMS, 0)


# Staleness arithmetic ---------------------------------------------------------------------------


@pytest.mark.parametrize("ahead, sync_every", [(0, 3), (1, 2), (2, 1), (2, 2)])
async def test_a_first_submission_is_at_most_ahead_plus_sync_every_minus_1_stale(
    autojump_clock, ahead, sync_every
):
    """'a first submission is at most ahead + sync_every - 1 updates stale at consumption, and
    construction refuses a max_lag below that': at max_lag exactly that bound, rollouts that
    run until just before their batch's call reach the bound (so a smaller max_lag would throw
    them away) and none is ever stale."""
    bound = ahead + sync_every - 1
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=ahead + 0.5))
    async with scheduler(source, engine, ahead=ahead, sync_every=sync_every, max_lag=bound) as s:
        records = await train(s, dataset(batches=12, size=2), 8)
    assert max(r.lag for r in records) == bound
    assert sum(r.resubmitted["stale"] for r in records) == 0
    assert all(r.groups == 2 for r in records)
    with pytest.raises(ValueError, match="max_lag"):
        scheduler(source, engine, ahead=ahead, sync_every=sync_every, max_lag=bound - 1)


# A broken source ------------------------------------------------------------------------------


class Broken(Exception):
    pass


class SlowToStop:
    """A source whose rollouts of task "1", sample 0, raise after 1 s, and whose other rollouts
    run 30 s but, cancelled, take 2 s to tear their environment down (shielded, as a cleanup
    that must finish is)."""

    def __init__(self):
        self.stopped: list[float] = []

    async def run(self, task: Task, label):
        if task.name == "1" and label.sample == 0:
            await trio.sleep(1.0)
            raise Broken("environment exploded")
        try:
            await trio.sleep(30.0)
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(2.0)
                self.stopped.append(trio.current_time())


async def test_a_source_that_raises_reaches_the_trainer_once_its_batch_has_stopped(
    autojump_clock,
):
    """'A source that raises instead of returning a status is broken; the exception propagates
    after the batch's work is cancelled': after it has stopped, not when it is asked to stop,
    so the trainer never goes on while the broken batch still runs (a prompt cleanup, as the
    other tests' sources have, cannot tell the two apart)."""
    engine = Engine()
    source = SlowToStop()
    async with scheduler(source, engine, ahead=0, max_lag=0) as sched:
        stream = sched.tasks(dataset(batches=1, size=2)).stream(0)
        with pytest.raises(Broken, match="environment exploded"):
            await sched.step(next(stream), PARAMS, 0)
        assert trio.current_time() == 3.0
        assert source.stopped == [3.0, 3.0, 3.0]  # the batch's three other rollouts


# task_ids ---------------------------------------------------------------------------------------


def test_task_ids_names_each_row_by_its_decimal_id_whatever_its_integer_type():
    """'One task per integer task_id row, named by its decimal id': any integer dtype, and the
    id as written in decimal (no `np.int64(7)`, no `7.0`); a bool column is no integer ids."""
    for dtype in (np.int8, np.uint16, np.int32, np.uint64):
        assert [t.name for t in task_ids({"task_id": np.array([7, 0], dtype)})] == ["7", "0"]
    assert [t.name for t in task_ids({"task_id": [2**63 + 5]})] == [str(2**63 + 5)]
    with pytest.raises(ValueError, match="task_id must be a 1-D integer array, got bool"):
        task_ids({"task_id": np.array([True, False])})


# close ------------------------------------------------------------------------------------------


class ClosableSource(Scripted):
    """A scripted source that says whether anything closed it."""

    def __init__(self, engine: Engine):
        super().__init__(engine, lambda task, label: Plan(duration=50.0))
        self.closed = False

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


async def test_close_cancels_what_is_in_flight_and_leaves_the_source_to_its_caller(
    autojump_clock,
):
    """close(): 'Cancel every rollout in flight; the source belongs to the caller': the
    rollouts are cancelled (reason closed), the source is neither closed nor unusable."""
    engine = Engine()
    source = ClosableSource(engine)
    sched = scheduler(source, engine, ahead=1)
    answers = []

    async def call(batch):
        try:
            await sched.step(batch, PARAMS, 0)
        except RuntimeError as error:
            answers.append(str(error))

    async with sched:
        stream = sched.tasks(dataset(batches=3, size=1)).stream(0)
        first, _ = next(stream), next(stream)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, first)
            await trio.sleep(1.0)
            sched.close()
    assert answers == ["the scheduler is closed: close() came while the trainer waited"]
    assert {(label.group, reason) for _, label, reason in source.cancelled} == {
        (0, "closed"),
        (1, "closed"),
    }
    assert len(source.cancelled) == 4 and not source.closed
    session = await ClosableSource.run(source, Task("9"), source.started[0][2])
    assert session.reward == 1.0


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy, pickle.dumps])
def test_a_scheduler_refuses_to_be_copied_or_pickled_by_name(duplicate):
    """A copy made without __init__ asked its missing workings for every attribute, through
    `__getattr__`, without end (RecursionError); a scheduler owns what it has in flight."""
    engine = Engine()
    sched = scheduler(Scripted(engine), engine)
    with pytest.raises(TypeError, match="a RolloutScheduler cannot be copied or pickled"):
        duplicate(sched)
