"""The scheduler's side of the objective's levers, through the real trio shell on the mock
clock: uniform-group filtering and its counts, the warning when filtering leaves steps empty,
the reference policy rescored beside the proximal one, the importance figures and mismatch
split in the record, and the refusals of settings that cannot work."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from _scripted import CONFIG, OBJECTIVE, PARAMS, ROWS, WIDTH, Engine, Plan, Scripted, dataset
from dew import models
from dew.objectives.rl._shell_trainer import selection_bias
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Call, Session, Status, note_progress


def scheduler(source, engine, objective=OBJECTIVE, **kwargs) -> RolloutScheduler:
    kwargs.setdefault("groups", 2)
    return RolloutScheduler(objective, source, engine, width=WIDTH, rows=ROWS, **kwargs)


async def steps(sched: RolloutScheduler, data, count: int) -> list[dict]:
    """`count` trainer calls, one update each, one second apart; the packed batches."""
    stream = sched.tasks(data).stream(0)
    batches = []
    for updates in range(count):
        batches.append(await sched.step(next(stream), PARAMS, updates))
        await trio.sleep(1.0)
    return batches


def by_task(rewards: dict[int, tuple[float, ...]]):
    """A script whose task n's sample s scores rewards[n][s] (1.0 for tasks not named), the
    later tasks slower, so that tasks complete in order."""

    def script(task, label):
        n = int(task.name)
        reward = rewards.get(n, (1.0, 0.0))[label.sample]
        return Plan(duration=1.0 + n, reward=reward)

    return script


async def test_filtering_discards_uniform_groups_and_admits_later_ones(autojump_clock):
    engine = Engine()
    # Tasks 0 and 1 score alike (1, 1) and (0, 0): with admit=2, tasks 2 and 3 take their places.
    source = Scripted(engine, by_task({0: (1.0, 1.0), 1: (0.0, 0.0)}))
    async with scheduler(source, engine, admit=2, filter_uniform=True) as sched:
        await steps(sched, dataset(batches=1, size=4), 1)
        record, events = sched.last_record, sched.last_events
    admitted = sorted({e.task for e in events if e.kind == "admitted"})
    discarded = [(e.task, e.reason) for e in events if e.kind == "discarded"]
    assert admitted == ["2", "3"]
    assert sorted(discarded) == [("0", "uniform")] * 2 + [("1", "uniform")] * 2
    assert record.groups == 2
    assert record.metrics["groups/uniform"] == 2.0
    assert record.metrics["groups/uniform_trained"] == 0.0


async def test_without_filtering_uniform_groups_are_trained_and_counted(autojump_clock):
    engine = Engine()
    source = Scripted(engine, by_task({0: (1.0, 1.0), 1: (0.0, 0.0)}))
    async with scheduler(source, engine, admit=2) as sched:
        await steps(sched, dataset(batches=1, size=4), 1)
        record = sched.last_record
    assert record.groups == 2
    assert record.metrics["groups/uniform"] == record.metrics["groups/uniform_trained"] == 2.0


async def test_steps_that_filtering_left_empty_warn_saying_so(autojump_clock, caplog):
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(reward=1.0))
    async with scheduler(source, engine, filter_uniform=True, empty_streak=2) as sched:
        batches = await steps(sched, dataset(batches=2, size=2), 2)
    assert all(not batch["loss_mask"].any() for batch in batches)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "2 calls in a row trained on nothing" in warning
    assert "filter_uniform discarded 4 groups whose rewards were all equal" in warning


async def test_steps_whose_groups_all_scored_alike_warn_that_they_trained_nothing(
    autojump_clock, caplog
):
    """Without filter_uniform such groups are trained, each advantage 0: a verifier that scores
    every rollout alike trains for good on nothing, and the scheduler says so."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(reward=0.0))
    async with scheduler(source, engine, empty_streak=2) as sched:
        batches = await steps(sched, dataset(batches=2, size=2), 2)
        record = sched.last_record
    assert all(batch["loss_mask"].any() for batch in batches)
    assert record.groups == 2 and record.metrics["groups/uniform_trained"] == 2.0
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "2 calls in a row trained on nothing (updates 0..1)" in warning
    assert "every group they trained (4) had rewards all equal" in warning
    assert "mean reward per call: 0, 0" in warning


async def test_steps_of_only_truncated_rollouts_warn_that_truncation_trained_nothing(
    autojump_clock, caplog
):
    """Every rollout TRUNCATED (`context`) before its first call, as an episode whose prompt
    outgrows the context is: nothing to train, and the warning says why, not that the rewards
    were alike. The Trainer's NothingTrained names the truncated share too
    (test_hostile_core)."""
    engine = Engine()
    plan = Plan(status=Status.TRUNCATED, truncation="context", reward=0.0, calls=0)
    source = Scripted(engine, lambda task, label: plan)
    async with scheduler(source, engine, empty_streak=2, truncation="score") as sched:
        batches = await steps(sched, dataset(batches=2, size=2), 2)
    assert not any(batch["loss_mask"].any() for batch in batches)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "2 calls in a row trained on nothing (updates 0..1): no token of theirs" in warning
    assert "100% of the rollouts they delivered ended TRUNCATED" in warning
    assert "truncation='mask'" not in warning  # this run's policy is `score`


