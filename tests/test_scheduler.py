"""RolloutScheduler under trio's autojump clock, driven by an in-trio fake trainer.

Each test scripts a source whose rollouts take known times and end with known statuses, and
checks one rule of docs/scheduler.md through what the trainer receives, the records, the event
log, and what the source saw (trio tells a cancelled rollout why it was cancelled).
"""

from __future__ import annotations

import collections
import logging

import attrs
import numpy as np
import pytest
import trio

from _scripted import OBJECTIVE, PARAMS, ROWS, WIDTH, Engine, Plan, Scripted, dataset
from _trio_order import under_scheduling_seed
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord, task_ids
from dew.objectives.rl.sessions import Label, SessionError, Status


def scheduler(source, engine, **kwargs) -> RolloutScheduler:
    kwargs.setdefault("groups", 2)
    return RolloutScheduler(OBJECTIVE, source, engine, width=WIDTH, rows=ROWS, **kwargs)


async def train(sched: RolloutScheduler, data, steps: int, *, step_time=1.0, prefetch=None):
    """A fake trainer: a prefetch `prefetch` batches deep, one update per step taking
    `step_time` on trio's clock. Returns the records and the packed batches."""
    prefetch = sched.ahead if prefetch is None else prefetch
    stream = sched.tasks(data).stream(0)
    queue = collections.deque(next(stream) for _ in range(prefetch + 1))
    records, batches = [], []
    for updates in range(steps):
        batch = queue.popleft()
        packed = await sched.step(batch, PARAMS, updates)
        records.append(sched.last_record)
        batches.append(packed)
        queue.extend(b for b in [next(stream, None)] if b is not None)
        await trio.sleep(step_time)
    return records, batches


def kinds(events, kind):
    return [e for e in events if e.kind == kind]


# 1. Constructor ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        ({"groups": 0}, "groups"),
        ({"oversample": -1}, "oversample"),
        ({"ahead": -1}, "ahead"),
        ({"sync_every": 0}, "sync_every"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.5}, "timeout"),
        ({"max_lag": 0, "ahead": 1}, "max_lag"),
        ({"max_lag": 2, "ahead": 2, "sync_every": 2}, "max_lag"),
        ({"estimator": "ppo"}, "estimator"),
        ({"truncation": "drop"}, "truncation"),
        ({"width": 0}, "width"),
        ({"rows": 0}, "rows"),
        ({"admit": 0}, "admit"),
        ({"support_capacity": 0}, "support_capacity"),
    ],
)
def test_bad_arguments_name_the_culprit(kwargs, culprit):
    args = {"width": WIDTH, "rows": ROWS, **kwargs}
    with pytest.raises(ValueError, match=culprit):
        RolloutScheduler(OBJECTIVE, Scripted(Engine()), Engine(), **args)


def test_defaults_are_the_pages():
    sched = RolloutScheduler(OBJECTIVE, Scripted(Engine()), Engine(), width=8, rows=2)
    assert (sched.config.groups, sched.config.oversample, sched.admit) == (4, 0, None)
    assert (sched.config.max_lag, sched.ahead, sched.sync_every) == (1, 1, 1)
    assert (sched.config.max_attempts, sched.timeout) == (3, None)
    assert (sched.estimator, sched.truncation, sched.support_capacity) == ("group", "mask", None)
    RolloutScheduler(OBJECTIVE, Scripted(Engine()), Engine(), width=8, rows=2, ahead=0, max_lag=0)


async def test_admit_beyond_the_task_batch_is_refused_at_the_first_batch(autojump_clock):
    engine = Engine()
    async with scheduler(Scripted(engine), engine, admit=3) as sched:
        with pytest.raises(ValueError, match="admit must be within 1..2"):
            await train(sched, dataset(size=2), 1)


def test_task_ids():
    tasks = task_ids({"task_id": np.array([3, 11])})
    assert [t.name for t in tasks] == ["3", "11"]
    with pytest.raises(ValueError, match="task_id"):
        task_ids({"prompt": np.zeros(2)})
    with pytest.raises(ValueError, match="task_id"):
        task_ids({"task_id": np.array([0.5])})


