"""Traces: a recorded scheduler run replays bit for bit, in any trio scheduling order; a changed
configuration is reported where the run first parts; a bad trace names its file, line and fault.

The recorded run is a SimulatedSource under the mock clock with every happening the scheduler
knows: infra errors, timeouts, unscored truncations, stale rollouts (every third call the trainer
reports two updates), surplus cancels (oversample), abandoned groups (max_attempts=2) and cuts
(few rows, a small support capacity).

Runs driven through the scheduler's thread facade are recorded on the real clock, from the
trainer's thread: the same simulated mix (but timeouts) with a stream reopened midway, and a
real RolloutServer sampling a GuessDigit environment; their replays under the mock clock, without
the engine, reproduce every decision and packed array.
"""

from __future__ import annotations

import collections
import gc
import inspect
import itertools
import json
import pathlib

import attrs
import jax
import numpy as np
import pytest
import trio
import trio.testing
from trio._core._run import _r as trio_scheduler_random

from _scripted import ROWS, WIDTH, Engine, Plan, Scripted
from dew import cli, models
from dew.data import ArrayDataset, Task
from dew.envs import GuessDigit, SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.envs.environment import Sampling
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import LogEvent, RolloutScheduler
from dew.objectives.rl.sessions import Call, Label, Session, Status
from dew.replay import (
    CONFIG,
    PROXIMAL,
    UNCOMPARED,
    NoRescoring,
    Recorder,
    RecordingPublisher,
    RecordingSource,
    ReplayNote,
    ReplaySource,
    TraceError,
    read_trace,
    replay,
)
from dew.serve import RolloutServer
from dew.testing import (
    assert_exactly_once,
    assert_record_adds_up,
    assert_replays,
    record_run,
    run_simulated,
)
from dew.train import ServedSource