async def test_the_reference_is_rescored_beside_the_proximal_policy(autojump_clock):
    engine = Engine()
    reference = models.init(jax.random.key(1), CONFIG)
    objective = GRPOObjective(models.model(CONFIG), kl_coef=0.1)
    source = Scripted(engine, by_task({}))
    async with scheduler(source, engine, objective, reference=reference) as sched:
        [batch] = await steps(sched, dataset(batches=1, size=2), 1)
    trained = batch["loss_mask"] > 0
    assert trained.any()
    expected = np.asarray(objective.packed_log_probs(reference, batch))
    np.testing.assert_allclose(batch["reference_logprobs"], expected, rtol=1e-6)
    assert not np.allclose(
        batch["reference_logprobs"][trained], batch["proximal_logprobs"][trained]
    )
    loss, metrics = objective.loss(PARAMS, batch)
    assert np.isfinite(float(loss)) and float(metrics["kl/reference"]) > 0


async def test_the_record_reports_the_importance_and_the_mismatch_split(autojump_clock):
    """Scripted behaviour log-probs are -0.5 everywhere, the proximal ones the model's: each
    record's figures are the objective's over its rescored batch. Rollouts span pushes, so
    steps train tokens of the trainer's own version and of older ones."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=1.5, calls=3, reward=label.sample))
    seen = set()
    async with scheduler(source, engine, ahead=1, max_lag=2) as sched:
        stream = sched.tasks(dataset(batches=6, size=1)).stream(0)
        prefetched = collections.deque([next(stream)])  # the trainer reads one batch ahead
        for updates in range(5):
            prefetched.append(next(stream))
            batch = await sched.step(prefetched.popleft(), PARAMS, updates)
            expected = OBJECTIVE.importance_metrics(batch, version=updates)
            for name, value in expected.items():
                assert sched.last_record.metrics[name] == pytest.approx(value), name
            assert expected["importance/masked"] == 0.0
            seen |= expected.keys()
            await trio.sleep(0.5)
    assert {"mismatch/engine", "staleness/kl", "importance/p50"} <= seen


@pytest.mark.parametrize(
    "objective, kwargs, message",
    [
        (OBJECTIVE, {"groups": 1, "filter_uniform": True}, "filter_uniform discards every"),
        (OBJECTIVE, {"filter_uniform": 1}, "filter_uniform must be a bool"),
        (GRPOObjective(OBJECTIVE.model, kl_coef=0.1), {}, "reference is required"),
        (OBJECTIVE, {"reference": PARAMS}, "its kl_coef is 0"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_them(objective, kwargs, message):
    with pytest.raises(ValueError, match=message):
        scheduler(Scripted(Engine()), Engine(), objective, **kwargs)


class Noting:
    """A source whose rollouts note their progress as an engine does: sample 0 makes one
    10-token call in 1 s, sample 1 five 4-token calls of 0.4 s each."""

    async def run(self, task, label):
        count, tokens, seconds = (1, 10, 1.0) if label.sample == 0 else (5, 4, 0.4)
        calls = []
        for i in range(count):
            note_progress(calls=1)
            await trio.sleep(seconds)
            note_progress(tokens)
            prompt = np.arange(1, 3 + i * (1 + tokens), dtype=np.int32)
            completion = np.full(tokens, 7, np.int32)
            calls.append(Call(prompt, completion, np.full(tokens, -0.5, np.float32), 0))
        return Session(Status.COMPLETED, calls, reward=float(label.sample))


async def test_the_record_measures_the_selection_bias_of_the_cut_tail(autojump_clock):
    """With oversample 1, sample 0 finishes first (10 tokens, 1 call) and sample 1 is cancelled
    at 1 s, after 2 calls and into its third (8 tokens, 3 calls begun: lower bounds)."""
    engine = Engine()
    async with scheduler(Noting(), engine, groups=1, oversample=1) as sched:
        await steps(sched, dataset(batches=1, size=1), 1)
        metrics = sched.last_record.metrics
    assert metrics["bias/tokens/admitted_mean"] == 10.0
    assert metrics["bias/tokens/started_mean"] == 9.0
    assert metrics["bias/tokens/ratio_mean"] == pytest.approx(10 / 9)
    assert metrics["bias/turns/admitted_mean"] == 1.0
    assert metrics["bias/turns/started_mean"] == 2.0
    assert metrics["bias/turns/ratio_p90"] == pytest.approx(1 / 2.8)
    # Both ran 1 s: sample 1 was cancelled as sample 0 finished.
    assert metrics["bias/seconds/admitted_mean"] == metrics["bias/seconds/started_mean"] == 1.0


# A rollout's seconds: none, or at least a microsecond. Hypothesis also draws subnormal floats
# (5e-324), whose medians differ by an ulp between formulas and whose ratios overflow: no clock
# measures them.
SECONDS = st.just(0.0) | st.floats(1e-6, 9)


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(
    admitted=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 4), SECONDS), max_size=6),
    started=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 4), SECONDS), max_size=9),
)
@pytest.mark.medium
def test_selection_bias_matches_numpy(admitted, started):
    got = selection_bias(admitted, started)
    if not admitted or not started:
        assert got == {}
        return
    for kind, column in (("tokens", 0), ("turns", 1), ("seconds", 2)):
        a = np.array([x[column] for x in admitted], float)
        b = np.array([x[column] for x in started], float)
        for stat, f in (
            ("mean", np.mean),
            ("p50", np.median),
            ("p90", lambda v: np.percentile(v, 90)),
        ):
            assert got[f"bias/{kind}/admitted_{stat}"] == pytest.approx(f(a))
            assert got[f"bias/{kind}/started_{stat}"] == pytest.approx(f(b))
            if f(b) > 0:
                assert got[f"bias/{kind}/ratio_{stat}"] == pytest.approx(f(a) / f(b))
            else:
                assert f"bias/{kind}/ratio_{stat}" not in got
