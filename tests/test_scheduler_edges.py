"""RolloutScheduler's trio shell at its edges, against the reference page and SPEC.

Each test pins one rule of `seed/scheduler.md` or SPEC.md in an interleaving the rest of the
suite does not reach: ties at one instant of trio's clock, cancellations of the trainer's own
call, `close()` from places other than the scheduler's own run, a source that raises while it is
being cancelled, and the synchronous facade's error paths. Mock-clock tests use pytest-trio's
`autojump_clock`; the determinism tests run the same script under several seeds of trio's
ready-task shuffling; the facade's tests use a real trainer thread on the real clock,
synchronised by events, never by sleeps.
"""

from __future__ import annotations

import math
import threading

import attrs
import jax
import numpy as np
import pytest
import trio
import trio.testing

from dew import models
from dew.data import ArrayDataset, Task
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Call, Label, Session, Status

CONFIG = models.TransformerConfig(vocab=32, d_model=16, heads=2, layers=1, d_ff=32, max_len=64)
PARAMS = models.init(jax.random.PRNGKey(0), CONFIG)
OBJECTIVE = GRPOObjective(models.model(CONFIG))
WIDTH, ROWS = 64, 8


class Engine:
    """A Publisher that serves whatever version was pushed last."""

    def __init__(self):
        self.version: int | None = None

    def load(self, variables, version):
        self.version = version


@attrs.frozen
class Plan:
    """How one scripted rollout goes: `duration` seconds on trio's clock, then `raises` or a
    COMPLETED session of one call."""

    duration: float = 1.0
    raises: BaseException | None = None
    raises_when_cancelled: BaseException | None = None


class Scripted:
    """A source whose every rollout follows `script(task, label) -> Plan`, and which remembers
    why each cancelled rollout was cancelled."""

    def __init__(self, engine: Engine, script=lambda task, label: Plan()):
        self.engine = engine
        self.script = script
        self.cancelled: list[tuple[Label, str | None]] = []

    async def run(self, task: Task, label: Label) -> Session:
        plan = self.script(task, label)
        version = self.engine.version
        try:
            await trio.sleep(plan.duration)
        except trio.Cancelled as cancelled:
            self.cancelled.append((label, cancelled.reason))
            if plan.raises_when_cancelled is not None:
                raise plan.raises_when_cancelled from None
            raise
        if plan.raises is not None:
            raise plan.raises
        call = Call(
            np.array([1, 2], np.int32),
            np.full(2, 5 + label.sample, np.int32),
            np.full(2, -0.5, np.float32),
            version,
        )
        return Session(Status.COMPLETED, [call], reward=float(label.sample))


def dataset(batches: int, size: int) -> ArrayDataset:
    return ArrayDataset({"task_id": np.arange(batches * size)}, batch_size=size)


def scheduler(source, engine, **kwargs) -> RolloutScheduler:
    kwargs.setdefault("groups", 2)
    return RolloutScheduler(OBJECTIVE, source, engine, width=WIDTH, rows=ROWS, **kwargs)


def under_scheduling_seed(main, seed: int):
    """Run `main` on a mock autojump clock with trio's ready-task order shuffled by `seed`."""
    random_state = trio._core._run._r.getstate()
    trio._core._run._r.seed(seed)
    try:
        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        trio._core._run._r.setstate(random_state)


# Determinism: ties at one instant -----------------------------------------------------------------


