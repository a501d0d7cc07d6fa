"""RolloutScheduler's trio shell at its edges, against docs/scheduler.md.

Each test pins one rule of docs/scheduler.md ("the page") in an interleaving the rest of the
suite does not reach: ties at one instant of trio's clock, cancellations of the trainer's own
call, `close()` from places other than the scheduler's own run, a source that raises while it is
being cancelled, the synchronous facade's error paths, reopening the stream (a resume), the
pool's agreement point, status() under a blocked trio thread, and the accounting a recorded
trace holds. Mock-clock tests use pytest-trio's
`autojump_clock`; the determinism tests run the same script under several seeds of trio's
ready-task shuffling; the facade's tests use a real trainer thread on the real clock,
synchronised by events, never by sleeps.
"""

from __future__ import annotations

import math
import threading

import attrs
import numpy as np
import optax
import pytest
import trio
import trio.testing

from _scripted import OBJECTIVE, PARAMS, ROWS, WIDTH, Engine, Plan, Scripted, dataset
from _trio_order import under_scheduling_seed
from dew.data import Task
from dew.envs import SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.objectives.rl import _shell_trainer
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Label, Status
from dew.replay import replay_async
from dew.simulate import BehaviorObjective
from dew.testing import record_run
from dew.train import Trainer


def scheduler(source, engine, **kwargs) -> RolloutScheduler:
    kwargs.setdefault("groups", 2)
    sched = RolloutScheduler(OBJECTIVE, source, engine, width=WIDTH, rows=ROWS, **kwargs)
    sched.long_wait = None  # the tests that wait on purpose log nothing
    return sched


# Determinism: ties at one instant -----------------------------------------------------------------


def test_a_rollout_finishing_at_its_deadline_has_one_outcome_whatever_trios_order():
    """The page (Determinism): everything observable is a function of seed, source and
    clock, never of the order in which trio runs ready tasks. A rollout that finishes exactly
    at submission + timeout posts Finished while the deadline watch posts TimedOut for the
    same label at the same time: the finish comes first, so it is admitted, whatever order
    trio posted them in."""

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


async def test_a_group_complete_at_a_siblings_deadline_is_admitted(autojump_clock):
    """groups=1, oversample=1, timeout=2, max_attempts=1: sample 1 finishes at t=2, the instant
    sample 0 (still running) reaches its deadline. Every finish of an instant comes before its
    deadlines: the group is complete, and sample 0 is its surplus, not its end."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=5.0 if label.sample == 0 else 2))
    options = dict(groups=1, oversample=1, ahead=0, max_lag=0, timeout=2.0, max_attempts=1)
    async with scheduler(source, engine, **options) as sched:
        stream = sched.tasks(dataset(1, 1)).stream(0)
        await sched.step(next(stream), PARAMS, 0)
    assert (sched.last_record.groups, sched.last_record.abandoned) == (1, 0)
    assert [(label, reason) for _, label, reason in source.cancelled] == [
        (Label(0, 0, 0), "surplus")
    ]


def test_a_push_at_the_instant_a_queued_call_gets_its_slot_does_not_depend_on_trios_order():
    """One engine slot, rollouts of exactly 1 s, two one-task batches of two samples, ahead=1.
    Batch 1's second rollout waits for the slot until t=3, the instant the trainer hands batch 1
    over and version 1 is pushed, with no new batch to submit: the push lands at the trainer's
    call, so the engine, which starts the instant's calls once it has settled, starts that one
    under version 1 whatever order trio runs the instant's tasks in."""

    async def main():
        engine = SimulatedEngine(slots=1)
        config = SimulatedConfig(seed=0, duration_mean=1.0, duration_sigma=0.0, calls=(1, 1))
        sched = RolloutScheduler(
            BehaviorObjective(),
            SimulatedSource(engine, config),
            engine,
            width=256,
            rows=2,
            groups=2,
            ahead=1,
            max_lag=1,
        )
        sched.long_wait = None
        async with sched:
            stream = sched.tasks(dataset(2, 1)).stream(0)
            first, second = next(stream), next(stream)
            await sched.step(first, None, 0)
            await trio.sleep(1.0)
            batch = await sched.step(second, None, 1)
        return sched.last_record.metrics["lag/token_mean"], sorted(
            set(batch["versions"][batch["loss_mask"] > 0].tolist())
        )

    outcomes = {seed: under_scheduling_seed(main, seed) for seed in range(8)}
    assert all(outcome == outcomes[0] for outcome in outcomes.values()), outcomes
    lag, versions = outcomes[0]
    assert versions == [0, 1] and 0 < lag < 1, outcomes[0]


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
    assert {reason for *_, reason in source.cancelled} == {"closed"}, source.cancelled


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
        assert (Label(0, 2, 0), "surplus") in [(lab, why) for _, lab, why in source.cancelled]
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


