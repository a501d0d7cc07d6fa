"""Several updates a batch (issue 44): `Trainer(ppo_epochs=K, minibatches=M)`, `dew train
--ppo-epochs K --minibatches M` and `fit(ppo_epochs=, minibatches=)`.

A step's batch is rescored once, under the weights before its first update (the proximal
policy), then trained by K passes over M minibatches of its rows: K x M optimizer updates and
one push. From the second update on the ratio current / proximal departs from 1, so clip-higher,
the dual clip and GSPO's clip act, which they never do at one update a batch
(`test_practitioner_options.test_at_one_update_a_batch_the_clips_never_act_...`).

The trainer tests run the real Trainer and jitted update on the bigram model of
tests/test_grpo_corrections.py, fed by a rollout that packs seeded rows per task id and rescores
them under the weights it is handed, as the scheduler does; the references are the objective's
own `update_fn` applied by hand. The `dew train` tests run the real command on a tiny model.
"""

from __future__ import annotations

import json
import re

import attrs
import jax
import numpy as np
import optax
import pytest

from dew.data import ArrayDataset, Task
from dew.envs import Score
from dew.objectives.rl.grpo import GRPOObjective
from dew.train import TrainConfig, Trainer, fit
from dew.train._run import _optimizer
from test_grpo_corrections import VOCAB, WIDTH, bigram, table
from test_hostile_cli import refusal

ROWS = 8
"""Rows of a packed batch: 2 minibatches of 4, 4 of 2."""


@attrs.define(eq=False)
class RescoringRollout:
    """Packs seeded rows per task id, each row one segment with one advantage (+1 or -1), and
    rescores them under the weights it is handed (the proximal log-probs), as the scheduler
    does; `row` numbers the rows, so an update's minibatch says which it took."""

    objective: GRPOObjective
    rows: int = ROWS
    versions: list[int] = attrs.Factory(list)

    def __call__(self, batch, variables, updates):
        self.versions.append(updates)
        rng = np.random.default_rng([int(i) for i in batch["task_id"]])
        packed = {
            "tokens": rng.integers(0, VOCAB, (self.rows, WIDTH)).astype(np.int32),
            "positions": np.tile(np.arange(WIDTH, dtype=np.int32), (self.rows, 1)),
            "segment_ids": np.ones((self.rows, WIDTH), np.int32),
            "loss_mask": np.tile((np.arange(WIDTH) >= 1).astype(np.float32), (self.rows, 1)),
            "advantages": np.repeat(rng.choice([-1.0, 1.0], (self.rows, 1)), WIDTH, 1).astype(
                np.float32
            ),
            "row": np.repeat(np.arange(self.rows, dtype=np.int32)[:, None], WIDTH, 1),
        }
        proximal = np.asarray(self.objective.packed_log_probs(variables, packed), np.float32)
        packed["proximal_logprobs"] = proximal
        packed["behavior_logprobs"] = proximal - np.float32(0.05) * packed["loss_mask"]
        return packed


def dataset(batches: int = 8) -> ArrayDataset:
    return ArrayDataset({"task_id": np.arange(2 * batches)}, 2)


def variables():
    return table(np.random.default_rng(3))


def trained(objective, steps, *, directory=None, optimizer=None, resume=False, **options):
    """A Trainer of `options` after `steps` steps on `RescoringRollout`, its rollout, and the
    rows of each update's minibatch, in order."""
    trainer = Trainer(
        objective,
        optimizer or optax.sgd(2.0),
        variables(),
        directory=directory,
        checkpoint_every=None if directory is None else 1,
        on_step=(lines := []).append,
        **options,
    )
    trainer.lines = lines
    if resume:
        trainer.resume()
    seen = []
    update = trainer._update

    def watched(variables, opt_state, rows):
        seen.append(np.asarray(rows["row"][:, 0]).tolist())
        return update(variables, opt_state, rows)

    trainer._update = watched
    rollout = RescoringRollout(objective)
    trainer.run(rollout, dataset(), steps=steps, ahead=0)
    return trainer, rollout, seen


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def by_hand(objective, optimizer, steps, updates_a_step):
    """The reference: each step's batch rescored at the weights before the step, then the
    objective's own `update_fn` applied `updates_a_step` times to the whole batch; the weights
    after and each update's metrics."""
    update = objective.update_fn(optimizer)
    weights = variables()
    state = optimizer.init(weights)
    metrics = []
    rollout = RescoringRollout(objective)
    for step, batch in zip(range(steps), dataset().stream(0), strict=False):
        packed = rollout(batch, weights, step)
        for _ in range(updates_a_step):
            weights, state, one = update(weights, state, packed)
            metrics.append(jax.device_get(one))
    return weights, metrics