MIX = SimulatedConfig(
    seed=3,
    infra_error=0.1,
    truncated=0.15,
    truncated_unscored=0.5,
    calls=(1, 3),
    prompt_tokens=(4, 16),
    completion_tokens=(4, 24),
    support_k=3,
)
# Every third call the trainer reports two updates: what was submitted a call ahead is then two
# behind, past max_lag=1.
UPDATES = [step + step // 3 for step in range(12)]
OPTIONS = dict(
    slots=12,
    width=96,
    rows=6,
    groups=4,
    oversample=1,
    timeout=25.0,
    max_attempts=2,
    truncation="score",
    support_capacity=150,
    gap=2.0,
)


def record(path) -> object:
    """Record the mixed run to path in a trio run of its own; the trace read back."""

    async def main():
        return await run_simulated(path, updates=UPDATES, config=MIX, **OPTIONS)

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return record(tmp_path_factory.mktemp("trace") / "run.trace")


def log(trace) -> list[LogEvent]:
    return [event for call in trace.calls for event in call.events]


def comparable(record):
    """A record without the figures replay does not reproduce (UNCOMPARED)."""
    metrics = {k: v for k, v in record.metrics.items() if not k.startswith(UNCOMPARED)}
    return attrs.evolve(record, metrics=metrics)


def same_calls(trace, result) -> None:
    assert len(result.calls) == len(trace.calls)
    for recorded, replayed in zip(trace.calls, result.calls, strict=True):
        assert comparable(replayed.record) == comparable(recorded.record)
        assert replayed.events == recorded.events
        assert replayed.arrays == recorded.arrays


def test_a_trace_holds_every_scheduler_argument_but_the_objects():
    arguments = set(inspect.signature(RolloutScheduler).parameters)
    objects = {"objective", "source", "weights", "tasks", "log", "reference"}
    assert set(CONFIG) == arguments - objects


def test_the_recorded_run_has_every_happening(recorded):
    happened = collections.Counter((e.kind, e.reason) for e in log(recorded))
    for kind, reason in [
        ("failed", "infra_error"),
        ("failed", "unscored"),
        ("cancelled", "timeout"),
        ("discarded", "stale"),
        ("cancelled", "stale"),
        ("cancelled", "surplus"),
        ("cancelled", "abandoned"),
        ("cut", "no_room"),
        ("cut", "support"),
    ]:
        assert happened[kind, reason] > 0, (kind, reason)
    assert happened["pushed", None] == len(UPDATES)
    assert sum(e.kind == "abandoned" for e in log(recorded)) > 0
    outcomes = collections.Counter(s.outcome for s in recorded.sessions.values())
    assert set(outcomes) == {"returned", "cancelled"}


def test_the_trace_holds_every_session_with_its_times_and_accounting(recorded):
    for call in recorded.calls:
        assert_record_adds_up(call.record, call.events)
    in_flight = assert_exactly_once(log(recorded))
    # What was still in flight at the last call ended by the close, which cancelled the rest.
    assert all(recorded.sessions[label].ended <= recorded.end for label in in_flight)
    closed = [
        label
        for label in in_flight
        if (recorded.sessions[label].outcome, recorded.sessions[label].ended)
        == ("cancelled", recorded.end)
    ]
    assert closed
    for event in log(recorded):
        session = recorded.sessions.get(event.label)
        if event.kind == "submitted":
            assert session.submitted == event.time
            assert session.task.name == event.task
        elif event.kind == "cancelled":
            assert (session.outcome, session.ended) == ("cancelled", event.time)
        elif event.kind in ("admitted", "failed", "discarded"):
            assert session.outcome == "returned" and session.ended <= event.time
    assert [version for _, version in recorded.pushes] == UPDATES
    pushed = [e for e in log(recorded) if e.kind == "pushed"]
    assert [(e.time, e.version) for e in pushed] == list(recorded.pushes)
    assert {t.name for tasks in recorded.batches.values() for t in tasks} >= {
        e.task for e in log(recorded) if e.task is not None
    }


def test_a_replay_reproduces_every_record_event_and_packed_array(recorded):
    frozen = gc.get_freeze_count()  # a gateway served earlier in this process may have frozen
    result = replay(recorded)
    assert result.matched, str(result)
    same_calls(recorded, result)
    assert result.steps == len(UPDATES)
    assert result.groups == sum(call.record.groups for call in recorded.calls) > 0
    assert str(result).endswith(
        f"replay matched: {len(UPDATES)} steps, {result.groups} groups, {len(log(recorded))} events"
    )
    # Recorded with NoRescoring too, even the proximal log-probs agree: every array's digest does.
    assert [c.arrays for c in result.calls] == [c.arrays for c in recorded.calls]
    # The collector, frozen over the trace while it replayed, is as it was found.
    assert gc.isenabled() and (gc.get_freeze_count() == 0) == (frozen == 0)


def test_a_replay_is_the_same_under_any_trio_scheduling_order(recorded):
    state = trio_scheduler_random.getstate()
    try:
        for seed in (1, 2, 3):
            trio_scheduler_random.seed(seed)
            result = replay(recorded)
            assert result.matched, (seed, str(result))
            same_calls(recorded, result)
    finally:
        trio_scheduler_random.setstate(state)


def test_a_replay_never_waits_on_real_time(recorded, monkeypatch):
    # trio sleeps at least a millisecond for any positive cushion: one per instant replayed was
    # most of a replay's time.
    cushions = []
    settle = trio.testing.wait_all_tasks_blocked

    async def recorded_wait(cushion=0.0):
        cushions.append(cushion)
        await settle(cushion)

    monkeypatch.setattr(trio.testing, "wait_all_tasks_blocked", recorded_wait)
    result = replay(recorded)
    assert result.matched, str(result)
    assert cushions and set(cushions) == {0.0}


def test_a_recording_is_the_same_under_any_trio_scheduling_order(recorded, tmp_path):
    state = trio_scheduler_random.getstate()
    try:
        for seed in (4, 5):
            trio_scheduler_random.seed(seed)
            again = record(tmp_path / f"run{seed}.trace")
            assert [(c.record, c.events, c.arrays) for c in again.calls] == [
                (c.record, c.events, c.arrays) for c in recorded.calls
            ]
    finally:
        trio_scheduler_random.setstate(state)


def test_a_changed_max_lag_is_reported_where_the_run_first_parts(recorded, capsys):
    # With max_lag=2 nothing the recording threw away as stale (two updates behind at most) is
    # stale: the replay first parts at the recording's first stale event, and nowhere before.
    step, index = next(
        (call.step, i)
        for call in recorded.calls
        for i, event in enumerate(call.events)
        if event.reason == "stale"
    )
    stale = recorded.calls[step].events[index]
    result = replay(recorded, max_lag=2)
    divergence = result.divergence
    assert divergence is not None
    assert (divergence.step, divergence.event, divergence.field) == (
        step,
        index,
        f"events[{index}]",
    )
    assert divergence.recorded == stale
    assert divergence.replayed.reason != "stale"
    assert (divergence.label, divergence.time) == (stale.label, stale.time)
    for before in range(step):
        assert result.calls[before].events == recorded.calls[before].events
        assert comparable(result.calls[before].record) == comparable(recorded.calls[before].record)
    assert result.calls[step].events[:index] == recorded.calls[step].events[:index]
    assert f"diverged at step {step}, {stale.label}, event {index} ({stale.kind})" in str(result)

    assert cli.main(["replay", recorded.path, "--max-lag", "2"]) == 1
    assert f"replay diverged at step {step}, {stale.label}" in capsys.readouterr().out
    assert cli.main(["replay", recorded.path]) == 0
    assert "replay matched: 12 steps" in capsys.readouterr().out


def test_an_override_the_scheduler_refuses_is_a_usage_error(recorded, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["replay", recorded.path, "--max-lag", "0"])
    assert exit.value.code == 2
    assert "max_lag must be >= ahead + sync_every - 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot override objective"):
        replay(recorded, objective=None)