def test_close_just_before_the_trainer_thread_waits_still_answers_it(monkeypatch):
    """close() from another thread can come between the trainer's checks and its one trip into
    the trio thread (hand-over and wait): the run the trainer would wait in has ended by then,
    and the call says the scheduler was closed, not that the trio thread stopped."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=math.inf))
    sched = scheduler(source, engine, ahead=0, max_lag=0)
    stream = sched.tasks(dataset(1, 1)).stream(0)
    before = set(threading.enumerate())
    real_run = _shell_trainer.run_from_thread

    def late_trip(fn, *args, trio_token):
        if fn == sched._hand_over_and_wait:
            closer = threading.Thread(target=sched.close)
            closer.start()
            closer.join()
        return real_run(fn, *args, trio_token=trio_token)

    monkeypatch.setattr(_shell_trainer, "run_from_thread", late_trip)
    with pytest.raises(RuntimeError, match=r"is closed: close\(\) came while the trainer"):
        sched(next(stream), PARAMS, 0)
    assert set(threading.enumerate()) <= before


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
    assert {reason for *_, reason in source.cancelled} == {"closed"}
    assert set(threading.enumerate()) == before


# Reopening the stream ----------------------------------------------------------------------------


async def test_reopening_the_stream_while_the_trainer_waits_does_not_leave_it_waiting_forever(
    autojump_clock,
):
    """The page: no group can wait forever unnoticed; reopening the stream cancels what
    the old one left running. A data-loader task that reopens the stream while the trainer
    waits on batch 0 cancels batch 0 (reason `reopened`) and answers the waiting call with an
    error, since its batch never comes."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=10.0))
    outcome: list[object] = []
    async with scheduler(source, engine, ahead=0, max_lag=0) as sched:
        data = sched.tasks(dataset(4, 1))
        stream = data.stream(0)

        async def trainer():
            try:
                await sched.step(next(stream), PARAMS, 0)
                outcome.append("returned")
            except Exception as error:
                outcome.append(error)

        with trio.move_on_after(1000.0) as guard:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trainer)
                await trio.sleep(1.0)
                data.stream(0)  # the loader reopens the stream, as a resume does
        status = str(sched.status())
    assert {reason for *_, reason in source.cancelled} == {"reopened"}, source.cancelled
    assert not guard.cancelled_caught, (
        "the trainer's call still waits 1000 s after the stream was reopened under it; "
        f"status() says:\n{status}"
    )
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "reopened while the trainer waited for batch 0" in str(outcome[0])


async def test_a_batch_of_the_old_stream_handed_over_after_a_reopen_is_not_trained(
    autojump_clock,
):
    """The page: reopening the stream cancels what the old one left running (batch 1 here, which
    ran a call ahead). A trainer that then hands over batch 1 as its old prefetch held it,
    though the new stream starts at position 3, is refused: no open stream yielded it."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=5.0 if task.name == "1" else 1.0))
    async with scheduler(source, engine, ahead=1, max_lag=1) as sched:
        data = sched.tasks(dataset(6, 1))
        old = data.stream(0)
        first, second = next(old), next(old)
        await sched.step(first, PARAMS, 0)
        data.stream(3)  # resumed elsewhere; not read yet
        await trio.sleep(0.5)
        assert (Label(1, 0, 0), "reopened") in [(lab, why) for _, lab, why in source.cancelled], (
            source.cancelled
        )
        with pytest.raises(ValueError, match="not read from the current tasks\\(\\) stream"):
            await sched.step(second, PARAMS, 1)
        assert sched.last_record is None
        assert not any(e.kind == "admitted" for e in sched.last_events)


class CrashOnce:
    """A trainer's on_step that raises once, after the step to `updates` (a crash between
    checkpoints, from the trainer's own code)."""

    def __init__(self, updates: int):
        self.updates = updates
        self.fired = False

    def __call__(self, line):
        if line["updates"] == self.updates and not self.fired:
            self.fired = True
            raise KeyError("the trainer's step crashed")


