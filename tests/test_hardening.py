"""Nothing fails silently: the scheduler's refusals, reports and clean-ups at its edges.

One test (or a few) per numbered item of issue 10, each of which failed before its fix: token ids
outside the vocabulary, a run that trains on nothing, errors kept with their text, metrics that
are numbers, collaborators and sizes checked at construction, calls from the future, float
options that must be finite, a scheduler dropped without close(), and a KeyboardInterrupt that
comes out as itself. Scheduler tests run under trio's autojump clock.
"""

from __future__ import annotations

import gc
import gzip
import importlib.abc
import inspect
import io
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import weakref

import attrs
import jax
import numpy as np
import optax
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dew
from _scripted import CONFIG, OBJECTIVE, PARAMS, ROWS, WIDTH, Engine, Scripted, dataset
from dew import cli
from dew.data import Task
from dew.envs import SimulatedConfig
from dew.objectives.rl.scheduler import RolloutScheduler, task_ids
from dew.objectives.rl.sessions import (
    Call,
    Label,
    Session,
    SessionError,
    Status,
    check_session,
    pack,
    session_metrics,
)
from dew.replay import TraceError, read_trace, replay
from dew.testing import assert_exactly_once, run_simulated
from dew.train import Progress, Trainer
from dew.train._checkpoint import read_commit
from dew.train._interrupt import _CtrlC, _Interrupted


def scheduler(source, engine, **kwargs) -> RolloutScheduler:
    for name, default in [("width", WIDTH), ("rows", ROWS), ("groups", 2), ("ahead", 0)]:
        kwargs.setdefault(name, default)
    kwargs.setdefault("max_lag", kwargs["ahead"])
    return RolloutScheduler(OBJECTIVE, source, engine, **kwargs)


async def steps(sched: RolloutScheduler, data, count: int, *, start: int = 0):
    """Hand over `count` batches one after the other; return the records."""
    stream = sched.tasks(data).stream(start)
    records = []
    for updates in range(count):
        await sched.step(next(stream), PARAMS, updates)
        records.append(sched.last_record)
    return records


def session(*, prompt=(1, 2), completion=(3, 4), version=0, **fields) -> Session:
    completion = np.array(completion, np.int32)
    call = Call(
        np.array(prompt, np.int32), completion, np.full(len(completion), -0.5, np.float32), version
    )
    fields.setdefault("status", Status.COMPLETED)
    fields.setdefault("reward", 1.0)
    return Session(calls=(call,), **fields)


class Returning:
    """A source whose every rollout takes one second and returns `make(task, label)`, its calls
    under the version `engine` served at the rollout's start."""

    def __init__(self, make, engine: Engine):
        self.make, self.engine = make, engine

    async def run(self, task: Task, label: Label) -> Session:
        version = self.engine.version
        await trio.sleep(1.0)
        made = self.make(task, label)
        return attrs.evolve(made, calls=[attrs.evolve(c, version=version) for c in made.calls])


# 1. Token ids outside the vocabulary --------------------------------------------------------------


@pytest.mark.parametrize("field", ["prompt", "completion"])
def test_check_session_refuses_token_ids_at_or_above_the_vocabulary(field):
    stamped = dict(task=Task("t"), label=Label(1, 2, 0))
    bad = session(**{field: (1, 32)}, **stamped)
    assert check_session(bad) is bad  # without a vocabulary there is nothing to check against
    with pytest.raises(SessionError, match=rf"'t' group 1 sample 2 attempt 0: calls\[0\]\.{field}"):
        check_session(bad, vocab=32)
    with pytest.raises(SessionError, match="token id 32 outside the vocabulary of 32"):
        check_session(bad, vocab=32)
    check_session(session(**{field: (1, 31)}, **stamped), vocab=32)


async def test_the_scheduler_refuses_a_token_id_beyond_its_vocab(autojump_clock):
    """The scheduler knows the vocabulary through its `vocab` argument: a source that returns
    an id the model cannot score is broken, named by task, label and field, rather than turned
    into NaN log-probs by the rescoring."""
    engine = Engine()
    source = Returning(lambda task, label: session(completion=(3, CONFIG.vocab)), engine)
    async with scheduler(source, engine, vocab=CONFIG.vocab) as sched:
        with pytest.raises(SessionError, match=r"task '0' group 0 sample \d attempt 0: calls"):
            await steps(sched, dataset(1), 1)


@pytest.mark.parametrize("vocab", [0, -1, 2.5, True, "32"])
def test_vocab_must_be_a_positive_int(vocab):
    with pytest.raises(ValueError, match="vocab"):
        scheduler(Scripted(Engine()), Engine(), vocab=vocab)


# 2. A run that trains on nothing ------------------------------------------------------------------


async def test_a_chain_longer_than_a_row_is_reported_at_its_first_occurrence(
    autojump_clock, caplog
):
    engine = Engine()
    source = Returning(lambda task, label: session(completion=tuple(range(1, 31)) * 3), engine)
    async with scheduler(source, engine, empty_streak=None) as sched:
        stream = sched.tasks(dataset(3)).stream(0)
        for updates in range(2):
            await sched.step(next(stream), PARAMS, updates)
            assert sched.last_record.cut == 2
    reports = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(reports) == 1, reports  # at its first occurrence, once
    assert "task '0' group 0 sample 0 attempt 0: a chain of 92 tokens" in reports[0]
    assert "longer than a row (width 64)" in reports[0]