def test_the_defaults_train_a_batch_by_one_update_exactly_as_before():
    """Left at 1 and 1, a step is the objective's one update on the whole batch: the weights
    bit for bit, the loss line for line, and no field of the several updates in the record."""
    objective = GRPOObjective(bigram)
    optimizer = optax.sgd(0.05, momentum=0.9)
    default, rollout, seen = trained(objective, 3, optimizer=optimizer)
    spelled, _, _ = trained(objective, 3, optimizer=optimizer, ppo_epochs=1, minibatches=1)
    want, metrics = by_hand(objective, optimizer, 3, 1)
    assert_trees_equal(default.variables, want)
    assert_trees_equal(spelled.variables, want)
    assert [line["loss"] for line in default.lines] == [float(m["loss"]) for m in metrics]
    assert [line["loss"] for line in spelled.lines] == [line["loss"] for line in default.lines]
    assert seen == [list(range(ROWS))] * 3  # the whole batch, as packed
    assert rollout.versions == [0, 1, 2]
    assert (default.updates, default.optimizer_updates) == (3, 3)
    assert not [key for key in default.lines[0] if key.startswith("last/")]
    assert "optimizer_updates" not in default.lines[0]


def test_two_passes_train_against_the_weights_before_the_first_and_the_clip_acts():
    """K = 2: the batch is rescored once, before the step's first update, so the second
    update's ratio departs from 1 and a small clip-higher holds tokens: clip_fraction/high > 0,
    where one update a batch holds none. The weights are the objective's update applied twice
    by hand to the batch rescored once, and the line gives each metric's mean over the two
    updates and the last one's."""
    objective = GRPOObjective(bigram, clip=0.01, clip_high=0.02)
    optimizer = optax.sgd(2.0)  # the trainer's, `trained`'s default
    trainer, rollout, seen = trained(objective, 2, ppo_epochs=2)
    want, metrics = by_hand(objective, optimizer, 2, 2)
    np.testing.assert_allclose(trainer.variables["table"], want["table"], rtol=1e-6, atol=1e-6)
    assert rollout.versions == [0, 1]  # one call, one version, a step
    assert (trainer.updates, trainer.optimizer_updates) == (2, 4)
    assert [line["optimizer_updates"] for line in trainer.lines] == [2, 4]
    assert seen == [list(range(ROWS))] * 4
    for line, (first, second) in zip(trainer.lines, [metrics[:2], metrics[2:]], strict=True):
        assert float(first["ratio/mean"]) == pytest.approx(1.0, abs=1e-6)
        assert abs(float(second["ratio/mean"]) - 1.0) > 1e-3
        assert float(first["clip_fraction"]) == 0.0
        assert float(second["clip_fraction/high"]) > 0
        assert line["loss"] == pytest.approx((float(first["loss"]) + float(second["loss"])) / 2)
        assert line["last/loss"] == pytest.approx(float(second["loss"]))
        assert line["last/clip_fraction/high"] == pytest.approx(float(second["clip_fraction/high"]))
        assert line["clip_fraction/high"] > 0
        assert line["clip_fraction"] == pytest.approx(
            line["clip_fraction/low"] + line["clip_fraction/high"]
        )
        assert line["tokens"] == float(first["tokens"])  # the batch's, once
    single, _, _ = trained(objective, 2)
    assert all(line["clip_fraction"] == 0.0 for line in single.lines)


def test_gspos_sequence_clip_acts_from_the_second_update():
    """GSPO's sequence ratio with its tight clip: no sequence clipped at one update a batch,
    some from the second of two."""
    objective = GRPOObjective(bigram, ratio_level="sequence", clip=3e-4, clip_high=4e-4)
    twice, _, _ = trained(objective, 2, ppo_epochs=2)
    once, _, _ = trained(objective, 2)
    assert all(line["clip_fraction"] == 0.0 for line in once.lines)
    assert all(line["last/clip_fraction"] > 0 for line in twice.lines)
    assert all(line["clip_fraction"] > 0 for line in twice.lines)