# 2. The stream and hand-over ---------------------------------------------------------------------


async def test_hand_over_submits_the_batches_ahead(autojump_clock):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=0.5))
    async with scheduler(source, engine, ahead=2, max_lag=2) as sched:
        await train(sched, dataset(batches=5, size=1), 3, step_time=1.0)
    starts = {name: t for t, name, label in source.started if label.attempt == 0}
    # batch 0 (task "0") and batches 1, 2 at the first hand-over; then one new batch per step
    assert starts == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 1.5, "4": 2.5}


async def test_nothing_is_read_ahead_of_the_trainers_prefetch(autojump_clock):
    engine = Engine()
    source = Scripted(engine)
    async with scheduler(source, engine, ahead=2, max_lag=2) as sched:
        stream = sched.tasks(dataset(batches=4, size=1)).stream(0)
        first = next(stream)  # the prefetch read only batch 0
        await sched.step(first, PARAMS, 0)
        assert {name for _, name, _ in source.started} == {"0"}
        second = next(stream)
        await sched.step(second, PARAMS, 1)
        # batch 1 arrived only with the second hand-over, and nothing after it was read
        assert {name for _, name, _ in source.started} == {"0", "1"}


async def test_handing_over_out_of_stream_order_is_refused(autojump_clock):
    engine = Engine()
    async with scheduler(Scripted(engine), engine) as sched:
        stream = sched.tasks(dataset()).stream(0)
        next(stream)
        second = next(stream)
        with pytest.raises(ValueError, match="not the next one the tasks\\(\\) stream yielded"):
            await sched.step(second, PARAMS, 0)


async def test_reopening_the_stream_cancels_what_the_old_one_left(autojump_clock):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=0.5 if task.name == "0" else 10))
    async with scheduler(source, engine, ahead=1) as sched:
        data = sched.tasks(dataset(size=1))
        stream = data.stream(0)
        first, _ = next(stream), next(stream)
        await sched.step(first, PARAMS, 0)  # batch 1 is now in flight
        resumed = data.stream(1)
        await trio.sleep(0.1)
        assert {(label.group, reason) for _, label, reason in source.cancelled} == {(1, "reopened")}
        batch = next(resumed)
        next(resumed)
        await sched.step(batch, PARAMS, 1)
        events = sched.last_events
    assert {e.reason for e in kinds(events, "cancelled")} == {"reopened"}
    assert [e.task for e in kinds(events, "admitted")] == ["1", "1"]


# 3. Weight pushes --------------------------------------------------------------------------------


async def test_weights_are_pushed_every_sync_every_updates(autojump_clock):
    engine = Engine()
    async with scheduler(Scripted(engine), engine, sync_every=2, max_lag=2) as sched:
        await train(sched, dataset(batches=7), 6)
    assert [v for _, v in engine.pushes] == [0, 2, 4]


async def test_a_rollout_running_across_a_push_keeps_running_and_is_as_stale_as_its_oldest_call(
    autojump_clock,
):
    engine = Engine()
    source = Scripted(
        engine, lambda task, label: Plan(duration=0.3 if task.name == "0" else 1.5, calls=3)
    )
    async with scheduler(source, engine, ahead=1, max_lag=1) as sched:
        records, batches = await train(sched, dataset(batches=4, size=1), 3, step_time=0.3)
    assert {reason for _, _, reason in source.cancelled} == {"closed"}  # only at the end
    # batch 1 was submitted at updates 0, and its later calls ran after the push of version 1
    assert records[1].version == 0 and records[1].lag == 1
    versions = batches[1]["versions"][batches[1]["loss_mask"] > 0]
    assert set(versions.tolist()) == {0, 1}