async def test_calls_that_train_on_nothing_warn_with_the_counts_once_per_streak(
    autojump_clock, caplog
):
    engine = Engine()

    # Tasks 0..11 (batches 0..5) always fail, 12..13 (batch 6) complete, scored unalike (a
    # group that scored alike trains nothing either), 14.. fail again.
    def make(task, label):
        if 12 <= int(task.name) < 14:
            return session(reward=float(label.sample))
        return session(status=Status.INFRA_ERROR, reward=None, error="OSError: no sandbox")

    warned = []
    async with scheduler(Returning(make, engine), engine, max_attempts=1, empty_streak=3) as sched:
        stream = sched.tasks(dataset(10)).stream(0)
        for updates in range(10):
            caplog.clear()
            await sched.step(next(stream), PARAMS, updates)
            warned += [
                (updates, r.getMessage()) for r in caplog.records if r.levelname == "WARNING"
            ]
    assert [updates for updates, _ in warned] == [2, 9]
    text = warned[0][1]
    assert "3 calls in a row trained on nothing (updates 0..2)" in text
    assert "abandoned 6" in text and "'OSError: no sandbox' x6" in text


@pytest.mark.parametrize("streak", [0, -1, 1.5, "3"])
def test_empty_streak_must_be_a_positive_int_or_none(streak):
    with pytest.raises(ValueError, match="empty_streak"):
        scheduler(Scripted(Engine()), Engine(), empty_streak=streak)


# 3. Errors keep their text ------------------------------------------------------------------------


async def test_a_failed_submission_keeps_its_error_in_the_log_and_status(autojump_clock):
    engine = Engine()

    def make(task, label):
        if task.name == "0" and label.sample == 0:
            return session(status=Status.INFRA_ERROR, reward=None, error="KeyError: 'answer'")
        if task.name == "1" and label.sample == 0 and label.attempt == 0:
            return session(status=Status.INFRA_ERROR, reward=None, error="E" * 10_000)
        return session()

    async with scheduler(Returning(make, engine), engine, empty_streak=None) as sched:
        await steps(sched, dataset(2), 1)
        failed = [e for e in sched.last_events if e.kind == "failed"]
        assert [e.error for e in failed if e.task == "0"] == ["KeyError: 'answer'"] * 3
        (long,) = [e.error for e in failed if e.task == "1"]
        assert long.startswith("EEE") and len(long) <= 300
        errors = sched.status().errors
        assert errors[0] == ("KeyError: 'answer'", 3)
        assert errors[1][1] == 1
        assert "3x KeyError: 'answer'" in str(sched.status())


# 4. Metrics are numbers ---------------------------------------------------------------------------


def test_session_metrics_of_nothing_leave_undefined_figures_out():
    metrics = session_metrics([], pack([], width=8, rows=2), version=3)
    assert metrics == {"tokens/trained": 0.0, "fill": 0.0}


async def test_every_figure_of_a_record_is_a_finite_float_or_left_out(autojump_clock):
    """A call that admits nothing has no reward to average: its record leaves `reward/mean`
    and `reward/correct` out (never None, NaN or a made-up 0.0), like every undefined figure."""
    engine = Engine()

    def make(task, label):
        if int(task.name) >= 2:
            return session(status=Status.INFRA_ERROR, reward=None, error="OSError: gone")
        return session(reward=0.5, components={"correct": 1.0})

    async with scheduler(Returning(make, engine), engine, max_attempts=1) as sched:
        first, second = await steps(sched, dataset(2), 2)
    assert (first.metrics["reward/mean"], first.metrics["reward/correct"]) == (0.5, 1.0)
    assert first.metrics["lag/token_max"] == 0.0
    assert second.groups == 0
    assert second.metrics == {"tokens/trained": 0.0, "fill": 0.0}
    for record in (first, second):
        assert all(type(v) is float and math.isfinite(v) for v in record.metrics.values())


# 5. Collaborators are checked at construction -----------------------------------------------------


class SyncSource:
    def run(self, task, label):
        return session()


@pytest.mark.parametrize(
    "change, culprit",
    [
        ({"source": object()}, "source"),
        ({"source": None}, "source"),
        ({"source": SyncSource()}, "source"),
        ({"weights": object()}, "weights"),
        ({"objective": object()}, "objective"),
        ({"tasks": 42}, "tasks"),
        ({"log": 42}, "log"),
    ],
)
def test_collaborators_are_checked_at_construction(change, culprit):
    engine = Engine()
    args = {"objective": OBJECTIVE, "source": Scripted(engine), "weights": engine, **change}
    with pytest.raises(TypeError, match=rf"^{culprit} must"):
        RolloutScheduler(**args, width=WIDTH, rows=ROWS)


# 6. Absurd sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        ({"groups": 10**12}, "groups"),
        ({"groups": 100_000, "rows": 8, "width": 64}, "groups"),
        ({"groups": 4, "oversample": 10**9}, "oversample"),
        ({"width": 10**15}, "width"),
        ({"rows": 10**9, "width": 1024}, r"rows \* width"),
        ({"timeout": math.inf}, "timeout"),
        ({"support_capacity": 10**12}, "support_capacity"),
    ],
)
def test_sizes_that_cannot_work_are_refused_at_construction(kwargs, culprit):
    args = {"width": WIDTH, "rows": ROWS, **kwargs}
    with pytest.raises(ValueError, match=rf"^{culprit} must"):
        RolloutScheduler(OBJECTIVE, Scripted(Engine()), Engine(), **args)