@pytest.mark.parametrize("epochs, minibatches", [(1, 2), (3, 4), (2, 8)])
def test_each_pass_deals_every_row_into_exactly_one_minibatch_in_a_seeded_order(
    epochs, minibatches
):
    objective = GRPOObjective(bigram)
    trainer, _, seen = trained(objective, 3, ppo_epochs=epochs, minibatches=minibatches)
    assert len(seen) == 3 * epochs * minibatches
    assert trainer.optimizer_updates == 3 * epochs * minibatches
    size = ROWS // minibatches
    passes = [seen[i : i + minibatches] for i in range(0, len(seen), minibatches)]
    for dealt in passes:
        assert all(len(part) == size and part == sorted(part) for part in dealt)
        assert sorted(row for part in dealt for row in part) == list(range(ROWS))
    # Every row trained once a pass: epochs times a step.
    counts = np.bincount([row for part in seen for row in part], minlength=ROWS)
    assert counts.tolist() == [3 * epochs] * ROWS
    if minibatches > 1:
        again, _, seen_again = trained(objective, 3, ppo_epochs=epochs, minibatches=minibatches)
        assert seen_again == seen
        assert_trees_equal(again.variables, trainer.variables)
        assert len({json.dumps(dealt) for dealt in passes}) > 1  # passes deal differently
        other = trained(objective, 3, ppo_epochs=epochs, minibatches=minibatches, shuffle_seed=1)[2]
        assert other != seen


def test_a_run_of_two_passes_resumed_from_its_checkpoint_equals_one_never_stopped(tmp_path):
    """Checkpoints fall between steps: 2 steps, stopped, resumed for 2 more, give the weights,
    the optimizer state, the optimizer's count and the record of 4 steps in one go, minibatch
    orders included (they are drawn from the batch's position)."""
    objective = GRPOObjective(bigram, clip=0.01, clip_high=0.02)
    options = {"ppo_epochs": 2, "minibatches": 2, "optimizer": optax.sgd(0.05, momentum=0.9)}
    whole, _, seen_whole = trained(objective, 4, directory=tmp_path / "whole", **options)
    trained(objective, 2, directory=tmp_path / "cut", **options)
    resumed, _, seen_resumed = trained(
        objective, 4, directory=tmp_path / "cut", resume=True, **options
    )
    assert_trees_equal(resumed.variables, whole.variables)
    assert_trees_equal(resumed.opt_state, whole.opt_state)
    assert (resumed.updates, resumed.optimizer_updates) == (4, 16)
    assert seen_resumed == seen_whole[8:]

    def kept(path):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        return [
            {k: v for k, v in line.items() if not k.startswith(("seconds/", "elapsed"))}
            for line in lines
        ]

    assert kept(tmp_path / "cut" / "metrics.jsonl") == kept(tmp_path / "whole" / "metrics.jsonl")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"ppo_epochs": 0}, r"ppo_epochs must be an int >= 1, got 0"),
        ({"minibatches": 0}, r"minibatches must be an int >= 1, got 0"),
        ({"ppo_epochs": 1.5}, r"ppo_epochs must be an int >= 1, got 1.5"),
        ({"shuffle_seed": -1}, r"shuffle_seed must be an int >= 0, got -1"),
    ],
)
def test_bad_update_counts_are_refused_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        Trainer(GRPOObjective(bigram), optax.sgd(0.1), variables(), **options)


@pytest.mark.parametrize("options", [{"ppo_epochs": 2}, {"minibatches": 2}])
def test_several_updates_under_the_current_proximal_are_refused_naming_both(options):
    objective = GRPOObjective(bigram, proximal="current")
    with pytest.raises(ValueError, match=r"ppo_epochs \d x minibatches \d.*proximal='current'"):
        Trainer(objective, optax.sgd(0.1), variables(), **options)


@pytest.mark.parametrize("minibatches", [3, 16])
def test_minibatches_that_do_not_divide_the_rows_are_refused_at_the_step(minibatches):
    objective = GRPOObjective(bigram)
    trainer = Trainer(objective, optax.sgd(0.1), variables(), minibatches=minibatches)
    message = rf"minibatches {minibatches} must divide the batch's rows, got a batch of 8 rows"
    with pytest.raises(ValueError, match=message):
        trainer.run(RescoringRollout(objective), dataset(), steps=1, ahead=0)
    assert (trainer.updates, trainer.optimizer_updates) == (0, 0)