async def test_a_running_rollout_is_cancelled_as_stale_by_its_oldest_calls_version(
    autojump_clock,
):
    """Batch 2 is submitted under version 0 at call 0 (ahead 2); call 2 reports updates 3, so by
    its submission all of it is past max_lag 2. Its sample 0 queued until after the push of
    version 1 and made its first call under it: lag 2, kept and admitted. Its sample 1 made its
    first call under version 0: lag 3, cancelled as stale and resubmitted."""
    engine = Engine()

    def script(task, label):
        if task.name != "2" or label.attempt > 0:
            return Plan(duration=0.5)
        if label.sample == 0:
            return Plan(delay=2.0, duration=1.5, calls=3)  # first call at 2.0, under version 1
        return Plan(duration=4.0, calls=2)  # first call at 0, under version 0

    source = Scripted(engine, script)
    records = []
    async with scheduler(source, engine, ahead=2, max_lag=2) as sched:
        stream = sched.tasks(dataset(batches=4, size=1)).stream(0)
        batches = [next(stream) for _ in range(4)]
        for call, updates in enumerate([0, 1, 3]):
            await sched.step(batches[call], PARAMS, updates)
            records.append(sched.last_record)
            events = sched.last_events
            await trio.sleep(1.0)
    assert [v for _, v in engine.pushes] == [0, 1, 3]
    stale = [label for _, label, reason in source.cancelled if reason == "stale"]
    assert [(label.sample, label.attempt) for label in stale] == [(1, 0)]
    admitted = sorted((e.label.sample, e.label.attempt) for e in kinds(events, "admitted"))
    assert admitted == [(0, 0), (1, 1)]
    assert records[2].version == 1 and records[2].lag == 2


# 4, 5. Groups and admission by status ------------------------------------------------------------


async def test_groups_are_relabelled_and_a_resubmission_rejoins_its_group(autojump_clock):
    engine = Engine()

    def script(task, label):
        if label.sample == 1 and label.attempt == 0:
            return Plan(status=Status.INFRA_ERROR, reward=None)
        return Plan(duration=1.0 + label.sample)

    source = Scripted(engine, script)
    async with scheduler(source, engine, groups=3, ahead=0, max_lag=0) as sched:
        records, batches = await train(sched, dataset(batches=1, size=2), 1)
    labels = {(name, label) for _, name, label in source.started}
    assert ("0", Label(0, 1, 1)) in labels and ("1", Label(1, 1, 1)) in labels
    assert len(labels) == 2 * 3 + 2
    admitted = [(e.group, e.label) for e in kinds(sched.last_events, "admitted")]
    assert sorted(label.sample for group, label in admitted if group == 0) == [0, 1, 2]
    assert records[0].resubmitted["infra_error"] == 2 and records[0].groups == 2


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.AGENT_ERROR])
async def test_scored_statuses_are_admitted(autojump_clock, status):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(status=status, reward=float(label.sample)))
    async with scheduler(source, engine, ahead=0, max_lag=0) as sched:
        records, batches = await train(sched, dataset(batches=1), 1)
    assert records[0].groups == 2 and sum(records[0].resubmitted.values()) == 0
    assert batches[0]["loss_mask"].sum() > 0


@pytest.mark.parametrize(
    "truncation, reward, trains, resubmitted",
    [
        ("mask", 1.0, False, 0),
        ("score", 1.0, True, 0),
        ("score", None, True, 2),  # unscored: resubmitted, then the retry completes
        ("zero", None, True, 0),
    ],
)
async def test_truncation_policies(autojump_clock, truncation, reward, trains, resubmitted):
    engine = Engine()

    def script(task, label):
        if label.sample == 0 and label.attempt == 0:
            return Plan(status=Status.TRUNCATED, reward=reward, truncation="length", tokens=4)
        return Plan(reward=float(label.sample), duration=2.0)

    source = Scripted(engine, script)
    async with scheduler(source, engine, ahead=0, max_lag=0, truncation=truncation) as sched:
        records, batches = await train(sched, dataset(batches=1, size=2), 1)
    assert records[0].resubmitted["unscored"] == resubmitted
    # sample 0's completion tokens are 5s; trained when the policy trains truncations
    batch = batches[0]
    truncated_trained = ((batch["tokens"] == 5) & (batch["loss_mask"] > 0)).any()
    assert truncated_trained == trains  # under score without reward: its completed retry
    if truncation == "mask":
        assert records[0].metrics["masked/share"] == pytest.approx(0.5)  # sample 0 of both