def rewrite(source, target, change) -> int:
    """Copy a trace's lines to target with change(lines) applied; the changed line's number."""
    lines = pathlib.Path(source.path).read_text(encoding="utf-8").split("\n")
    number = change(lines)
    target.write_text("\n".join(lines), encoding="utf-8")
    return number


def first(lines, kind) -> int:
    return next(i for i, line in enumerate(lines) if f'"kind":"{kind}"' in line)


def corrupt(lines):
    i = first(lines, "session")
    lines[i] = lines[i][: len(lines[i]) // 2]
    return i + 1


def unknown_version(lines):
    header = json.loads(lines[0])
    lines[0] = json.dumps({**header, "version": 2})
    return 1


def unlabelled(lines):
    i = first(lines, "session")
    line = json.loads(lines[i])
    del line["label"]
    lines[i] = json.dumps(line)
    return i + 1


def short_array(lines):
    i = first(lines, "session")
    line = json.loads(lines[i])
    line["session"]["calls"][0]["prompt"]["shape"] = [1000]
    lines[i] = json.dumps(line)
    return i + 1


@pytest.mark.parametrize(
    "change, problem",
    [
        (corrupt, "is not JSON"),
        (unknown_version, "dew-trace version 2 is not one this dew reads (versions 3, 4)"),
        (unlabelled, "lacks field 'label'"),
        (short_array, "array calls[0].prompt holds"),
    ],
)
def test_a_bad_trace_names_its_file_line_and_problem(recorded, tmp_path, capsys, change, problem):
    path = tmp_path / "bad.trace"
    line = rewrite(recorded, path, change)
    with pytest.raises(TraceError) as error:
        read_trace(path)
    assert (error.value.path, error.value.line) == (str(path), line)
    assert str(error.value).startswith(f"{path}:{line}: ")
    assert problem in error.value.problem
    assert cli.main(["replay", str(path)]) == 2
    assert f"{path}:{line}: " in capsys.readouterr().err


def test_a_nan_time_is_refused(recorded, tmp_path):
    def nan_push(lines):
        i = first(lines, "push")
        lines[i] = lines[i].replace('"time":', '"time":NaN,"was":')
        return i + 1

    path = tmp_path / "nan.trace"
    line = rewrite(recorded, path, nan_push)
    with pytest.raises(TraceError, match=f":{line}: field 'time' must be a finite time"):
        read_trace(path)


def overshooting_pair() -> tuple[float, float]:
    """Times where MockClock's own jump, base + (target - base), lands past target."""
    rng = np.random.default_rng(0)
    while True:
        base, target = sorted(float(t) for t in rng.random(2) * 100)
        if base + (target - base) > target:
            return base, target


async def test_replay_lands_the_clock_on_recorded_times_exactly(recorded, autojump_clock):
    base, target = overshooting_pair()
    await trio.sleep_until(base)
    assert trio.current_time() == base
    async with ReplaySource(recorded) as source:
        await source.sleep_until(target)
        assert trio.current_time() == target


async def test_a_replayed_rollout_ends_when_and_as_recorded(recorded, autojump_clock):
    returned = next(s for s in recorded.sessions.values() if s.outcome == "returned")
    cancelled = next(
        s
        for s in recorded.sessions.values()
        if s.outcome == "cancelled" and s.submitted >= returned.ended
    )
    async with ReplaySource(recorded) as source:
        await source.sleep_until(returned.submitted)
        session = await source.run(returned.task, returned.label)
        assert trio.current_time() == returned.ended
        assert session is returned.session
        assert [c.version for c in session.calls] == [c.version for c in returned.session.calls]

        # Nobody cancels it: once its recorded cancellation passes, the replay notes it.
        await source.sleep_until(cancelled.submitted)
        with trio.move_on_at(cancelled.ended + 1.0):
            await source.run(cancelled.task, cancelled.label)
        assert source.notes == [
            ReplayNote(
                cancelled.ended,
                cancelled.task.name,
                cancelled.label,
                f"cancelled at {cancelled.ended!r}",
                "still running",
            )
        ]

        unknown = Label(10**6, 0, 0)
        session = await source.run(Task("nowhere"), unknown)
        assert session.status is Status.INFRA_ERROR
        assert source.notes[-1] == ReplayNote(
            trio.current_time(), "nowhere", unknown, "never ran", f"ran at {trio.current_time()!r}"
        )


async def test_replay_source_needs_a_mock_clock(recorded):
    with pytest.raises(RuntimeError, match="MockClock at rate 0"):
        async with ReplaySource(recorded):
            pass


async def test_the_recorder_wants_its_own_source_and_publisher(tmp_path, autojump_clock):
    engine = SimulatedEngine()
    recorder = Recorder(tmp_path / "run.trace")
    scheduler = RolloutScheduler(
        NoRescoring(),
        SimulatedSource(engine),
        RecordingPublisher(engine, recorder),
        width=64,
        rows=4,
    )
    with pytest.raises(ValueError, match="scheduler's source must be a RecordingSource"):
        async with recorder.record(scheduler):
            pass


class Served:
    """A Publisher that serves the version pushed last."""

    version = 0

    def load(self, variables, version):
        self.version = version


@attrs.frozen
class Coin:
    """A user's own source: each rollout writes one token after a seeded wait (`mean` seconds on
    average) and is rewarded for heads; the first attempt of every fifth sample fails for the
    infrastructure."""

    engine: Served
    mean: float = 3.0

    async def run(self, task: Task, label: Label) -> Session:
        rng = np.random.default_rng([int(task.name), label.group, label.sample, label.attempt])
        version = self.engine.version
        await trio.sleep(float(rng.exponential(self.mean)))
        if label.sample == 4 and label.attempt == 0:
            return Session(Status.INFRA_ERROR, error="the coin rolled away")
        heads = int(rng.integers(2))
        completion = np.array([heads + 3], np.int32)
        call = Call(np.array([1, 2], np.int32), completion, np.array([-0.7], np.float32), version)
        return Session(Status.COMPLETED, [call], reward=float(heads))


async def test_a_users_own_source_replays_in_a_few_lines(tmp_path, autojump_clock):
    engine = Served()
    trace = await record_run(
        Coin(engine),
        engine,
        tmp_path / "coin.trace",
        updates=range(6),
        width=16,
        rows=8,
        groups=2,
        oversample=3,
    )
    for call in trace.calls:
        assert_record_adds_up(call.record, call.events)
    assert_exactly_once(log(trace))
    result = await assert_replays(trace)
    assert result.steps == 6
    with pytest.raises(AssertionError, match=r"replay diverged at step 0"):
        await assert_replays(trace, oversample=2)


async def test_a_rollout_kept_by_its_first_calls_version_replays_so(tmp_path, autojump_clock):
    """The trace holds when each rollout's first call started and under which version, and the
    replay tells the scheduler alike: batch 2 (submitted under version 0, ahead 2) is swept at
    updates 3, where its sample 0, whose first call came after the push of version 1, is kept
    and its sample 1 (first call under version 0) is cancelled as stale. Without the first
    calls, the replay would cancel both."""
    engine = Engine()

    def script(task, label):
        if task.name != "2" or label.attempt > 0:
            return Plan(duration=0.5)
        if label.sample == 0:
            return Plan(delay=2.0, duration=1.5, calls=3)
        return Plan(duration=4.0, calls=2)

    trace = await record_run(
        Scripted(engine, script),
        engine,
        tmp_path / "first_call.trace",
        updates=[0, 1, 3],
        batch_size=1,
        width=WIDTH,
        rows=ROWS,
        groups=2,
        ahead=2,
        max_lag=2,
    )
    firsts = {label: s.first_call for label, s in trace.sessions.items() if s.task.name == "2"}
    assert firsts[Label(2, 0, 0)] == (2.0, 1) and firsts[Label(2, 1, 0)] == (0.0, 0)
    stale = [e.label for e in log(trace) if e.kind == "cancelled" and e.reason == "stale"]
    assert stale == [Label(2, 1, 0)]
    await assert_replays(trace)


def test_accounting_helpers_catch_a_broken_log():
    label = Label(0, 0, 0)
    submitted = LogEvent("submitted", 0.0, 0, 0, "t", label)
    admitted = LogEvent("admitted", 1.0, 0, 0, "t", label)
    assert assert_exactly_once([submitted]) == {label}
    assert assert_exactly_once([submitted, admitted]) == frozenset()
    with pytest.raises(AssertionError, match="ended twice"):
        assert_exactly_once([submitted, admitted, admitted])
    with pytest.raises(AssertionError, match="ended unsubmitted"):
        assert_exactly_once([admitted])
    retried = LogEvent("submitted", 2.0, 0, 0, "t", Label(0, 0, 1), reason="infra_error")
    with pytest.raises(AssertionError, match="resubmitted before attempt 0 ended"):
        assert_exactly_once([submitted, retried])


def test_a_record_that_does_not_add_up_names_its_field(recorded):
    call = next(c for c in recorded.calls if c.record.cancelled)
    wrong = attrs.evolve(call.record, cancelled=call.record.cancelled + 1)
    with pytest.raises(AssertionError, match="record.cancelled is"):
        assert_record_adds_up(wrong, call.events)


def bigram(table, tokens, positions, segment_ids):
    """A model small enough to compile at once: each token's next-token logits are its row."""
    return jax.numpy.asarray(table)[tokens]


def test_a_run_rescored_by_a_real_objective_replays_but_for_the_proximal_log_probs(tmp_path):
    table = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)

    async def main():
        return await run_simulated(
            tmp_path / "real.trace",
            updates=range(3),
            config=SimulatedConfig(seed=1, calls=(1, 2), completion_tokens=(4, 16)),
            objective=GRPOObjective(bigram),
            variables=table,
            width=96,
            rows=8,
        )

    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        trace = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    result = replay(trace)
    assert result.matched, str(result)
    for recorded, replayed in zip(trace.calls, result.calls, strict=True):
        assert replayed.arrays["proximal_logprobs"] != recorded.arrays["proximal_logprobs"]
        assert {k: v for k, v in replayed.arrays.items() if k != "proximal_logprobs"} == {
            k: v for k, v in recorded.arrays.items() if k != "proximal_logprobs"
        }