@pytest.mark.slow
async def test_a_task_batch_too_large_to_keep_in_flight_is_refused(autojump_clock):
    engine = Engine()
    async with scheduler(Scripted(engine), engine, groups=64, width=64, rows=64) as sched:
        huge = {"task_id": np.arange(20_000)}
        with pytest.raises(ValueError, match="tasks per batch"):
            await sched.step(huge, PARAMS, 0)


# 7. A call from the future ------------------------------------------------------------------------


async def test_a_call_newer_than_any_version_served_is_refused(autojump_clock):
    class Ahead(Engine):
        def load(self, variables, version):
            super().load(variables, version)
            self.version = version + 99  # reports a version nobody pushed

    engine = Ahead()
    async with scheduler(Scripted(engine), engine) as sched:
        with pytest.raises(SessionError, match="version 99, newer than the newest version 0"):
            await steps(sched, dataset(1), 1)


# 8. Float options are finite ----------------------------------------------------------------------


def float_options():
    """(command, option) for every float option of every `dew` command."""
    top = cli.parser()
    (commands,) = [a for a in top._actions if a.choices and isinstance(a.choices, dict)]
    return [
        (name, action.option_strings[0])
        for name, sub in commands.choices.items()
        for action in sub._actions
        if action.option_strings
        and getattr(action.type, "__name__", "") in ("finite_float", "number")
    ]


def test_every_float_option_is_checked():
    found = float_options()
    assert ("simulate", "--step-time") in found
    assert len(found) >= 3


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_dew_simulate_refuses_a_non_finite_step_time(value, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["simulate", "--smoke", "--step-time", value])
    assert exit.value.code == 2
    assert "--step-time" in capsys.readouterr().err


def test_every_float_option_of_every_command_refuses_infinity(capsys):
    for command, option in float_options():
        with pytest.raises(SystemExit) as exit:
            cli.main([command, option, "inf"])
        assert exit.value.code == 2, (command, option)
        assert "must be a finite number" in capsys.readouterr().err, (command, option)


# 16. KeyboardInterrupt and SystemExit come out as themselves --------------------------------------


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
async def test_a_stop_raised_inside_a_source_comes_out_as_itself_once(stop, autojump_clock):
    class Stopping:
        async def run(self, task, label):
            await trio.sleep(1.0)
            raise stop("stop here")

    with pytest.raises(stop, match="stop here") as raised:
        async with scheduler(Stopping(), Engine()) as sched:
            await steps(sched, dataset(2), 1)
    assert type(raised.value) is stop


# Hypothesis: every constructor combination runs or is refused naming an argument ----------------

PARAMETERS = tuple(inspect.signature(RolloutScheduler).parameters)
# Values no size or setting takes: each must be refused naming the argument it was given to.
JUNK = st.sampled_from([0, -1, -(10**12), 10**12, True, 1.5, math.nan, math.inf, "2", object()])
VALID = {
    "width": st.sampled_from([16, 64]),
    "rows": st.sampled_from([2, 8]),
    "groups": st.integers(1, 4),
    "oversample": st.integers(0, 2),
    "admit": st.none() | st.integers(1, 3) | st.just("auto"),
    "max_lag": st.integers(0, 3),
    "ahead": st.integers(0, 2),
    "sync_every": st.integers(1, 2),
    "max_attempts": st.integers(1, 3),
    "timeout": st.none() | st.floats(0.5, 5.0),
    "estimator": st.sampled_from(["group", "mean", "rloo"]),
    "truncation": st.sampled_from(["mask", "score", "zero"]),
    "support_capacity": st.none() | st.integers(1, 8),
    "vocab": st.none() | st.integers(CONFIG.vocab, 64),
    "empty_streak": st.none() | st.integers(1, 5),
    "filter_uniform": st.booleans(),
    # The objective has no KL term: a reference is refused, naming it.
    "reference": st.none(),
    # Needs admit: without it, refused naming carry_over.
    "carry_over": st.booleans(),
    "waste_budget": st.sampled_from([0.0, 0.2, 0.5]),
    "hedge": st.booleans(),
    "narrow": st.booleans(),
    "align_starts": st.none() | st.integers(1, 8),
}
# Collaborators: what each is when valid, and what it may be instead.
COLLABORATORS = {
    "objective": ("objective", [object(), None]),
    "source": ("scripted", [None, object(), 42]),
    "weights": ("engine", [object()]),
    "tasks": ("task_ids", [42, None]),
    "log": ("append", [42, "log"]),
}


@st.composite
def constructor_arguments(draw) -> tuple[dict, frozenset[str]]:
    """Every argument valid on its own but for up to two spoiled ones; which were spoiled."""
    spoiled = draw(st.sets(st.sampled_from(PARAMETERS), max_size=2))
    engine = Engine()
    made = {
        "objective": OBJECTIVE,
        "scripted": Scripted(engine),
        "engine": engine,
        "task_ids": task_ids,
        "append": [].append,
    }
    kwargs = {}
    for name in PARAMETERS:
        if name in COLLABORATORS:
            valid, junk = COLLABORATORS[name]
            kwargs[name] = draw(st.sampled_from(junk)) if name in spoiled else made[valid]
        else:
            kwargs[name] = draw(JUNK if name in spoiled else VALID[name])
    return kwargs, frozenset(spoiled)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(constructor_arguments())