async def test_failures_are_resubmitted_until_max_attempts_then_the_group_is_abandoned(
    autojump_clock,
):
    engine = Engine()

    def script(task, label):
        if task.name == "0" and label.sample == 0:
            return Plan(status=Status.INFRA_ERROR, reward=None, duration=1.0)
        if task.name == "0" and label.sample == 1:
            return Plan(duration=100.0)
        return Plan(duration=2.0)

    source = Scripted(engine, script)
    async with scheduler(source, engine, ahead=0, max_lag=0, max_attempts=3) as sched:
        records, batches = await train(sched, dataset(batches=1), 1)
    record = records[0]
    assert record.abandoned == 1 and record.groups == 1
    assert record.resubmitted["infra_error"] == 2  # attempts 1 and 2; the third failure gives up
    assert record.cancelled == 1  # sample 1 of the abandoned group, in flight
    assert (3.0, Label(0, 1, 0), "abandoned") in source.cancelled
    assert record.waited == pytest.approx(3.0)


async def test_source_reported_cancellation_is_a_failed_attempt(autojump_clock):
    engine = Engine()

    def script(task, label):
        if label.attempt == 0 and label.sample == 0:
            return Plan(status=Status.CANCELLED, reward=None)
        return Plan()

    source = Scripted(engine, script)
    async with scheduler(source, engine, ahead=0, max_lag=0, max_attempts=1) as sched:
        records, _ = await train(sched, dataset(batches=1), 1)
    assert records[0].abandoned == 2 and records[0].groups == 0
    assert records[0].resubmitted["cancelled"] == 0


# 6. Staleness ------------------------------------------------------------------------------------


async def test_a_finished_rollout_past_the_bound_is_discarded_and_resubmitted(autojump_clock):
    engine = Engine()

    def script(task, label):
        return Plan(duration=0.5) if label.attempt else Plan(duration=0.5)

    source = Scripted(engine, script)
    async with scheduler(source, engine, ahead=1, max_lag=1, max_attempts=1) as sched:
        stream = sched.tasks(dataset(batches=3, size=1)).stream(0)
        first, second = next(stream), next(stream)
        await sched.step(first, PARAMS, 0)  # batch 1 runs under version 0 and finishes
        await trio.sleep(1.0)
        packed = await sched.step(second, PARAMS, 2)  # two updates later: lag 2 > max_lag
        record, events = sched.last_record, sched.last_events
    discarded = kinds(events, "discarded")
    assert [(e.reason, e.label.attempt) for e in discarded] == [("stale", 0), ("stale", 0)]
    assert record.resubmitted["stale"] == 2 and record.abandoned == 0  # no attempt used
    assert record.lag == 0 and set(packed["versions"][packed["loss_mask"] > 0].tolist()) == {2}


async def test_a_running_rollout_past_the_bound_is_cancelled_before_anyone_waits(
    autojump_clock,
):
    engine = Engine()
    durations = {"0": 5.0, "1": 8.0}
    source = Scripted(
        engine, lambda task, label: Plan(duration=1.0 if label.attempt else durations[task.name])
    )
    async with scheduler(source, engine, ahead=1, max_lag=1) as sched:
        stream = sched.tasks(dataset(batches=3, size=1)).stream(0)
        first, second = next(stream), next(stream)
        await sched.step(first, PARAMS, 0)
        await sched.step(second, PARAMS, 2)
        record = sched.last_record
    stale = {label for _, label, reason in source.cancelled if reason == "stale"}
    # batch 1's rollouts were cancelled at the second hand-over (t=5: batch 0 took 5 s)
    assert stale == {Label(1, 0, 0), Label(1, 1, 0)}
    assert record.cancelled == 2 and record.resubmitted["stale"] == 2
    assert record.lag == 0


# 7. Timeouts -------------------------------------------------------------------------------------


async def test_a_rollout_past_its_deadline_is_cancelled_and_resubmitted(autojump_clock):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=50.0 if label.attempt == 0 else 2))
    async with scheduler(source, engine, ahead=0, max_lag=0, timeout=10.0) as sched:
        records, _ = await train(sched, dataset(batches=1), 1)
    assert {(t, reason) for t, _, reason in source.cancelled} == {(10.0, "timeout")}
    assert records[0].resubmitted["timeout"] == 4 and records[0].groups == 2
    assert records[0].waited == pytest.approx(12.0)