@attrs.frozen
class Breaks:
    """A broken source: one rollout raises, `delay` seconds in, instead of returning a session."""

    coin: Coin
    delay: float = 1.0

    async def run(self, task: Task, label: Label) -> Session:
        if label == Label(5, 1, 0):
            await trio.sleep(self.delay)
            raise RuntimeError("the table fell over")
        return await self.coin.run(task, label)


async def test_a_broken_sources_failure_replays_as_recorded(tmp_path, autojump_clock):
    engine = Served()
    path = tmp_path / "broken.trace"
    with pytest.raises(RuntimeError, match="the table fell over"):
        await record_run(
            Breaks(Coin(engine)), engine, path, updates=range(6), width=16, rows=8, groups=2
        )
    trace = read_trace(path)
    # Group 5 runs a batch ahead: its failure reaches the trainer at its first call.
    assert [call.raised for call in trace.calls] == ["RuntimeError: the table fell over"]
    assert trace.sessions[Label(5, 1, 0)].outcome == "raised"
    result = await assert_replays(trace)
    assert result.calls[-1].raised == "RuntimeError: the table fell over"


# --- the thread facade, on the real clock -------------------------------------------------------


def drive(recorder, dataset, updates, *, reopen_at=None, variables=None, change=None) -> None:
    """A trainer on its own thread, calling the scheduler's thread facade through the recorder.

    It opens the stream before its first call, reads one batch beyond the one it hands over,
    makes one call per entry of `updates` (changing `variables` by `change` after each), and at
    call `reopen_at` reopens the stream at that position, as a resumed trainer does.
    """
    stream = recorder.tasks(dataset).stream()
    read = collections.deque()
    for step, count in enumerate(updates):
        if step == reopen_at:
            stream, read = recorder.tasks(dataset).stream(step), collections.deque()
        read.extend(itertools.islice(stream, 2 - len(read)))
        recorder(read.popleft(), variables, count)
        if change is not None:
            variables = change(variables)