def test_every_constructor_combination_runs_or_is_refused_naming_an_argument(drawn):
    kwargs, spoiled = drawn
    try:
        sched = RolloutScheduler(**kwargs)
    except (ValueError, TypeError) as error:
        # Named by the argument at fault, or by one of a combination that cannot work (max_lag
        # below ahead + sync_every - 1, rows * width, groups + oversample).
        assert str(error).split()[0] in PARAMETERS, error
        return
    # Some junk is a valid value for some arguments (0 oversample, a float timeout).
    assert not spoiled & set(COLLABORATORS), spoiled
    sched.long_wait = None

    async def one_step():
        async with sched:
            stream = sched.tasks(dataset(4, 3)).stream(0)
            batches = [next(stream) for _ in range(sched.ahead + 1)]
            return await sched.step(batches[0], PARAMS, 0)

    try:
        batch = trio.run(one_step, clock=trio.testing.MockClock(autojump_threshold=0))
    except ValueError as error:  # admit beyond the task batch is known at the first batch
        assert str(error).startswith("admit must"), error
        return
    rows, width = batch["tokens"].shape
    if kwargs["narrow"]:  # as narrow as the tokens allow, in the same cells
        assert rows * width == kwargs["rows"] * kwargs["width"] and kwargs["width"] % width == 0
    else:
        assert (rows, width) == (kwargs["rows"], kwargs["width"])
    assert sched.last_record.updates == 0


# Hypothesis: a malformed session is refused naming its field, and the scheduler stays sound ------


def corrupt(session: Session, how: str) -> tuple[Session, str]:
    """session broken one way; returns it and the field the refusal must name."""
    call = session.calls[0]
    calls = {
        "negative token": ("calls[0].prompt", {"prompt": np.array([1, -3], np.int32)}),
        "token beyond vocab": ("calls[0].completion", {"completion": np.array([1, 99], np.int32)}),
        "int64 tokens": ("calls[0].prompt", {"prompt": call.prompt.astype(np.int64)}),
        "2-D tokens": ("calls[0].completion", {"completion": call.completion[None]}),
        "short logprobs": ("calls[0].logprobs", {"logprobs": call.logprobs[:1]}),
        "positive logprob": ("calls[0].logprobs", {"logprobs": np.full(2, 0.5, np.float32)}),
        "nan logprob": ("calls[0].logprobs", {"logprobs": np.full(2, np.nan, np.float32)}),
        "negative version": ("calls[0].version", {"version": -1}),
        "float version": ("calls[0].version", {"version": 1.0}),
    }
    if how in calls:
        field, changes = calls[how]
        return attrs.evolve(session, calls=(attrs.evolve(call, **changes),)), field
    fields = {
        "nan reward": ("reward", {"reward": math.nan}),
        "missing reward": ("reward", {"reward": None}),
        "inf component": ("components['correct']", {"components": {"correct": math.inf}}),
        "truncated without reason": ("truncation", {"status": Status.TRUNCATED}),
        "string status": ("status", {"status": "completed"}),
        "not a call": ("calls[0]", {"calls": ("call",)}),
        "error not text": ("error", {"error": ValueError("boom")}),
    }
    field, changes = fields[how]
    return attrs.evolve(session, **changes), field


CORRUPTIONS = [
    "negative token",
    "token beyond vocab",
    "int64 tokens",
    "2-D tokens",
    "short logprobs",
    "positive logprob",
    "nan logprob",
    "negative version",
    "float version",
    "nan reward",
    "missing reward",
    "inf component",
    "truncated without reason",
    "string status",
    "not a call",
    "error not text",
]