async def test_timeouts_use_attempts(autojump_clock):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=50.0))
    async with scheduler(source, engine, ahead=0, max_lag=0, timeout=1.0, max_attempts=2) as sched:
        records, _ = await train(sched, dataset(batches=1, size=1), 1)
    # both samples time out at t=1 and are resubmitted; at t=2 sample 0's second timeout
    # gives the group up and cancels sample 1's second attempt
    assert records[0].abandoned == 1 and records[0].resubmitted["timeout"] == 2


# 8. A broken source ------------------------------------------------------------------------------


class Broken(Exception):
    pass


async def test_a_source_that_raises_reaches_the_trainer_as_itself_after_the_batch_stops(
    autojump_clock,
):
    engine = Engine()

    def script(task, label):
        if task.name == "1" and label.sample == 0:
            return Plan(duration=1.0, raises=Broken("environment exploded"))
        return Plan(duration=30.0)

    source = Scripted(engine, script)
    async with scheduler(source, engine, ahead=0, max_lag=0) as sched:
        with pytest.raises(Broken, match="environment exploded"):
            await train(sched, dataset(batches=1), 1)
        assert trio.current_time() == 1.0
        assert {reason for _, _, reason in source.cancelled} == {"broken"}
        assert len(source.cancelled) == 3
        with pytest.raises(RuntimeError, match="an earlier call failed: Broken"):
            await sched.step({"task_id": np.array([7, 8])}, PARAMS, 1)