def real_clock_free(record):
    """A record without what a thread trace's replay does not compare: the trainer's wait, and
    the figures replay does not reproduce (UNCOMPARED)."""
    metrics = {k: v for k, v in record.metrics.items() if not k.startswith(UNCOMPARED)}
    return attrs.evolve(record, waited=0.0, metrics=metrics)


# The mixed run in milliseconds.
QUICK_MIX = attrs.evolve(MIX, duration_mean=0.02)


@pytest.fixture(scope="module")
def thread_recorded(tmp_path_factory):
    """The quick mix recorded through the thread facade, on the real clock; read back."""
    path = tmp_path_factory.mktemp("thread") / "run.trace"
    engine = SimulatedEngine(slots=12)
    recorder = Recorder(path)
    scheduler = RolloutScheduler(
        NoRescoring(),
        RecordingSource(SimulatedSource(engine, QUICK_MIX), recorder),
        RecordingPublisher(engine, recorder),
        **{k: v for k, v in OPTIONS.items() if k not in ("slots", "gap", "timeout")},
        timeout=0.05,  # the mix's 25 s at its 10 s mean, in the quick mix's milliseconds
    )
    dataset = ArrayDataset({"task_id": np.arange(64)}, 4)
    with recorder.record(scheduler):
        drive(recorder, dataset, UPDATES[:10], reopen_at=5)
    return read_trace(path)