def test_a_rollout_finishing_at_its_deadline_has_one_outcome_whatever_trios_order():
    """SPEC: everything observable is a function of seed, source and clock, never of the order
    in which trio runs ready tasks. A rollout that finishes exactly at submission + timeout
    posts Finished while the deadline watch posts TimedOut for the same label at the same time:
    the finish comes first, so it is admitted, whatever order trio posted them in."""

    async def main():
        engine = Engine()
        source = Scripted(
            engine, lambda task, label: Plan(duration=10.0 if label.attempt == 0 else 1)
        )
        async with scheduler(source, engine, ahead=0, max_lag=0, timeout=10.0) as sched:
            stream = sched.tasks(dataset(1, 2)).stream(0)
            await sched.step(next(stream), PARAMS, 0)
            assert sched.last_record.resubmitted["timeout"] == 0
            return sched.last_record.resubmitted["timeout"], [
                (e.kind, e.label, e.reason) for e in sched.last_events
            ]

    outcomes = {seed: under_scheduling_seed(main, seed) for seed in range(8)}
    timeouts = {seed: outcome[0] for seed, outcome in outcomes.items()}
    distinct = len(set(map(repr, outcomes.values())))
    assert distinct == 1, (
        f"timeouts per scheduling seed differ: {timeouts}; a finish at the deadline must be "
        "ordered against the deadline by a documented key"
    )


class Boom(Exception):
    pass


def test_the_error_that_reaches_the_trainer_does_not_depend_on_trios_order():
    """Two batches' sources raise at the same instant, and which batch's nursery exits first is
    trio's choice: the trainer sees the first error in the core's order (batch 0's rollout sorts
    first), the other is logged."""

    def script(task, label):
        if label.sample == 0:
            return Plan(duration=1.0, raises=Boom(f"task {task.name}"))
        return Plan(duration=100.0)

    async def main():
        engine = Engine()
        async with scheduler(Scripted(engine, script), engine, ahead=1, max_lag=1) as sched:
            stream = sched.tasks(dataset(4, 1)).stream(0)
            first, _ = next(stream), next(stream)
            with pytest.raises(Boom) as raised:
                await sched.step(first, PARAMS, 0)
            return str(raised.value)

    errors = {seed: under_scheduling_seed(main, seed) for seed in range(10)}
    assert set(errors.values()) == {"task 0"}, f"the trainer's error per scheduling seed: {errors}"


# The trainer's call cancelled --------------------------------------------------------------------


async def test_a_cancelled_step_does_not_hand_its_groups_to_the_next_call(autojump_clock):
    """A step cancelled while it waits (a trainer's watchdog) would leave its delivery to the
    next call, which would train those groups at later updates, beyond max_lag, while its own
    batch is never delivered. The next call refuses instead, naming the cancelled one."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=1.0))
    async with scheduler(source, engine, ahead=0, max_lag=0) as sched:
        stream = sched.tasks(dataset(3, 1)).stream(0)
        with trio.move_on_after(0.5):
            await sched.step(next(stream), PARAMS, 0)
        await trio.sleep(2.0)  # batch 0's groups are delivered to nobody
        with pytest.raises(RuntimeError, match="updates 0 was cancelled while it waited"):
            await sched.step(next(stream), PARAMS, 1)


# close() -----------------------------------------------------------------------------------------


async def test_close_inside_the_block_leaves_the_callers_own_code_running(autojump_clock):
    """close() cancels every rollout in flight, not the caller's own code in the block."""
    engine = Engine()
    reached = False
    async with scheduler(Scripted(engine), engine, ahead=0, max_lag=0) as sched:
        stream = sched.tasks(dataset(2, 1)).stream(0)
        await sched.step(next(stream), PARAMS, 0)
        sched.close()
        await trio.sleep(1.0)
        reached = True
    assert reached, "the caller's code after close() inside `async with` never ran"


async def test_close_from_another_thread_stops_an_async_scheduler(autojump_clock):
    """close() from a thread other than the trio run's (a watchdog, a notebook cell) cancels
    what runs in the caller's run, and leaving `async with` then does not wait forever."""
    engine = Engine()
    source = Scripted(
        engine, lambda task, label: Plan(duration=1.0 if task.name == "0" else math.inf)
    )
    with trio.CancelScope() as guard:
        async with scheduler(source, engine, ahead=1) as sched:
            stream = sched.tasks(dataset(3, 1)).stream(0)
            first, _ = next(stream), next(stream)
            await sched.step(first, PARAMS, 0)  # batch 1 now runs forever
            await trio.to_thread.run_sync(sched.close)
            guard.deadline = trio.current_time() + 1000.0
    assert not guard.cancelled_caught, "leaving `async with` hung after close() from a thread"
    assert {reason for _, reason in source.cancelled} == {"closed"}, source.cancelled