def test_a_trainer_resumed_in_the_same_process_trains_on_with_its_scheduler(tmp_path):
    """The page: a resumed run re-reads and resubmits whatever was in flight, and reopening the
    stream cancels what the old one left running. A Trainer whose step to updates 4 crashes (its
    last checkpoint at 2) resumes in the same process: the reopened stream lets its calls go
    back to updates 2, and the restored weights are pushed before anything is submitted."""
    engine = Engine()
    sched = scheduler(Scripted(engine, lambda task, label: Plan(duration=0.0)), engine, ahead=1)
    trainer = Trainer(
        OBJECTIVE,
        optax.sgd(1e-3),
        PARAMS,
        directory=tmp_path,
        checkpoint_every=2,
        on_step=CrashOnce(4),
    )
    data = sched.tasks(dataset(8, 1))
    try:
        with pytest.raises(KeyError, match="crashed"):
            trainer.run(sched, data, steps=5, ahead=1)
        assert trainer.resume().updates == 2
        pushed = len(engine.pushes)
        try:
            trainer.run(sched, data, steps=5, ahead=1)
        except ValueError as error:
            pytest.fail(f"the resumed trainer's call was refused: {error}")
    finally:
        sched.close()
    assert trainer.updates == 5
    assert engine.pushes[pushed][1] == 2, (
        f"after the resume the engine got pushes {engine.pushes[pushed:]}, not the restored "
        "weights of version 2 first"
    )


# The pool: every failure meets the agreement point -----------------------------------------------


class RecordingPool:
    """A one-process stand-in for a DistributedPool that keeps what each call brought to the
    agreement; `others_fail` makes the first agreement report another process's failure."""

    def __init__(self, others_fail: bool = False):
        self.agreed: list[BaseException | None] = []
        self.others_fail = others_fail

    def agree(self, error):
        self.agreed.append(error)
        if error is not None:
            raise error
        if self.others_fail and len(self.agreed) == 1:
            raise RuntimeError("admission failed on process 1 of 2; process 0 stops with it")

    def rescore(self, objective, variables, rows):
        return np.zeros(np.shape(rows["tokens"]), np.float32)

    share_size = 1

    def is_first_reader(self):
        return True


@attrs.frozen
class Batches:
    """A dataset of the given task_id batches, of any sizes."""

    ids: list

    def stream(self, start: int = 0):
        for ids in self.ids[start:]:
            yield {"task_id": ids}

    def __len__(self) -> int:
        return len(self.ids)


def refuse_task_4(batch):
    if 4 in batch["task_id"]:
        raise ValueError("task 4 has no environment on this process")
    return [Task(str(int(i))) for i in batch["task_id"]]


@pytest.mark.parametrize(
    "options",
    [dict(tasks=refuse_task_4), dict(admit=2)],
    ids=["tasks-raises", "admit-above-a-short-batch"],
)
async def test_a_call_that_fails_on_one_process_raises_at_the_agreement_point(
    autojump_clock, options
):
    """The page: a process whose admission fails raises on every process at the agreement
    point, rather than leave the others waiting in the rescoring. A call whose tasks cannot be
    made on this process (its `tasks` refuses a row, or its batch is shorter than `admit`)
    brings its error to the agreement, where the other processes hear it."""
    engine = Engine()
    sched = scheduler(Scripted(engine), engine, ahead=0, max_lag=0, **options)
    pool = sched.pool = RecordingPool()
    data = Batches([np.arange(4), np.arange(4, 5), np.arange(5, 9)])
    async with sched:
        stream = sched.tasks(data).stream(0)
        await sched.step(next(stream), PARAMS, 0)
        with pytest.raises(ValueError):
            await sched.step(next(stream), PARAMS, 1)
    assert len(pool.agreed) == 2 and pool.agreed[1] is not None, (
        f"the failing call brought {pool.agreed[1:]} to the pool's agreement; the other "
        "processes would wait there forever"
    )


async def test_after_the_pool_agreed_on_a_failure_this_process_refuses_the_next_call_too(
    autojump_clock,
):
    """The page: a failed admission raises on every process at the agreement point. The failed
    process then refuses every later call before it meets the pool; a process told of another's
    failure by the agreement stops alike, rather than wait in the next agreement for a process
    that never comes."""
    engine = Engine()
    sched = scheduler(Scripted(engine), engine, ahead=0, max_lag=0)
    pool = sched.pool = RecordingPool(others_fail=True)
    async with sched:
        stream = sched.tasks(dataset(3, 1)).stream(0)
        with pytest.raises(RuntimeError, match="failed on process 1"):
            await sched.step(next(stream), PARAMS, 0)
        with pytest.raises(RuntimeError, match="stopped after an earlier call failed"):
            await sched.step(next(stream), PARAMS, 1)
    assert len(pool.agreed) == 1, (
        f"the call after the pool's agreed failure met the pool again ({len(pool.agreed)} "
        "agreements), where the failed process never comes"
    )


# status() while a source blocks the trio thread ---------------------------------------------------