def test_a_thread_trace_takes_the_scheduler_s_times_from_its_event_log(thread_recorded):
    trace = thread_recorded
    header = json.loads(pathlib.Path(trace.path).read_text(encoding="utf-8").split("\n")[0])
    assert (header["facade"], header["start"]) == ("thread", None)
    for call in trace.calls:
        assert [call.handed_over] == [e.time for e in call.events if e.kind == "handed_over"]
        assert call.returned == call.events[-1].time >= call.handed_over
        assert call.record.waited > 0
    # The first stream opened before the scheduler's thread ran: no clock, nothing reopened.
    # The second takes its reopened event's time, between the calls it was opened between.
    first, again = trace.streams
    assert (first.time, first.running, again.running) == (None, False, True)
    assert [again.time] == [e.time for e in log(trace) if e.kind == "reopened"]
    assert trace.calls[4].returned < again.time < trace.calls[5].handed_over
    assert trace.start == trace.calls[0].handed_over
    assert all(trace.start <= s.submitted <= s.ended <= trace.end for s in trace.sessions.values())
    # A returned session's end is the scheduler's own stamp: the time of its finish's events.
    failed = [e for e in log(trace) if e.kind == "failed"]
    assert failed
    assert all(trace.sessions[e.label].ended == e.time for e in failed)


def test_a_thread_trace_replays_every_decision_and_packed_array(thread_recorded):
    result = replay(thread_recorded)
    assert result.matched, str(result)
    assert result.steps == 10
    events = [e for c in thread_recorded.calls for e in c.events]
    # real-clock timeouts replay too: deadlines count from the submission events' times
    assert any(e.kind == "submitted" and e.reason == "timeout" for e in events)
    for recorded, replayed in zip(thread_recorded.calls, result.calls, strict=True):
        assert replayed.events == recorded.events
        assert replayed.arrays == recorded.arrays
        assert real_clock_free(replayed.record) == real_clock_free(recorded.record)
    # The trainer thread's real seconds are in the trace, and the replay's mock ones differ.
    assert [c.record.waited for c in result.calls] != [
        c.record.waited for c in thread_recorded.calls
    ]
    assert [v for _, v in thread_recorded.pushes] == UPDATES[:10]
    assert replay(thread_recorded, oversample=2).divergence.step == 0
    assert cli.main(["replay", thread_recorded.path]) == 0


def test_a_thread_call_that_raised_replays_as_recorded(tmp_path):
    engine = Served()
    recorder = Recorder(tmp_path / "broken.trace")
    scheduler = RolloutScheduler(
        NoRescoring(),
        RecordingSource(Breaks(Coin(engine, mean=0.05), delay=0.0), recorder),
        RecordingPublisher(engine, recorder),
        width=16,
        rows=8,
        groups=2,
    )
    dataset = ArrayDataset({"task_id": np.arange(40)}, 4)
    with pytest.raises(RuntimeError, match="the table fell over"), recorder.record(scheduler):
        drive(recorder, dataset, range(6))
    trace = read_trace(tmp_path / "broken.trace")
    *returned, broken = trace.calls
    assert all(call.raised is None for call in returned)
    # The trainer's thread saw no event log of the call that raised: it has no times.
    assert (broken.raised, broken.handed_over, broken.returned) == (
        "RuntimeError: the table fell over",
        None,
        None,
    )
    result = replay(trace)
    assert result.matched, str(result)
    assert result.calls[-1].raised == "RuntimeError: the table fell over"