async def test_failures_after_the_trainers_are_one_line_then_a_count_without_tracebacks(
    autojump_clock, caplog
):
    """An engine that dies fails every rollout in flight at once (a vLLM server did so with 160
    calls): the trainer gets the first; the next is one line, the rest one count at close."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=1.0, raises=Broken("engine died")))
    with caplog.at_level(logging.ERROR, logger="dew.objectives.rl.scheduler"):
        async with scheduler(source, engine, ahead=1, max_lag=1) as sched:
            with pytest.raises(Broken, match="engine died"):
                await train(sched, dataset(batches=2), 1)
    lines = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert [record.getMessage() for record in lines] == [
        "a failure after the one the trainer gets (any more are counted): Broken: engine died",
        "6 more failures after the one the trainer gets",
    ]
    assert all(record.exc_info is None for record in lines)


async def test_a_malformed_session_raises_session_error_naming_task_label_and_field(
    autojump_clock,
):
    engine = Engine()

    class Malformed(Scripted):
        async def run(self, task, label):
            session = await super().run(task, label)
            return attrs.evolve(session, reward=float("nan"))

    async with scheduler(Malformed(engine), engine, ahead=0, max_lag=0) as sched:
        with pytest.raises(SessionError, match="task '0' group 0 sample 0 attempt 0: reward"):
            await train(sched, dataset(batches=1), 1)


async def test_support_without_support_capacity_is_refused(autojump_clock):
    engine = Engine()

    class Filtered(Scripted):
        async def run(self, task, label):
            session = await super().run(task, label)
            calls = [
                attrs.evolve(c, support=tuple(c.completion[i : i + 1] for i in range(2)))
                for c in session.calls
            ]
            return attrs.evolve(session, calls=tuple(calls))

    async with scheduler(Filtered(engine), engine, ahead=0, max_lag=0) as sched:
        with pytest.raises(SessionError, match="support_capacity"):
            await train(sched, dataset(batches=1), 1)
    async with scheduler(Filtered(engine), engine, ahead=0, max_lag=0, support_capacity=8) as s:
        _, batches = await train(s, dataset(batches=1), 1)
    assert (batches[0]["support_positions"] >= 0).sum() == 8  # 2 tokens x 2 samples x 2 groups


async def test_a_call_older_than_its_submission_is_refused_rather_than_resubmitted_forever(
    autojump_clock,
):
    class Deaf(Engine):
        def load(self, variables, version):
            self.version = 0  # ignores what it is given

    engine = Deaf()
    async with scheduler(Scripted(engine), engine, ahead=0, max_lag=0) as sched:
        with pytest.raises(SessionError, match="older than the version 1 served"):
            await train(sched, dataset(batches=2), 2)


# 9. The long tail --------------------------------------------------------------------------------


async def test_oversample_admits_the_first_finishers_and_cancels_the_rest(autojump_clock):
    engine = Engine()
    durations = {0: 4.0, 1: 1.0, 2: 3.0, 3: 2.0}
    source = Scripted(engine, lambda task, label: Plan(duration=durations[label.sample]))
    async with scheduler(source, engine, groups=2, oversample=2, ahead=0, max_lag=0) as sched:
        records, _ = await train(sched, dataset(batches=1, size=1), 1)
    admitted = sorted(e.label.sample for e in kinds(sched.last_events, "admitted"))
    assert admitted == [1, 3]
    assert {(t, label.sample, reason) for t, label, reason in source.cancelled} == {
        (2.0, 0, "surplus"),
        (2.0, 2, "surplus"),
    }
    assert records[0].cancelled == 2 and records[0].waited == pytest.approx(2.0)


async def test_ties_are_broken_by_sample(autojump_clock):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=1.0))
    async with scheduler(source, engine, groups=2, oversample=2, ahead=0, max_lag=0) as sched:
        await train(sched, dataset(batches=1, size=1), 1)
    assert sorted(e.label.sample for e in kinds(sched.last_events, "admitted")) == [0, 1]


async def test_admit_takes_the_first_groups_to_complete(autojump_clock):
    engine = Engine()
    durations = {"0": 5.0, "1": 1.0, "2": 3.0, "3": 2.0}
    source = Scripted(engine, lambda task, label: Plan(duration=durations[task.name]))
    async with scheduler(source, engine, admit=2, ahead=0, max_lag=0) as sched:
        records, _ = await train(sched, dataset(batches=1, size=4), 1)
    admitted = [e.task for e in kinds(sched.last_events, "admitted")]
    assert admitted == ["1", "1", "3", "3"]  # in completion order
    assert {(label.group, reason) for _, label, reason in source.cancelled} == {
        (0, "surplus"),
        (2, "surplus"),
    }
    assert records[0].groups == 2 and records[0].waited == pytest.approx(2.0)


# 11. Packing -------------------------------------------------------------------------------------


async def test_groups_that_do_not_fit_are_cut_and_the_shape_never_changes(autojump_clock):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(calls=1, tokens=40))
    sched = RolloutScheduler(
        OBJECTIVE, source, engine, width=WIDTH, rows=3, groups=2, ahead=0, max_lag=0
    )
    async with sched:
        records, batches = await train(sched, dataset(batches=2, size=2), 2)
    assert [r.cut for r in records] == [1, 1] and [r.groups for r in records] == [1, 1]
    assert all(b["tokens"].shape == (3, WIDTH) for b in batches)
    assert len(kinds(sched.last_events, "cut")) == 1


async def test_the_batch_carries_the_proximal_log_probs_of_the_current_weights(autojump_clock):
    engine = Engine()
    async with scheduler(Scripted(engine), engine, ahead=0, max_lag=0) as sched:
        _, batches = await train(sched, dataset(batches=1), 1)
    batch = batches[0]
    for key in (
        "tokens",
        "positions",
        "segment_ids",
        "loss_mask",
        "advantages",
        "behavior_logprobs",
        "proximal_logprobs",
        "versions",
    ):
        assert batch[key].shape == (ROWS, WIDTH), key
    expected = OBJECTIVE.packed_log_probs(PARAMS, batch)
    np.testing.assert_allclose(batch["proximal_logprobs"], expected, rtol=1e-6, atol=1e-6)
    assert np.abs(batch["proximal_logprobs"][batch["loss_mask"] > 0]).min() > 0


# 12. Records -------------------------------------------------------------------------------------


async def test_a_record_per_call_reaches_log(autojump_clock):
    engine = Engine()
    logged: list[SchedulerRecord] = []
    source = Scripted(engine, lambda task, label: Plan(duration=2.0, reward=float(label.sample)))
    async with scheduler(source, engine, log=logged.append) as sched:
        records, _ = await train(sched, dataset(batches=4), 3, step_time=1.0)
    assert logged == records and len(logged) == 3
    first, second = logged[0], logged[1]
    assert (first.updates, first.version, first.lag, first.groups) == (0, 0, 0, 2)
    assert first.waited == pytest.approx(2.0)
    # batch 1 ran while the trainer stepped: 2 s of work, 1 s of it hidden behind the step
    assert (second.updates, second.version, second.lag) == (1, 0, 1)
    assert second.waited == pytest.approx(0.0)
    assert set(first.resubmitted) == {"infra_error", "cancelled", "stale", "timeout", "unscored"}
    for key in ("merge_ratio", "status/completed", "reward/mean", "latency/p50", "fill"):
        assert key in first.metrics
    assert first.metrics["reward/mean"] == pytest.approx(0.5)


ENDINGS = ("admitted", "cancelled", "discarded", "failed")


async def test_every_submission_ends_exactly_once(autojump_clock):
    engine = Engine()

    def script(task, label):
        rng = np.random.default_rng([int(task.name), label.sample, label.attempt])
        status = Status.INFRA_ERROR if rng.random() < 0.3 else Status.COMPLETED
        return Plan(
            duration=float(rng.lognormal(0, 1)),
            status=status,
            reward=None if status is Status.INFRA_ERROR else 1.0,
        )

    source = Scripted(engine, script)
    events = []
    async with scheduler(
        source, engine, groups=2, oversample=1, ahead=2, max_lag=2, timeout=4.0
    ) as sched:
        stream = sched.tasks(dataset(batches=13, size=2)).stream(0)
        queue = collections.deque(next(stream) for _ in range(3))
        for updates in range(10):
            await sched.step(queue.popleft(), PARAMS, updates)
            events.extend(sched.last_events)
            queue.append(next(stream))
            await trio.sleep(0.7)
        in_flight = {e.label for e in kinds(events, "submitted")} - {
            e.label for e in events if e.kind in ENDINGS
        }
        # what has not ended belongs to batches 10 and 11, still in flight
        assert in_flight and all(label.group >= 20 for label in in_flight)
    # Closing ends them: with its events the log accounts for every submission, once.
    events.extend(sched.closing_events)
    closed = {e.label for e in sched.closing_events if e.reason == "closed"}
    assert closed and closed <= in_flight
    ends = collections.Counter(e.label for e in events if e.kind in ENDINGS)
    assert all(count == 1 for count in ends.values())
    assert set(ends) == {e.label for e in kinds(events, "submitted")}


# 13. close ---------------------------------------------------------------------------------------


async def test_close_cancels_everything_in_flight_and_is_idempotent(autojump_clock):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=1.0 if task.name < "2" else 100))
    sched = scheduler(source, engine, ahead=1)
    async with sched:
        stream = sched.tasks(dataset()).stream(0)
        first, _ = next(stream), next(stream)
        await sched.step(first, PARAMS, 0)
        sched.close()
        sched.close()
        with pytest.raises(RuntimeError, match="closed"):
            await sched.step(first, PARAMS, 1)
    assert {reason for _, _, reason in source.cancelled} == {"closed"}
    assert len(source.cancelled) == 4
    assert trio.current_time() == 1.0


# status() and long waits -------------------------------------------------------------------------


async def test_status_says_what_the_trainer_waits_on_and_long_waits_are_logged(
    autojump_clock, caplog
):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=500.0 if label.sample else 1.0))
    caplog.set_level(logging.WARNING, logger="dew.objectives.rl.scheduler")
    seen = []
    async with scheduler(source, engine, ahead=0, max_lag=0) as sched:

        async def look():
            await trio.sleep(10.0)
            seen.append(sched.status())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            await train(sched, dataset(batches=1, size=1), 1)
    status = seen[0]
    assert status.waiting == 0 and status.updates == 0
    [group] = status.groups
    assert [(s.sample, s.state) for s in group.samples] == [(0, "finished"), (1, "running")]
    assert group.samples[1].age == pytest.approx(10.0)
    waits = [r.getMessage() for r in caplog.records]
    assert len(waits) == 4 and "waited 60s" in waits[0] and "waited 480s" in waits[3]
    # The first batch's wait holds the engine's first compilations: one line each
    # (tests/test_scheduler_long_runs.py shows a later wait's groups).
    assert all("first batch (1 of 2 rollouts finished)" in w and "\n" not in w for w in waits)


async def test_an_error_in_the_callers_block_comes_out_as_itself(autojump_clock):
    engine = Engine()
    with pytest.raises(KeyError, match="mine"):
        async with scheduler(Scripted(engine), engine):
            raise KeyError("mine")


# Determinism -------------------------------------------------------------------------------------


def simulated_run(scheduling_seed: int) -> tuple[list, list, list]:
    """A seeded SimulatedSource run with failures, timeouts, stale discards, surplus and cuts,
    under the mock clock, with trio's ready-task order shuffled by `scheduling_seed`."""
    from dew.envs import SimulatedConfig, SimulatedEngine, SimulatedSource

    async def main():
        engine = SimulatedEngine(slots=6)
        config = SimulatedConfig(
            seed=3, duration_mean=2.0, infra_error=0.1, truncated=0.1, vocab=OBJECTIVE.model.vocab
        )
        sched = RolloutScheduler(
            OBJECTIVE,
            SimulatedSource(engine, config),
            engine,
            width=WIDTH,
            rows=4,
            groups=2,
            oversample=1,
            ahead=1,
            max_lag=1,
            timeout=6.0,
        )
        records, batches, events = [], [], []
        async with sched:
            records, batches = await train(sched, dataset(batches=12, size=3), 10, step_time=1.0)
            events = sched.last_events
        return records, batches, events

    return under_scheduling_seed(main, scheduling_seed)