@pytest.mark.parametrize("option", ["ppo_epochs", "minibatches"])
def test_fit_names_a_bad_update_count_before_anything_runs(option):
    with pytest.raises(ValueError, match=f"^{option} must be an int >= 1, got 0$"):
        fit(
            [Task("1+1")],
            lambda task, reply: Score(float(reply.strip() == "2")),
            prompt=lambda task: task.name,
            max_tokens=2,
            batch_size=1,
            groups=2,
            **{option: 0},
        )


def test_the_learning_rate_schedule_counts_optimizer_updates():
    """Warmup and decay count the optimizer's updates: 2 steps of 2 x 2 updates decay to 0 at
    the 8th update, not the 2nd."""
    config = TrainConfig(steps=2, ppo_epochs=2, minibatches=2, lr_decay="linear")
    assert config.optimizer_updates == 8
    _, schedule = _optimizer(config)
    rates = [float(schedule(n)) for n in (0, 4, 8)]
    np.testing.assert_allclose(rates, [3e-4, 1.5e-4, 0.0], rtol=1e-6)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ppo-epochs", "0"], r"ppo_epochs must be"),
        (["--minibatches", "0"], r"minibatches must be"),
        (
            ["--proximal", "current", "--ppo-epochs", "2"],
            r"proximal current .* ppo_epochs 2 x minibatches 1 .*give proximal rescore",
        ),
        (
            ["--proximal", "current", "--minibatches", "2"],
            r"proximal current .* ppo_epochs 1 x minibatches 2",
        ),
        (["--minibatches", "7"], r"--minibatches 7 must divide the \d+ rows a step packs"),
    ],
)
def test_bad_update_options_are_refused_naming_them(argv, message, capsys, tmp_path):
    line = refusal(capsys, ["train", "--run", str(tmp_path / "run"), *argv])
    assert re.search(message, line), line
    assert not (tmp_path / "run").exists()


@pytest.mark.medium
def test_a_dew_train_run_of_two_passes_over_two_minibatches_records_them(tmp_path):
    """The built-in guess task, for real, on a tiny model: each step is one call (one version,
    the lag counted in steps) and 4 optimizer updates, and its line says so."""
    from dew import train

    tiny = {"d_model": 16, "heads": 2, "layers": 1, "d_ff": 32, "tasks": 16, "samples": 0}
    config = TrainConfig(
        task="guess", steps=2, batch_size=2, groups=4, ppo_epochs=2, minibatches=2, **tiny
    )
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        trainer = train.train(config, tmp_path / "run")
    lines = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [(line["step"], line["updates"]) for line in lines] == [(0, 1), (1, 2)]
    assert [line["optimizer_updates"] for line in lines] == [4, 8]
    assert (trainer.updates, trainer.optimizer_updates) == (2, 8)
    assert all(0 <= line["lag"] <= config.max_lag for line in lines)
    for line in lines:
        for name in ("loss", "clip_fraction", "clip_fraction/low", "clip_fraction/high"):
            assert f"last/{name}" in line


@pytest.mark.medium
def test_a_non_finite_update_of_several_stops_the_run_naming_the_step_and_the_update():
    """NaN advantages: the step's first update is not finite, and the run stops naming the
    step and which of its updates, before the second update or any line; the weights stay."""

    @attrs.define(eq=False)
    class Broken(RescoringRollout):
        def __call__(self, batch, variables, updates):
            packed = super().__call__(batch, variables, updates)
            return packed | {"advantages": np.full_like(packed["advantages"], np.nan)}

    objective = GRPOObjective(bigram)
    trainer = Trainer(objective, optax.sgd(0.1), variables(), ppo_epochs=2, minibatches=2)
    with pytest.raises(FloatingPointError, match=r"^step 0, update 1 of 4: loss nan.*the update "):
        trainer.run(Broken(objective), dataset(), steps=1, ahead=0)
    assert_trees_equal(trainer.variables, variables())
    assert (trainer.updates, trainer.optimizer_updates) == (0, 0)