class ServedMidway(Served):
    """A Publisher whose push (`load_async`) serves the new version partway through, as vLLM's
    does (it reloads and resumes, then returns), and returns once a rollout has ended under the
    new version (or after a second: none was running)."""

    def __init__(self):
        self.ended_under_new: trio.Event | None = None

    async def load_async(self, variables, version):
        await trio.sleep(0.005)
        self.version, self.ended_under_new = version, trio.Event()
        with trio.move_on_after(1.0):
            await self.ended_under_new.wait()
        self.ended_under_new = None


@attrs.frozen
class LateCoin:
    """Coin's rollouts, drawn under the version served when they end (a call of vLLM that
    joins the batch after the reload)."""

    engine: ServedMidway

    async def run(self, task: Task, label: Label) -> Session:
        rng = np.random.default_rng([int(task.name), label.group, label.sample])
        await trio.sleep(float(rng.exponential(0.02)))
        version = self.engine.version
        if self.engine.ended_under_new is not None:
            self.engine.ended_under_new.set()
        heads = int(rng.integers(2))
        logprobs = np.array([-0.7], np.float32)
        call = Call(np.array([1, 2], np.int32), np.array([heads + 3], np.int32), logprobs, version)
        return Session(Status.COMPLETED, [call], reward=float(heads))


def test_a_thread_trace_replays_rollouts_that_ended_during_an_async_push(tmp_path):
    # The scheduler knows a version from its push's start: a rollout in flight may end under
    # it before the push returns and the hand-over is logged. Replay makes the call at the
    # push's recorded start and lets it last until the hand-over, so that rollout is taken.
    engine = ServedMidway()
    recorder = Recorder(tmp_path / "pushes.trace")
    scheduler = RolloutScheduler(
        NoRescoring(),
        RecordingSource(LateCoin(engine), recorder),
        RecordingPublisher(engine, recorder),
        width=16,
        rows=8,
        groups=2,
    )
    with recorder.record(scheduler):
        drive(recorder, ArrayDataset({"task_id": np.arange(40)}, 4), range(5))
    trace = read_trace(recorder.path)
    pushing = [c for c in trace.calls if any(e.kind == "pushed" for e in c.events)]
    assert len(pushing) == len(trace.pushes) == len(trace.push_starts) == 5
    during = [
        session
        for (ended, version), began in zip(trace.pushes, trace.push_starts, strict=True)
        for session in trace.sessions.values()
        if began < session.ended < ended and session.session.calls[0].version == version
    ]
    assert during, "no rollout ended under a version being pushed: the test proves nothing"
    for call, began in zip(pushing, trace.push_starts, strict=True):
        assert began < call.handed_over
    result = replay(trace)
    assert result.matched, str(result)
    assert result.steps == 5


async def test_the_recorder_keeps_each_facade_to_its_own_calls(tmp_path, autojump_clock):
    engine = Served()

    def scheduler(recorder):
        return RolloutScheduler(
            NoRescoring(),
            RecordingSource(Coin(engine), recorder),
            RecordingPublisher(engine, recorder),
            width=16,
            rows=4,
            groups=2,
        )

    batch = {"task_id": np.arange(2)}
    recorder = Recorder(tmp_path / "thread.trace")
    with recorder.record(scheduler(recorder)):
        with pytest.raises(RuntimeError, match=r"call `recorder\(batch, variables, updates\)`"):
            await recorder.step(batch, None, 0)
    assert read_trace(recorder.path).calls == ()
    with pytest.raises(ValueError, match="a Recorder records one run"):
        with recorder.record(scheduler(recorder)):
            pass
    recorder = Recorder(tmp_path / "async.trace")
    async with recorder.record(scheduler(recorder)):
        with pytest.raises(RuntimeError, match=r"inside `async with` use `await recorder.step"):
            recorder(batch, None, 0)
    with pytest.raises(RuntimeError, match=r"only inside `recorder.record\(...\)`"):
        recorder(batch, None, 0)


# A tiny transformer whose final layer favours the digits: GuessDigit's rollouts then mostly
# guess, go on for several turns and earn varied rewards.
TINY = models.TransformerConfig(d_model=32, heads=2, layers=1, d_ff=64, max_len=64)