def test_status_answers_while_a_source_blocks_the_scheduler_thread():
    """The page (status): while the trainer waits, the scheduler can say which groups it waits on
    (`status()`). A source that blocks its trio thread in a synchronous call (the environment
    step the page warns about) stalls the trainer, but not status() from another thread."""
    engine = Engine()
    entered, release = threading.Event(), threading.Event()

    class Blocking(Scripted):
        async def run(self, task, label):
            if label.sample == 0:
                entered.set()
                release.wait(30.0)  # a synchronous environment step, on the trio thread
            return await super().run(task, label)

    sched = scheduler(Blocking(engine, lambda task, label: Plan(duration=0.0)), engine, ahead=0)
    stream = sched.tasks(dataset(1, 1)).stream(0)
    trainer = threading.Thread(target=sched, args=(next(stream), PARAMS, 0))
    answered = threading.Event()
    statuses = []

    def ask():
        statuses.append(sched.status())
        answered.set()

    asker = threading.Thread(target=ask)
    trainer.start()
    try:
        assert entered.wait(30.0), "no rollout started"
        asker.start()
        answered_in_time = answered.wait(30.0)
    finally:
        release.set()
        trainer.join(30.0)
        asker.join(30.0)
        sched.close()
    assert answered_in_time, (
        "status() did not answer while a source blocked the scheduler's trio thread"
    )
    assert statuses[0].waiting == 0


# Replay: the trace accounts for every submission -------------------------------------------------


async def test_a_trace_accounts_for_what_happened_after_the_last_call(tmp_path, autojump_clock):
    """The page: every submission ends exactly once and says how, and the event log is available
    for replay. A recorded run whose ahead batch fails an attempt after the last call returned,
    and is then closed with work in flight, holds how each of its submissions ended: the events
    after the last call are the trace's closing events, and the replay reproduces them."""

    def script(task, label):
        if task.name == "3" and label.sample == 0 and label.attempt == 0:
            return Plan(duration=0.5, status=Status.INFRA_ERROR)
        return Plan(duration=100.0 if task.name == "3" else 1.0)

    engine = Engine()
    trace = await record_run(
        Scripted(engine, script),
        engine,
        tmp_path / "run.trace",
        updates=range(3),
        batch_size=1,
        gap=1.0,
        width=WIDTH,
        rows=ROWS,
        groups=2,
        ahead=1,
        max_lag=1,
    )
    events = [e for call in trace.calls for e in call.events] + list(trace.closing_events)
    submitted = {e.label for e in events if e.kind == "submitted"}
    ended = {e.label for e in events if e.kind in ("admitted", "cancelled", "discarded", "failed")}
    unlogged = sorted(map(str, set(trace.sessions) - submitted))
    unended = sorted(map(str, submitted - ended))
    assert not unlogged and not unended, (
        f"the trace holds sessions no event submitted: {unlogged}, and submissions no event "
        f"ends: {unended}"
    )
    assert any(e.reason == "closed" for e in trace.closing_events)
    result = await replay_async(trace)
    assert result.matched, str(result)


# SchedulerRecord's counts, per the page ----------------------------------------------------------


async def test_timeouts_are_resubmissions_not_cancellations_in_the_record(autojump_clock):
    """The page: `cancelled` counts in-flight rollouts cancelled as surplus, stale or abandoned;
    a timeout is a failed attempt, counted in `resubmitted`."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=50.0 if label.attempt == 0 else 1))
    async with scheduler(source, engine, ahead=0, max_lag=0, timeout=10.0) as sched:
        stream = sched.tasks(dataset(1, 1)).stream(0)
        await sched.step(next(stream), PARAMS, 0)
    record = sched.last_record
    assert {reason for *_, reason in source.cancelled} == {"timeout"}
    assert (record.resubmitted["timeout"], record.cancelled, record.groups) == (2, 0, 1)


async def test_version_and_lag_are_the_oldest_packed_call_not_a_cut_groups(autojump_clock):
    """Batch 1 (two one-sample groups, one row of room) is submitted at t=0 under version 0.
    Group 3 calls at once under version 0 and finishes at t=5; group 2 waits 2 s, calls under
    version 1 (pushed at t=1) and finishes first, at t=3. Group 2 is packed and group 3, though
    complete, cut: the record's version and lag are group 2's call's."""

    def script(task, label):
        if label.group == 3:
            return Plan(duration=5.0, tokens=40)
        if label.group == 2:
            return Plan(delay=2.0, duration=1.0, tokens=40)
        return Plan(duration=0.5, tokens=40)

    engine = Engine()
    sched = RolloutScheduler(
        OBJECTIVE, Scripted(engine, script), engine, width=64, rows=1, groups=1, ahead=1
    )
    async with sched:
        stream = sched.tasks(dataset(3, 2)).stream(0)
        first, second = next(stream), next(stream)
        await sched.step(first, PARAMS, 0)
        await trio.sleep(0.5)
        batch = await sched.step(second, PARAMS, 1)
    record = sched.last_record
    assert (record.groups, record.cut) == (1, 1)
    assert set(batch["versions"][batch["loss_mask"] > 0].tolist()) == {1}
    assert (record.updates, record.version, record.lag) == (1, 1, 0)