@settings(max_examples=40, deadline=None)
@given(
    how=st.sampled_from(CORRUPTIONS),
    task=st.integers(0, 5),
    sample=st.integers(0, 1),
    delay=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_a_malformed_session_is_refused_naming_its_field_and_the_scheduler_stays_sound(
    how, task, sample, delay
):
    engine = Engine()
    field = corrupt(session(), how)[1]
    in_flight = set()

    class Malformed:
        async def run(self, t, label):
            in_flight.add(label)
            try:
                version = engine.version
                await trio.sleep(delay if (int(t.name), label.sample) == (task, sample) else 1.0)
                good = session(version=version)
                if (int(t.name), label.sample) == (task, sample):
                    return corrupt(good, how)[0]
                return good
            finally:
                in_flight.discard(label)

    sched = scheduler(Malformed(), engine, vocab=CONFIG.vocab, ahead=1)
    sched.long_wait = None

    events = []

    async def run():
        async with sched:
            stream = sched.tasks(dataset(4, 2)).stream(0)
            queue = [next(stream), next(stream)]
            with pytest.raises(SessionError) as refused:
                for updates in range(3):
                    try:
                        await sched.step(queue.pop(0), PARAMS, updates)
                    finally:
                        events.extend(sched.last_events)
                    queue.append(next(stream))
                    await trio.sleep(1.0)
            assert f"task '{task}' group {task} sample {sample} attempt 0: {field}" in str(
                refused.value
            )
            # Sound: the next call says why it cannot go on, status() still answers.
            with pytest.raises(RuntimeError, match="an earlier call failed: SessionError"):
                await sched.step(queue.pop(0), PARAMS, 3)
            assert sched.status().updates is not None
        events.extend(sched.closing_events)

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert not in_flight, in_flight
    assert assert_exactly_once(events) == frozenset()


# 15. A scheduler dropped unclosed frees its thread and rollouts ---------------------------------


def test_a_scheduler_dropped_unclosed_frees_its_thread_and_rollouts_with_a_resource_warning():
    """On the real clock, from the trainer's thread: batch 0's rollouts finish at once, batch
    1's (submitted ahead) run until cancelled. Dropping the scheduler after the first call
    cancels them and ends its thread; nothing else holds the scheduler."""
    engine = Engine()
    cancelled = []

    class Hanging:
        async def run(self, task, label):
            if int(task.name) < 2:
                return session(version=engine.version)
            try:
                await trio.sleep_forever()
            except trio.Cancelled as stop:
                cancelled.append((label, stop.reason))
                raise

    sched = RolloutScheduler(
        OBJECTIVE, Hanging(), engine, width=WIDTH, rows=ROWS, groups=2, ahead=1
    )
    stream = sched.tasks(dataset(3)).stream(0)
    first = next(stream)
    next(stream)
    sched(first, PARAMS, 0)
    thread, collected = sched._thread, weakref.ref(sched)
    assert thread.is_alive() and not cancelled
    with pytest.warns(ResourceWarning, match="dropped unclosed with 4 rollouts in flight"):
        del sched
        gc.collect()
    assert collected() is None
    assert not thread.is_alive()
    assert sorted(reason for _, reason in cancelled) == ["closed"] * 4


def test_a_closed_or_never_started_scheduler_is_collected_without_a_warning():
    engine = Engine()
    unused = scheduler(Scripted(engine), engine)
    del unused  # filterwarnings=error: a warning here fails the test
    closed = scheduler(Scripted(engine), engine)
    closed.close()
    del closed
    gc.collect()


def test_a_stop_raised_inside_a_source_reaches_the_trainers_thread_as_itself():
    engine = Engine()

    class Stopping:
        async def run(self, task, label):
            raise KeyboardInterrupt("stop here")

    with RolloutScheduler(OBJECTIVE, Stopping(), engine, width=WIDTH, rows=ROWS, groups=2) as sched:
        stream = sched.tasks(dataset(2)).stream(0)
        with pytest.raises(KeyboardInterrupt, match="stop here") as raised:
            sched(next(stream), PARAMS, 0)
    assert type(raised.value) is KeyboardInterrupt


# 1 and 3, in the trainer and the trace ------------------------------------------------------------


def nan_rollout(batch, variables, updates):
    """A rollout whose packed rows carry a NaN advantage at a trained token."""
    groups = [
        [
            session(reward=r).stamped(Task("0"), Label(0, i, 0), 0.0, 1.0)
            for i, r in enumerate((0.0, 1.0))
        ]
    ]
    packed = pack(groups, width=WIDTH, rows=ROWS).batch
    packed["advantages"] = np.where(packed["loss_mask"] > 0, np.nan, 0.0).astype(np.float32)
    packed["proximal_logprobs"] = OBJECTIVE.packed_log_probs(variables, packed)
    return packed


@pytest.mark.slow
def test_a_non_finite_loss_stops_training_before_anything_is_written(tmp_path):
    trainer = Trainer(OBJECTIVE, optax.sgd(1e-3), PARAMS, directory=tmp_path, checkpoint_every=1)
    with pytest.raises(FloatingPointError, match="step 0: loss nan"):
        trainer.run(nan_rollout, dataset(2), steps=2)
    assert trainer.updates == 0
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()
    for new, old in zip(jax.tree.leaves(trainer.variables), jax.tree.leaves(PARAMS), strict=True):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    assert trainer.resume() is None  # no checkpoint of NaN weights


def test_the_progress_line_shows_the_most_frequent_error():
    out = io.StringIO()
    progress = Progress(2, out=out, tty=False, lines=2)
    progress({"updates": 1, "errors": {"KeyError: 'answer'": 3, "OSError: gone": 1}})
    assert "errors: 3x KeyError: 'answer'" in out.getvalue()
    progress({"updates": 2})
    assert out.getvalue().count("errors:") == 1


async def test_a_trace_keeps_each_failed_submissions_error(tmp_path, autojump_clock):
    config = SimulatedConfig(seed=1, infra_error=0.3)
    trace = await run_simulated(
        tmp_path / "run.trace", updates=range(3), config=config, width=96, rows=6
    )
    errors = [e.error for call in trace.calls for e in call.events if e.kind == "failed"]
    assert errors and all(e.startswith("simulated infrastructure error") for e in errors)
    assert trace.config["vocab"] is None and trace.config["empty_streak"] == 5


# 9 and 10: `dew train --record` refuses a path before anything is written -------------------------


@pytest.mark.parametrize("where", ["existing trace", "folder", "missing folder"])
def test_dew_train_refuses_a_record_path_before_writing_anything(where, tmp_path, capsys):
    trace = tmp_path / "old.trace"
    trace.write_text("an earlier run's trace\n")
    record = {
        "existing trace": trace,
        "folder": tmp_path,
        "missing folder": tmp_path / "nowhere" / "run.trace",
    }[where]
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--run", str(run), "--steps", "1", "--record", str(record)])
    assert exit.value.code == 2
    assert "--record" in capsys.readouterr().err
    assert not run.exists()
    assert trace.read_text() == "an earlier run's trace\n"


@pytest.mark.parametrize("where", ["a file", "under a file", "unwritable"])
def test_dew_train_refuses_a_run_folder_it_cannot_write_before_writing_anything(
    where, tmp_path, capsys
):
    file = tmp_path / "notes.txt"
    file.write_text("not a folder\n")
    # /proc takes no new entry, even from root, whom permission bits do not stop.
    run = {"a file": file, "under a file": file / "run", "unwritable": "/proc/dew-run/sub"}[where]
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--run", str(run), "--steps", "1"])
    assert exit.value.code == 2
    captured = capsys.readouterr()
    assert f"--run {run}" in captured.err and "Traceback" not in captured.err
    assert {"a file": "is a file, not a folder", "under a file": f"{file} is a file"}.get(
        where, "nothing can be written in /proc"
    ) in captured.err
    assert captured.out == ""
    assert file.read_text() == "not a folder\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("where", ["under a file", "unwritable"])
def test_dew_train_refuses_a_record_path_it_cannot_write(where, tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("not a folder\n")
    record = {"under a file": file / "run.trace", "unwritable": "/proc/run.trace"}[where]
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--run", str(run), "--steps", "1", "--record", str(record)])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"--record {record}" in err
    assert (f"{file} is a file" if where == "under a file" else "nothing can be written") in err
    assert not run.exists()


# 11: a damaged run folder is refused naming the file, before anything starts ---------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A one-step run folder with its checkpoint."""
    run = tmp_path_factory.mktemp("runs") / "run"
    options = ["--steps", "2", "--checkpoint-every", "1", "--batch-size", "2", "--groups", "2"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as test_train.py says
        cli.main(["train", "--run", str(run), *options])
    return run


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["checkpoint.json", "npz", "config.json"])
def test_resuming_a_damaged_run_names_the_file_before_starting(
    damage, trained_run, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    capsys.readouterr()
    checkpoints = run / "checkpoints"
    target = {
        "checkpoint.json": checkpoints / "checkpoint.json",
        "npz": next(checkpoints.glob("*.npz")),
        "config.json": run / "config.json",
    }[damage]
    target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--run", str(run), "--resume", "--steps", "3"])
    assert exit.value.code == 2
    captured = capsys.readouterr()
    assert f"{target} is damaged" in captured.err
    assert "resuming" not in captured.out and "dew train:" not in captured.out


@pytest.mark.slow
def test_resuming_with_the_earlier_runs_trace_refuses_to_overwrite_it(
    trained_run, tmp_path, capsys
):
    """Item 10: a resumed run records a trace of its own; the earlier one is never truncated."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    trace = tmp_path / "run.trace"
    trace.write_text("the first run's trace\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--run", str(run), "--resume", "--steps", "3", "--record", str(trace)])
    assert exit.value.code == 2
    captured = capsys.readouterr()
    assert f"--record {trace} already exists and would be overwritten" in captured.err
    assert "resuming" not in captured.out
    assert trace.read_text() == "the first run's trace\n"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2  # the run is untouched


# 12: a hostile file is a TraceError naming file and line, exit 2, read in bounded memory ---------


def record_simulated(path, start: float = 0.0):
    """Record a six-call simulated run (infra errors, truncations) to path on a mock clock that
    reads `start` when the recording begins."""
    config = SimulatedConfig(seed=2, infra_error=0.1, truncated=0.2, completion_tokens=(4, 16))

    async def main():
        await trio.sleep(start)
        return await run_simulated(
            path, updates=range(6), config=config, width=96, rows=6, groups=3, ahead=1, max_lag=1
        )

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.fixture(scope="module")
def simulated_trace(tmp_path_factory):
    """The path of record_simulated's trace."""
    path = tmp_path_factory.mktemp("trace") / "run.trace"
    record_simulated(path)
    return path


def header_with(trace, **config) -> bytes:
    """The trace's header line with `config` written over its configuration."""
    header = json.loads(trace.read_bytes().split(b"\n", 1)[0])
    header["config"].update(config)
    return json.dumps(header).encode() + b"\n"


# (what the file holds, the line named, what the problem says)
HOSTILE = {
    "deep nesting": (lambda t: header_with(t) + b"[" * 100_000 + b"]" * 100_000 + b"\n", 2,
                     "nests too deeply"),
    "invalid utf-8": (lambda t: header_with(t) + b'{"kind": "push\xff\xfe"}\n', 2,
                      "is not UTF-8 text (byte 0xff at column 15)"),
    "binary": (lambda t: np.random.default_rng(0).bytes(4096), 1, "not a dew trace"),
    "a run's config.json": (lambda t: json.dumps({"task": "copy", "steps": 4}, indent=1).encode(),
                            1, "is not a dew trace: its first line is not JSON"),
    "a JSON line": (lambda t: b'{"task": "copy"}\n', 1, "is not a dew trace: a trace's first line"),
    "a huge number": (lambda t: header_with(t) + b'{"kind": ' + b"9" * 10_000 + b"}\n", 2,
                      "is not JSON a trace can hold"),
    "damaged gzip": (lambda t: b"\x1f\x8b\x08\x00" + np.random.default_rng(0).bytes(200), 1,
                     "is damaged gzip data"),
    "groups=1e9": (lambda t: header_with(t, groups=1e9), 1, "groups must be an int"),
    "groups=10**9": (lambda t: header_with(t, groups=10**9), 1, "groups must be <="),
    "width=1e12": (lambda t: header_with(t, width=1e12), 1, "width must be an int"),
    "width=10**12": (lambda t: header_with(t, width=10**12), 1, "width must be <= 1048576"),
}  # fmt: skip


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_hostile_file_is_a_trace_error_naming_its_file_and_line(
    hostile, simulated_trace, tmp_path, capsys
):
    make, line, problem = HOSTILE[hostile]
    path = tmp_path / "hostile.trace"
    content = make(simulated_trace)
    if hostile.startswith(("groups", "width")):  # the header, then the run's own lines
        content += simulated_trace.read_bytes().split(b"\n", 1)[1]
    path.write_bytes(content)
    assert cli.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dew replay: {path}:{line}: ") and problem in err, err
    assert len(err.splitlines()) == 1


def test_an_endless_file_is_refused_after_max_line_bytes(capsys):
    # /dev/zero is one endless line: it is refused once MAX_LINE bytes were read, not read on.
    assert cli.main(["replay", "/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dew replay: /dev/zero:1: is longer than 268435456 bytes"), err
    with pytest.raises(TraceError, match="is longer than"):
        read_trace("/dev/zero")


# 13: a killed run's trace replays up to its last complete call -----------------------------------


def read_bytes(path) -> bytes:
    """A file's bytes, decompressed if it is gzip."""
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def cut_after(trace, calls: int, partial: bytes = b"") -> bytes:
    """The trace's bytes as a run killed after its `calls`-th call line wrote them, and
    `partial`, the start of a line the kill cut."""
    lines = read_bytes(trace).split(b"\n")
    at = [i for i, line in enumerate(lines) if line.startswith(b'{"kind":"call"')][calls - 1]
    return b"\n".join(lines[: at + 1]) + b"\n" + partial


@pytest.mark.parametrize("partial", [b"", b'{"kind":"session","task":{"na'])
@pytest.mark.parametrize("calls", [1, 4])
def test_a_killed_runs_trace_replays_up_to_its_last_call(
    calls, partial, simulated_trace, tmp_path, capsys
):
    path = tmp_path / "killed.trace"
    path.write_bytes(cut_after(simulated_trace, calls, partial))
    lines = len(path.read_bytes().split(b"\n")) - 1
    with pytest.raises(TraceError, match="cut off"):
        read_trace(path)  # whole traces only, unless asked
    trace = read_trace(path, partial=True)
    assert len(trace.calls) == calls and trace.end == trace.calls[-1].returned
    result = replay(path)
    assert result.matched, str(result)
    assert result.steps == calls
    assert (
        result.cut
        == f"the trace ends at line {lines}"
        + (f" (line {lines + 1} is cut partway)" if partial else "")
        + " without its end line"
    )
    assert cli.main(["replay", str(path), "--progress-every", "0"]) == 3
    captured = capsys.readouterr()
    assert (
        f"the recording was cut off: {result.cut}; replayed as far as it goes, {calls} calls"
        in (captured.out)
    )
    assert f"dew replay: step {calls}/{calls} replayed" in captured.err


def test_a_killed_runs_trace_that_diverges_says_where(simulated_trace, tmp_path, capsys):
    path = tmp_path / "killed.trace"
    path.write_bytes(cut_after(simulated_trace, 4))
    assert cli.main(["replay", str(path), "--max-attempts", "1"]) == 1
    out = capsys.readouterr().out
    assert "replay diverged at step" in out and "the recording was cut off" in out


# 14: gzip traces, progress on long replays, times from the run's start ---------------------------


def test_a_gz_trace_is_compressed_and_replays(simulated_trace, tmp_path):
    path = tmp_path / "run.trace.gz"
    trace = record_simulated(path)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    # The same lines (rollouts cancelled at one instant by the close may come in any order).
    lines = sorted(gzip.decompress(path.read_bytes()).splitlines())
    assert lines == sorted(simulated_trace.read_bytes().splitlines())
    assert path.stat().st_size < simulated_trace.stat().st_size / 3
    assert len(trace.calls) == 6
    result = replay(path)
    assert result.matched and result.cut is None, str(result)


@pytest.mark.parametrize("kept", [0.4, 0.8])
def test_a_killed_runs_gz_trace_replays_as_far_as_its_stream_goes(kept, tmp_path):
    # A gz trace flushes each line as a whole block: cut anywhere, it reads up to the cut.
    whole = tmp_path / "whole.trace.gz"
    record_simulated(whole)
    compressed = whole.read_bytes()
    cut = tmp_path / "killed.trace.gz"
    cut.write_bytes(compressed[: int(len(compressed) * kept)])
    result = replay(cut)
    assert result.matched, str(result)
    assert 0 < result.steps < 6 and "without its end line" in result.cut


def test_progress_lines_go_to_stderr_and_divergence_times_count_from_the_start(
    simulated_trace, tmp_path, capsys
):
    # A recording that starts at 1000 s, as a real-clock one starts far from 0.
    path = tmp_path / "late.trace"
    trace = record_simulated(path, start=1000.0)
    assert trace.start == 1000.0
    assert cli.main(["replay", str(path), "--max-attempts", "1", "--progress-every", "0"]) == 1
    captured = capsys.readouterr()
    progress = captured.err.splitlines()
    assert [line.split(",")[0] for line in progress] == [
        f"dew replay: step {step}/6 replayed" for step in range(1, 7)
    ]
    time = replay(path, max_attempts=1).divergence.time
    assert f"{time - 1000.0:.6g}s into the run (time {time!r})" in captured.out
    # --progress-every 5 on a replay of milliseconds: only the last call's line.
    assert cli.main(["replay", str(simulated_trace)]) == 0
    last = read_trace(simulated_trace).calls[-1].returned
    assert capsys.readouterr().err.splitlines() == [
        f"dew replay: step 6/6 replayed, {last:.6g}s into the run"
    ]


# 13 and 17, for real: `dew train` killed, and stopped with Ctrl-C --------------------------------

TINY = ["--batch-size", "2", "--groups", "2", "--samples", "0", "--d-model", "16", "--layers", "1"]
TINY += ["--d-ff", "32", "--heads", "2"]


def start_training(run, *options) -> subprocess.Popen:
    """`dew train` of a tiny model in a process of its own, for 100 steps (a progress line every
    5), its output piped."""
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(dew.__file__).parents[1])}
    command = [sys.executable, "-m", "dew", "train", "--run", str(run), "--steps", "100", *TINY]
    return subprocess.Popen(
        [*command, *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def wait_for(stream, start: str) -> str:
    """Read `stream` up to the first line that starts with `start`; return that line."""
    for line in stream:
        if line.startswith(start):
            return line
    raise AssertionError(f"the stream ended before a line starting with {start!r}")


def test_ctrl_c_while_the_library_imports_ends_with_one_line(monkeypatch, capsys):
    """The console command's entry point runs before JAX and the rest load (a second or two):
    a Ctrl-C then, or in a subcommand that does not take it itself, is one line and status 130."""
    from dew import _command

    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "dew.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "dew.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    assert _command.main() == 130
    assert capsys.readouterr().err == "dew: interrupted\n"
    monkeypatch.undo()

    def interrupted(argv=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main", interrupted)
    assert _command.main() == 130
    assert capsys.readouterr().err == "dew: interrupted\n"


@pytest.mark.slow
def test_ctrl_c_stops_dew_train_after_its_step_with_a_checkpoint_and_one_line(tmp_path, capsys):
    run, trace = tmp_path / "run", tmp_path / "run.trace.gz"
    process = start_training(run, "--checkpoint-every", "1000", "--record", str(trace))
    wait_for(process.stdout, "step ")
    process.send_signal(signal.SIGINT)
    asked = wait_for(process.stderr, "dew train:")
    stopped = wait_for(process.stderr, "dew train:")
    # A press while the process exits is ignored: nothing "ignored in atexit callback".
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130
    assert asked == (
        "dew train: Ctrl-C: stopping after the step in progress, with its checkpoint "
        "(Ctrl-C again stops at once)\n"
    )
    step = int(stopped.split("step ")[1].split("/")[0])
    assert stopped == (
        f"dew train: stopped after step {step}/100, its checkpoint saved: continue with "
        f"`dew train --run {run} --resume`\n"
    )
    assert "Traceback" not in err and "Exception ignored" not in err and "dew train" not in err
    assert "trained" not in out
    # The checkpoint is the last step's, and the metrics log ends with it.
    assert read_commit(run / "checkpoints")["updates"] == step
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["updates"] == step == len(lines)
    # The trace is whole (the scheduler was closed) and replays.
    assert cli.main(["replay", str(trace)]) == 0
    assert f"replay matched: {step} steps" in capsys.readouterr().out
    # Cut after its third call, as a kill leaves it (it is flushed line by line), it replays
    # as far as it goes.
    killed = tmp_path / "killed.trace.gz"
    killed.write_bytes(gzip.compress(cut_after(trace, 3, partial=b'{"kind":"sess')))
    assert cli.main(["replay", str(killed)]) == 3
    out = capsys.readouterr().out
    assert "replay matched: 3 steps" in out and "replayed as far as it goes, 3 calls" in out


def test_a_second_ctrl_c_stops_at_once_and_the_handlers_before_come_back():
    """The handlers before come back after the run: a process that calls `dew.cli.main` goes
    on, and an ignored SIGINT would be inherited by its child processes (a pool launched
    after an interrupted run in the same process could not be interrupted)."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt), _CtrlC() as ctrl_c:
            signal.raise_signal(signal.SIGINT)  # asks to stop after the step
            assert ctrl_c.presses == 1
            signal.raise_signal(signal.SIGINT)  # stops at once
            raise AssertionError("the second press did not stop")
        assert ctrl_c.presses == 2
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("stops", ["returns", "raises"])
def test_the_dew_command_ignores_ctrl_c_once_an_interrupt_ended_it(monkeypatch, stops):
    from dew import _command

    def interrupted():
        if stops == "raises":
            raise KeyboardInterrupt
        return _command.INTERRUPTED

    monkeypatch.setattr(cli, "main", interrupted)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert _command.main() == _command.INTERRUPTED
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)  # ignored while the process exits
    finally:
        signal.signal(signal.SIGINT, previous)


def test_after_a_ctrl_c_the_run_stops_at_the_next_step_end_unless_it_was_the_last():
    seen = []
    ctrl_c = _CtrlC()
    step_ended = ctrl_c.after(seen.append, 3)
    step_ended({"updates": 1})  # no press yet: the run goes on
    ctrl_c.presses = 1
    with pytest.raises(_Interrupted) as stop:
        step_ended({"updates": 2})
    assert stop.value.updates == 2
    step_ended({"updates": 3})  # the last step: the run ends as usual
    assert seen == [{"updates": 1}, {"updates": 2}, {"updates": 3}]  # each line shown first