def test_the_outcome_does_not_depend_on_trios_ready_task_order():
    first = simulated_run(0)
    records, batches, events = first
    assert sum(sum(r.resubmitted.values()) for r in records) > 0
    assert sum(r.cancelled for r in records) > 0 and sum(r.cut for r in records) > 0
    for seed in (1, 2):
        other = simulated_run(seed)
        assert other[0] == records
        assert other[2] == events
        for ours, theirs in zip(batches, other[1], strict=True):
            assert ours.keys() == theirs.keys()
            for key in ours:
                np.testing.assert_array_equal(ours[key], theirs[key])


# 14. The synchronous facade, from a real trainer thread on the real clock ------------------------


def test_the_sync_facade_runs_the_trio_side_in_its_own_thread():
    import threading

    from dew.envs import SimulatedConfig, SimulatedEngine, SimulatedSource

    engine = SimulatedEngine(slots=8)
    small = dict(prompt_tokens=(2, 4), completion_tokens=(1, 4), calls=(1, 2), vocab=32)
    source = SimulatedSource(engine, SimulatedConfig(seed=0, duration_mean=0.01, **small))
    logged = []
    before = set(threading.enumerate())
    sched = scheduler(source, engine, ahead=1, log=logged.append)
    stream = sched.tasks(dataset(batches=6)).stream(0)
    prefetched = [next(stream), next(stream)]
    for updates in range(4):
        packed = sched(prefetched.pop(0), PARAMS, updates)
        prefetched.append(next(stream))
        assert packed["tokens"].shape == (ROWS, WIDTH)
        assert "proximal_logprobs" in packed
    assert [r.updates for r in logged] == [0, 1, 2, 3]
    assert all(r.groups == 2 and r.lag <= 1 for r in logged)
    assert [v for _, v in engine.pushes] == [0, 1, 2, 3]
    assert set(threading.enumerate()) - before  # the scheduler's trio thread
    status = sched.status()  # from the trainer's thread: ages on the scheduler's clock
    assert status.updates == 3 and status.time >= 0 and status.groups
    assert all(s.age >= 0 for g in status.groups for s in g.samples)
    with pytest.raises(RuntimeError, match="async with"):
        trio.run(sched.step, prefetched[0], PARAMS, 4)
    sched.close()
    sched.close()
    # Its thread has ended (trio's idle worker threads from earlier tests may end meanwhile).
    assert not set(threading.enumerate()) - before
    with pytest.raises(RuntimeError, match="closed"):
        sched(prefetched[0], PARAMS, 4)