def guessing_params() -> dict:
    params = models.init(jax.random.key(0), TINY)
    params["ln_f"]["bias"] = jax.numpy.ones(TINY.d_model)
    params["unembed"] = params["unembed"].at[:, ord("0") : ord("9") + 1].add(0.2)
    return params


@pytest.fixture
def strict_promotion():
    """Strict promotion for every thread (the scheduler's and the engine's included)."""
    saved = (jax.config.jax_numpy_dtype_promotion, jax.config.jax_numpy_rank_promotion)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    yield
    jax.config.update("jax_numpy_dtype_promotion", saved[0])
    jax.config.update("jax_numpy_rank_promotion", saved[1])


@pytest.mark.medium
def test_a_real_engine_run_replays_without_the_engine(tmp_path, strict_promotion):
    """A RolloutServer samples GuessDigit episodes in the scheduler's trio run, the trainer
    pushes changed weights at every call and reopens its stream once; the replay, with no
    engine, no model and no environment, decides and packs exactly as the run did."""
    task = GuessDigit(max_turns=3, max_context=TINY.max_len)
    params = guessing_params()
    server = RolloutServer(TINY, params, slots=16)
    recorder = Recorder(tmp_path / "guess.trace")
    scheduler = RolloutScheduler(
        GRPOObjective(models.model(TINY)),
        RecordingSource(
            ServedSource(task.source(server, sampling=Sampling(seed=1)), server), recorder
        ),
        RecordingPublisher(server, recorder),
        width=TINY.max_len,
        rows=8,
        groups=2,
        oversample=1,
        max_lag=2,
        truncation="score",
    )
    with recorder.record(scheduler):
        drive(
            recorder,
            task.dataset(40, 2),
            range(5),
            reopen_at=3,
            variables=params,
            change=lambda variables: jax.tree.map(lambda x: x * 1.01, variables),
        )
    trace = read_trace(recorder.path)
    sessions = [s.session for s in trace.sessions.values() if s.outcome == "returned"]
    assert max(len(session.calls) for session in sessions) > 1
    assert len({session.reward for session in sessions}) > 1
    assert {call.version for session in sessions for call in session.calls} > {0}
    assert [v for _, v in trace.pushes] == list(range(5))
    assert any(e.kind == "reopened" for e in log(trace))

    result = replay(trace)
    assert result.matched, str(result)
    for recorded, replayed in zip(trace.calls, result.calls, strict=True):
        assert replayed.events == recorded.events
        assert real_clock_free(replayed.record) == real_clock_free(recorded.record)
        assert {k: v for k, v in replayed.arrays.items() if k != PROXIMAL} == {
            k: v for k, v in recorded.arrays.items() if k != PROXIMAL
        }
        # The run rescored under its weights; the replay has none (NoRescoring).
        assert replayed.arrays[PROXIMAL] != recorded.arrays[PROXIMAL]


@pytest.mark.slow
async def test_a_long_simulated_run_replays_bit_for_bit(autojump_clock, tmp_path):
    """200 steps with every way a submission can end, recorded then replayed exactly."""
    from dew.testing import assert_exactly_once, assert_replays, run_simulated

    config = SimulatedConfig(
        seed=5,
        duration_mean=3.0,
        infra_error=0.08,
        truncated=0.1,
        truncated_unscored=0.5,
        calls=(1, 3),
        prompt_tokens=(4, 12),
        completion_tokens=(2, 12),
    )
    trace = await run_simulated(
        tmp_path / "long.trace",
        updates=[step + step // 7 for step in range(200)],  # every 7th call two updates
        config=config,
        slots=16,
        width=64,
        rows=5,
        groups=3,
        oversample=1,
        timeout=9.0,
        truncation="score",
    )
    events = [e for call in trace.calls for e in call.events]
    seen = {(e.kind, e.reason) for e in events}
    for kind in [
        ("submitted", "infra_error"),
        ("submitted", "unscored"),
        ("submitted", "timeout"),
        ("discarded", "stale"),
        ("cancelled", "stale"),
        ("cancelled", "surplus"),
        ("cut", "no_room"),
    ]:
        assert kind in seen, kind
    assert any(e.kind == "abandoned" for e in events)
    assert_exactly_once(events)
    result = await assert_replays(trace)
    assert result.steps == 200 and result.groups == sum(c.record.groups for c in trace.calls)
