"""`GRPOObjective(proximal="current")` against the levers, the scheduler, the trainer and
`dew tune`'s timing, where the existing tests (test_grpo_corrections.py, test_train_objective.py)
do not reach:

- with a top-k support and each aggregation, the update's own log-probs train as the rescored
  ones do;
- the scheduler skips only the proximal rescoring (the reference is still rescored), and its
  record leaves out every figure made from the rescoring, `importance/masked` included;
- a step with no trained token leaves the masked share out of its metrics line under
  `current` too, as the record does under `rescore`, rather than a made-up 0.0;
- `step_seconds` times the reference's rescoring alone under `current`.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from _scripted import CONFIG, PARAMS, ROWS, WIDTH, Engine, Plan, Scripted, dataset
from dew import models
from dew.data import ArrayDataset
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.train import Trainer, _timing, step_seconds
from test_contention import write_run
from test_grpo_corrections import (
    VOCAB,
    assert_trains_alike,
    bigram,
    random_batch,
    table,
)

# The figures the scheduler makes from its rescoring (`GRPOObjective.importance_metrics`).
RESCORED_FIGURES = ("importance/", "mismatch/", "staleness/")


def with_support(rng, batch: dict) -> dict:
    """`batch` with a top-k support at about half its trained positions: the drawn token and up
    to two others, laid out as (position, token) slots per row, -1 in the unused ones."""
    capacity = 3 * WIDTH
    tokens = np.full((len(batch["tokens"]), capacity), -1, np.int32)
    positions = np.full_like(tokens, -1)
    for row in range(len(batch["tokens"])):
        slot = 0
        for position in np.flatnonzero(batch["loss_mask"][row]):
            if rng.random() < 0.5:
                continue
            others = rng.choice(VOCAB, 2, replace=False)
            for token in np.unique(np.append(others, batch["tokens"][row, position])):
                tokens[row, slot], positions[row, slot] = token, position
                slot += 1
    return batch | {"support_tokens": tokens, "support_positions": positions}


@pytest.mark.medium
@pytest.mark.parametrize("aggregation", ["sequence_mean", "constant"])
def test_the_current_proximal_trains_as_the_rescored_one_under_a_support_and_each_aggregation(
    aggregation,
):
    """Under a top-k support the rescoring renormalises over the kept tokens; so does the
    loss's own forward pass, and the two objectives agree whatever the aggregation."""
    rng = np.random.default_rng(21)
    variables = table(rng)
    batch = with_support(rng, random_batch(rng, spread=0.4))
    levers = {"aggregation": aggregation, "importance_level": "geometric", "kl_coef": 0.1}
    rescore = GRPOObjective(bigram, **levers)
    current = GRPOObjective(bigram, proximal="current", **levers)
    supported = np.asarray(rescore.packed_log_probs(variables, batch))
    plain = {k: v for k, v in batch.items() if not k.startswith("support_")}
    assert not np.allclose(supported, np.asarray(rescore.packed_log_probs(variables, plain)))
    batch["proximal_logprobs"] = supported
    bare = {k: v for k, v in batch.items() if k != "proximal_logprobs"}

    assert_trains_alike(rescore, current, variables, batch, bare)


class CountingPool:
    """A one-process pool that rescores as `LocalPool` does and keeps the variables of each
    rescoring."""

    share_size = 1

    def __init__(self):
        self.rescored: list = []

    def agree(self, error):
        if error is not None:
            raise error

    def rescore(self, objective, variables, rows):
        self.rescored.append(variables)
        return np.asarray(objective.packed_log_probs(variables, rows), np.float32)

    def is_first_reader(self):
        return True