def test_status_after_the_run_ended_reports_no_clock_rather_than_raising():
    """status() is for any time and thread; once the run that drove the scheduler has returned,
    its clock reads NaN rather than raising."""
    engine = Engine()
    sched = scheduler(Scripted(engine), engine, ahead=0, max_lag=0)

    async def main():
        async with sched:
            stream = sched.tasks(dataset(1, 1)).stream(0)
            await sched.step(next(stream), PARAMS, 0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    try:
        status = sched.status()
    except RuntimeError as error:
        pytest.fail(f"status() after the run raised {error!r}")
    assert math.isnan(status.time)


# A source that raises while it is being cancelled ------------------------------------------------


async def test_a_source_that_raises_while_being_cancelled_is_not_silently_ignored(autojump_clock):
    """The page: a source that raises instead of returning a status is broken, and its exception
    propagates. One that raises its own error when cancelled (here as surplus), for a
    submission that has already ended, reaches the trainer at its next call."""
    engine = Engine()

    def script(task, label):
        if label.sample == 2:
            return Plan(duration=5.0, raises_when_cancelled=Boom("cleanup failed"))
        return Plan(duration=1.0)

    source = Scripted(engine, script)
    async with scheduler(source, engine, oversample=1, ahead=0, max_lag=0) as sched:
        stream = sched.tasks(dataset(2, 1)).stream(0)
        first = await sched.step(next(stream), PARAMS, 0)
        await trio.testing.wait_all_tasks_blocked()
        assert (Label(0, 2, 0), "surplus") in source.cancelled
        assert first["tokens"].shape == (ROWS, WIDTH)
        try:
            await sched.step(next(stream), PARAMS, 1)
        except Boom:
            return
        events = [(e.kind, e.label, e.reason) for e in sched.last_events]
    pytest.fail(f"the source's Boom vanished; the next call's event log: {events}")


# Bad input ---------------------------------------------------------------------------------------


def test_a_bool_timeout_is_refused_like_every_other_non_number():
    """Every invalid argument raises ValueError naming it: timeout=True is not a deadline."""
    with pytest.raises(ValueError, match="timeout"):
        scheduler(Scripted(Engine()), Engine(), timeout=True)


# The synchronous facade's error paths, from a real trainer thread --------------------------------
# (a broken source and close() through `scheduler(batch, variables, updates)`)


def test_a_broken_source_reaches_the_trainer_thread_as_itself():
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=0.0, raises=Boom("exploded")))
    before = set(threading.enumerate())
    sched = scheduler(source, engine, ahead=0, max_lag=0)
    stream = sched.tasks(dataset(2, 1)).stream(0)
    with pytest.raises(Boom, match="exploded"):
        sched(next(stream), PARAMS, 0)
    with pytest.raises(RuntimeError, match="an earlier call failed: Boom"):
        sched(next(stream), PARAMS, 1)
    sched.close()
    assert set(threading.enumerate()) == before


def test_close_from_another_thread_answers_the_waiting_trainer_thread():
    engine = Engine()
    started = threading.Event()

    class Endless(Scripted):
        async def run(self, task, label):
            started.set()
            return await super().run(task, label)

    source = Endless(engine, lambda task, label: Plan(duration=math.inf))
    before = set(threading.enumerate())
    sched = scheduler(source, engine, ahead=0, max_lag=0)
    stream = sched.tasks(dataset(1, 1)).stream(0)
    outcome: list[BaseException] = []

    def trainer():
        try:
            sched(next(stream), PARAMS, 0)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=trainer)
    thread.start()
    assert started.wait(30.0), "no rollout started"
    sched.close()
    thread.join(30.0)
    assert not thread.is_alive(), "the trainer thread still waits after close()"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "closed" in str(outcome[0])
    assert {reason for _, reason in source.cancelled} == {"closed"}
    assert set(threading.enumerate()) == before