@pytest.mark.medium
@pytest.mark.parametrize("proximal", ["rescore", "current"])
async def test_the_scheduler_skips_only_the_proximal_rescoring_and_its_figures(
    autojump_clock, proximal
):
    """Under `current` the pool rescores the reference alone, the batch carries no proximal
    log-probs and the record none of the figures made from them; the update's own loss then
    is the rescored batch's."""
    reference = models.init(jax.random.key(1), CONFIG)
    objective = GRPOObjective(models.model(CONFIG), kl_coef=0.1, proximal=proximal)
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(duration=1.0, reward=label.sample))
    sched = RolloutScheduler(
        objective, source, engine, width=WIDTH, rows=ROWS, groups=2, reference=reference
    )
    pool = sched.pool = CountingPool()
    async with sched:
        stream = sched.tasks(dataset(batches=1, size=2)).stream(0)
        batch = await sched.step(next(stream), PARAMS, 0)
        figures = sched.last_record.metrics
    assert (batch["loss_mask"] > 0).any()
    rescored = [variables is PARAMS for variables in pool.rescored]
    made = {name for name in figures if name.startswith(RESCORED_FIGURES)}
    if proximal == "rescore":
        assert rescored == [True, False]
        assert {"importance/masked", "importance/p50", "mismatch/engine"} <= made
        return
    assert rescored == [False], "the current proximal's scheduler rescored the trainer's weights"
    assert "proximal_logprobs" not in batch and not made, made
    rescore = GRPOObjective(models.model(CONFIG), kl_coef=0.1)
    loss_c, metrics_c = objective.loss(PARAMS, batch)
    with_proximal = batch | {"proximal_logprobs": rescore.packed_log_probs(PARAMS, batch)}
    loss, _ = rescore.loss(PARAMS, with_proximal)
    np.testing.assert_allclose(float(loss_c), float(loss), rtol=1e-5, atol=1e-6)
    assert float(metrics_c["kl/reference"]) > 0


class Rows:
    """A Rollout that hands over `batches` in turn, whatever the task batch."""

    def __init__(self, batches):
        self.batches = list(batches)

    def __call__(self, batch, variables, updates):
        return self.batches[updates]


def test_a_step_with_no_trained_token_leaves_the_masked_share_out_under_the_current_proximal():
    """The masked share is a share of the trained tokens: the record leaves it out of a step
    with none (docs/reliability.md), and so must the line where the loss reports it in the
    record's place (`current`), rather than the jitted loss's 0.0. A step that trains keeps it."""
    rng = np.random.default_rng(5)
    variables, batch = table(rng), random_batch(rng, spread=0.3)
    del batch["proximal_logprobs"]
    objective = GRPOObjective(bigram, correction="mask", importance_cap=1.5, proximal="current")
    empty = batch | {"loss_mask": np.zeros_like(batch["loss_mask"])}
    lines = []
    trainer = Trainer(objective, optax.sgd(0.1), variables, on_step=lines.append)
    trainer.run(Rows([empty, batch]), ArrayDataset({"id": np.arange(2)}, batch_size=1), steps=2)
    assert lines[0]["tokens"] == 0.0 and lines[1]["tokens"] > 0
    assert "importance/masked" not in lines[0], lines[0]
    assert 0 < lines[1]["importance/masked"] < 1


@pytest.mark.medium
def test_step_seconds_under_the_current_proximal_times_only_the_references_rescoring(
    tmp_path, monkeypatch
):
    """`dew tune --time-trainer` times the run's own step: under `current` it has no proximal
    rescoring, only the reference's (a KL run), and its update trains without the key."""
    rescorings, updated = [], []
    rescored, update_fn = _timing._rescored, GRPOObjective.update_fn

    def counted(objective, variables, batch):
        rescorings.append(objective.proximal)
        return rescored(objective, variables, batch)

    def spied(objective, optimizer):
        update = update_fn(objective, optimizer)

        def step(variables, state, batch):
            updated.append((objective.proximal, "proximal_logprobs" in batch))
            return update(variables, state, batch)

        return step

    monkeypatch.setattr(_timing, "_rescored", counted)
    monkeypatch.setattr(GRPOObjective, "update_fn", spied)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        for proximal in ("rescore", "current"):
            run = write_run(tmp_path / proximal, kl_coef=0.05, proximal=proximal)
            step_seconds(run, [1], repeats=2)
    # One step that compiles and two timed: the proximal and the reference rescored in each
    # under `rescore`, the reference alone under `current`.
    assert rescorings.count("rescore") == 6 and rescorings.count("current") == 3
    assert set(updated) == {("rescore", True), ("current", False)}
