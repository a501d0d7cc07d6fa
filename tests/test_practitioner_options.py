"""What a practitioner reaches for in a run (issue 44), each against an independent reference:

- clip-higher and the dual clip: the loss, its gradient and the split clip fractions match
  NumPy (`test_grpo_corrections.reference_loss`, which states every surrogate formula once);
  a token at current - proximal = 50 with a negative advantage loses at most clip_dual x |A|;
- GSPO's sequence-level ratio: the same reference, and a sequence clips as one;
- each is a `dew train` option, refused naming it when out of bounds.

The model is the bigram table of tests/test_grpo_corrections.py: real JAX, cheap in NumPy.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.objectives.rl.grpo import AGGREGATIONS, CORRECTIONS, IMPORTANCE_LEVELS, GRPOObjective
from dew.objectives.rl.sessions import Status, pack
from dew.train import TrainConfig
from dew.train._run import _levers
from test_grpo_corrections import (
    ROWS,
    TOLERANCE,
    VOCAB,
    WIDTH,
    bigram,
    current_entropy,
    current_log_probs,
    random_batch,
    reference_loss,
    sequences,
    table,
)
from test_hostile_cli import refusal
from test_pack import one_call

SURROGATES = st.fixed_dictionaries(
    {
        "clip": st.sampled_from([0.1, 0.2]),
        "clip_high": st.sampled_from([None, 0.28, 0.5]),
        "clip_dual": st.sampled_from([None, 2.0, 3.0]),
        "ratio_level": st.sampled_from(["token", "sequence"]),
        "importance_level": st.sampled_from(IMPORTANCE_LEVELS),
        "correction": st.sampled_from(CORRECTIONS),
        "aggregation": st.sampled_from(AGGREGATIONS),
        "entropy_coef": st.sampled_from([0.0, 0.05]),
    }
)


def off_policy(rng, variables, *, spread: float) -> dict[str, np.ndarray]:
    """A random batch whose proximal log-probs lie `spread` around the current policy's, so
    ratios land on both sides of every clip bound."""
    batch = random_batch(rng, spread=0.3)
    trained = batch["loss_mask"] > 0
    current = current_log_probs(variables, batch)
    proximal = current + spread * rng.standard_normal((ROWS, WIDTH))
    batch["proximal_logprobs"] = np.where(trained, proximal, 0.0).astype(np.float32)
    return batch


def reference_clip_fractions(variables, batch, objective) -> dict[str, float]:
    """The split clip fractions over trained tokens, in NumPy float64."""
    trained = batch["loss_mask"] > 0
    current = current_log_probs(variables, batch)
    log_ratio = np.where(trained, current - batch["proximal_logprobs"], 0)
    if objective.ratio_level == "sequence":
        for cells in sequences(batch):
            log_ratio[cells] = log_ratio[cells].mean()
    ratio, a = np.exp(log_ratio), batch["advantages"]
    low = trained & (a < 0) & (ratio < 1 - objective.clip)
    high = trained & (a > 0) & (ratio > 1 + objective.upper_clip)
    count = max(trained.sum(), 1)
    fractions = {
        "clip_fraction": (low | high).sum() / count,
        "clip_fraction/low": low.sum() / count,
        "clip_fraction/high": high.sum() / count,
    }
    if objective.clip_dual is not None:
        surrogate = np.minimum(
            ratio * a, np.clip(ratio, 1 - objective.clip, 1 + objective.upper_clip) * a
        )
        fractions["clip_fraction/dual"] = (
            trained & (a < 0) & (surrogate < objective.clip_dual * a)
        ).sum() / count
    return fractions


@pytest.mark.medium
@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(chosen=SURROGATES, seed=st.integers(0, 2**16), spread=st.sampled_from([0.05, 0.4, 3.0]))
def test_the_clip_variants_and_the_sequence_ratio_match_numpy(chosen, seed, spread):
    rng = np.random.default_rng(seed)
    variables = table(rng)
    batch = off_policy(rng, variables, spread=spread)
    objective = GRPOObjective(bigram, **chosen)
    loss, metrics = objective.loss(variables, batch)
    expected, _ = reference_loss(variables, batch, objective)
    np.testing.assert_allclose(float(loss), expected, **TOLERANCE)
    for name, value in reference_clip_fractions(variables, batch, objective).items():
        assert float(metrics[name]) == pytest.approx(value, abs=1e-6), name
    assert ("clip_fraction/dual" in metrics) == (objective.clip_dual is not None)
    trained = batch["loss_mask"] > 0
    entropy = current_entropy(variables, batch)[trained].sum() / max(trained.sum(), 1)
    np.testing.assert_allclose(float(metrics["entropy"]), entropy, **TOLERANCE)


@pytest.mark.parametrize(
    "chosen",
    [
        {"clip_high": 0.28},
        {"clip_dual": 2.0},
        {"ratio_level": "sequence", "aggregation": "sequence_mean"},
        {"ratio_level": "sequence", "clip_high": 0.5, "clip_dual": 3.0},
        {"entropy_coef": 0.1},
        {"entropy_coef": 0.05, "ratio_level": "sequence", "aggregation": "constant"},
    ],
)
def test_the_gradient_matches_numpy_by_central_differences(chosen):
    """The NumPy reference loss differentiated numerically in float64, entry by entry of the
    table, against JAX's gradient of the objective's loss."""
    rng = np.random.default_rng(5)
    variables = table(rng)
    batch = off_policy(rng, variables, spread=0.4)
    objective = GRPOObjective(bigram, **chosen)
    grads = np.asarray(jax.grad(lambda v: objective.loss(v, batch)[0])(variables)["table"])
    base = np.asarray(variables["table"], np.float64)
    numeric = np.zeros_like(base)
    step = 1e-5
    for i, j in np.ndindex(VOCAB, VOCAB):
        ups, downs = base.copy(), base.copy()
        ups[i, j] += step
        downs[i, j] -= step
        up, _ = reference_loss({"table": ups}, batch, objective)
        down, _ = reference_loss({"table": downs}, batch, objective)
        numeric[i, j] = (up - down) / (2 * step)
    np.testing.assert_allclose(grads, numeric, rtol=1e-3, atol=1e-4)


def one_token(gap: float, advantage: float) -> tuple[dict, dict]:
    """A one-token batch whose current log-prob is `gap` above its proximal one (and its
    behaviour one: weight 1), under a bigram table that puts nearly all mass on it."""
    variables = {"table": jnp.zeros((VOCAB, VOCAB), jnp.float32).at[0, 1].set(10.0)}
    current = float(jax.nn.log_softmax(variables["table"][0])[1])
    cells = lambda *values: np.asarray([values], np.float32)  # noqa: E731
    batch = {
        "tokens": np.asarray([[0, 1]], np.int32),
        "positions": np.asarray([[0, 1]], np.int32),
        "segment_ids": np.asarray([[1, 1]], np.int32),
        "loss_mask": cells(0, 1),
        "advantages": cells(0, advantage),
        "proximal_logprobs": cells(0, current - gap),
        "behavior_logprobs": cells(0, current - gap),
    }
    return variables, batch


@pytest.mark.medium
def test_the_dual_clip_bounds_a_negative_advantage_token_far_above_its_proximal():
    variables, batch = one_token(50.0, -1.0)
    loss, _ = GRPOObjective(bigram).loss(variables, batch)
    assert float(loss) > 1e21  # e^50: unbounded without the dual clip
    dual = GRPOObjective(bigram, clip_dual=3.0)
    (loss, metrics), grads = jax.value_and_grad(dual.loss, has_aux=True)(variables, batch)
    assert float(loss) == pytest.approx(3.0)
    assert float(metrics["clip_fraction/dual"]) == 1.0
    # Held at a constant: the token pushes nothing.
    assert np.all(np.asarray(grads["table"]) == 0)
    # A positive advantage is left to the usual clip (r = e^50 > 1.2: clipped, loss -1.2 A).
    variables, batch = one_token(50.0, 1.0)
    loss, metrics = dual.loss(variables, batch)
    assert float(loss) == pytest.approx(-1.2)
    assert float(metrics["clip_fraction/dual"]) == 0.0
    assert float(metrics["clip_fraction/high"]) == 1.0


def test_clip_higher_lets_a_positive_token_rise_further_than_a_negative_one_falls():
    """At r = 1.25 (> 1.2) with A = 1, the symmetric clip holds the surrogate at 1.2 (no
    gradient); clip_high = 0.28 leaves it at 1.25 (gradient); the low bound stays 0.8."""
    variables, batch = one_token(float(np.log(1.25)), 1.0)
    symmetric = GRPOObjective(bigram)
    higher = GRPOObjective(bigram, clip_high=0.28)
    assert float(symmetric.loss(variables, batch)[0]) == pytest.approx(-1.2)
    assert float(higher.loss(variables, batch)[0]) == pytest.approx(-1.25, rel=1e-5)
    assert float(symmetric.loss(variables, batch)[1]["clip_fraction/high"]) == 1.0
    assert float(higher.loss(variables, batch)[1]["clip_fraction/high"]) == 0.0
    variables, batch = one_token(float(np.log(0.75)), -1.0)
    for objective in (symmetric, higher):
        loss, metrics = objective.loss(variables, batch)
        assert float(loss) == pytest.approx(0.8)
        assert float(metrics["clip_fraction/low"]) == 1.0


def test_a_sequence_clips_as_one_at_the_sequence_level():
    """One sequence of two trained tokens, log-ratios +0.5 and -0.5 (mean 0): per token, the
    first clips (A > 0, r = e^0.5 > 1.2); per sequence the ratio is 1 and nothing clips."""
    variables = table(np.random.default_rng(0))
    tokens = np.asarray([[1, 2, 3]], np.int32)
    batch = {
        "tokens": tokens,
        "positions": np.asarray([[0, 1, 2]], np.int32),
        "segment_ids": np.ones((1, 3), np.int32),
        "loss_mask": np.asarray([[0, 1, 1]], np.float32),
        "advantages": np.asarray([[0, 1, 1]], np.float32),
    }
    logits = jax.nn.log_softmax(variables["table"][tokens[0, :2]])
    current = np.asarray([0.0, logits[0, 2], logits[1, 3]], np.float32)
    batch["proximal_logprobs"] = (current - np.asarray([0, 0.5, -0.5], np.float32))[None]
    batch["behavior_logprobs"] = batch["proximal_logprobs"]
    token = GRPOObjective(bigram).loss(variables, batch)[1]
    sequence = GRPOObjective(bigram, ratio_level="sequence").loss(variables, batch)[1]
    assert float(token["clip_fraction"]) == 0.5
    assert float(sequence["clip_fraction"]) == 0.0
    assert float(sequence["ratio/mean"]) == pytest.approx(1.0, abs=1e-6)


def test_the_defaults_are_the_symmetric_token_clip():
    rng = np.random.default_rng(9)
    variables = table(rng)
    batch = off_policy(rng, variables, spread=1.0)
    default = GRPOObjective(bigram, clip=0.2)
    spelled = GRPOObjective(bigram, clip=0.2, clip_high=0.2, ratio_level="token")
    assert float(default.loss(variables, batch)[0]) == float(spelled.loss(variables, batch)[0])
    assert (default.clip_high, default.clip_dual, default.ratio_level) == (None, None, "token")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_at_one_update_a_batch_the_clips_never_act_and_gspo_moves_only_the_weights(aggregation):
    """docs/concepts.md's learning comparison: at K = 1 only (`--ppo-epochs 1 --minibatches
    1`, the defaults) `dew train` trains each batch by one update at the weights it rescored
    it under, so every ratio is 1. Clip-higher, the dual clip and GSPO's tight clip then give
    the defaults' gradient; GSPO's sequence ratio gives it too on-policy (one advantage a
    sequence, as packing lays them), and off-policy differs only by each token taking its
    sequence's mean behaviour weight. From a batch's second update on the ratio departs from
    1 and the clips act (tests/test_ppo_epochs.py)."""
    rng = np.random.default_rng(5)
    variables = table(rng)
    batch = random_batch(rng, spread=0.3)
    for cells in sequences(batch):
        batch["advantages"][cells] = rng.standard_normal()
    plain = GRPOObjective(bigram, aggregation=aggregation)
    batch["proximal_logprobs"] = np.asarray(plain.packed_log_probs(variables, batch))

    def gradient(objective, batch):
        return jax.grad(lambda v: objective.loss(v, batch)[0])(variables)["table"]

    want = gradient(plain, batch)
    for levers in ({"clip_high": 0.28}, {"clip_dual": 3.0}, {"clip": 3e-4, "clip_high": 4e-4}):
        clipped = GRPOObjective(bigram, aggregation=aggregation, **levers)
        np.testing.assert_allclose(gradient(clipped, batch), want, **TOLERANCE)
    gspo = GRPOObjective(
        bigram, aggregation=aggregation, ratio_level="sequence", clip=3e-4, clip_high=4e-4
    )
    on_policy = dict(batch, behavior_logprobs=batch["proximal_logprobs"])
    np.testing.assert_allclose(gradient(gspo, on_policy), gradient(plain, on_policy), **TOLERANCE)
    assert not np.allclose(gradient(gspo, batch), want, **TOLERANCE)
    # Off-policy, it is the token ratio's gradient with each sequence's weights averaged.
    trained = batch["loss_mask"] > 0
    weights = np.where(
        trained,
        np.minimum(
            np.exp(batch["proximal_logprobs"] - batch["behavior_logprobs"]), plain.importance_cap
        ),
        0.0,
    )
    averaged = np.zeros_like(weights)
    for cells in sequences(batch):
        averaged[cells] = weights[cells].mean()
    # Behaviour log-probs that give each token its sequence's mean weight.
    averaged_batch = dict(
        batch,
        behavior_logprobs=np.where(
            trained, batch["proximal_logprobs"] - np.log(np.where(trained, averaged, 1.0)), 0.0
        ).astype(np.float32),
    )
    np.testing.assert_allclose(gradient(gspo, batch), gradient(plain, averaged_batch), **TOLERANCE)


@pytest.mark.parametrize(
    "chosen, message",
    [
        ({"clip_high": 0.0}, "clip_high must be"),
        ({"clip_high": 1.5}, "clip_high must be"),
        ({"clip_dual": 1.1}, r"clip_dual must be above 1 \+ the upper clip \(1.2\).*got 1.1"),
        ({"clip_dual": 1.3, "clip_high": 0.5}, r"clip_dual must be above .*\(1.5\)"),
        ({"clip_dual": 0.5}, "clip_dual must be"),
        ({"ratio_level": "geometric"}, "ratio_level must be one of"),
        ({"entropy_coef": -0.1}, "entropy_coef must be"),
    ],
)
def test_bad_surrogate_settings_are_refused_naming_them(chosen, message):
    with pytest.raises(ValueError, match=message):
        GRPOObjective(bigram, **chosen)


def test_the_surrogate_levers_are_dew_train_options():
    config = TrainConfig(
        clip=0.1, clip_high=0.28, clip_dual=3.0, ratio_level="sequence", entropy_coef=0.01
    )
    levers = _levers(config)
    names = ("clip", "clip_high", "clip_dual", "ratio_level", "entropy_coef")
    assert {k: levers[k] for k in names} == {
        "clip": 0.1,
        "clip_high": 0.28,
        "clip_dual": 3.0,
        "ratio_level": "sequence",
        "entropy_coef": 0.01,
    }
    GRPOObjective(bigram, **levers)  # the objective takes them as they are


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--clip-high", "1.5", "clip_high must be"),
        ("--clip-dual", "1.1", "clip_dual must be above 1 \\+ the upper clip"),
        ("--ratio-level", "row", "ratio_level must be one of"),
        ("--clip", "0", "clip must be"),
        ("--entropy-coef", "-1", "entropy_coef must be"),
    ],
)
def test_bad_surrogate_options_are_refused_naming_them(option, value, message, capsys, tmp_path):
    line = refusal(capsys, ["train", "--run", str(tmp_path / "run"), option, value])
    assert re.search(message, line), line


def test_an_entropy_bonus_alone_raises_the_policys_entropy():
    """With every advantage 0 the surrogate's gradient vanishes: an update moves the policy by
    the entropy bonus alone, and the entropy over the trained tokens goes up (with no bonus,
    nothing moves)."""
    rng = np.random.default_rng(11)
    variables = table(rng)
    batch = off_policy(rng, variables, spread=0.1) | {
        "advantages": np.zeros((ROWS, WIDTH), np.float32)
    }
    trained = batch["loss_mask"] > 0
    before = current_entropy(variables, batch)[trained].mean()
    for coef, rises in [(0.5, True), (0.0, False)]:
        objective = GRPOObjective(bigram, entropy_coef=coef)
        optimizer = optax.sgd(0.5)
        after, _, metrics = objective.update_fn(optimizer)(
            variables, optimizer.init(variables), batch
        )
        assert float(metrics["entropy"]) == pytest.approx(before, rel=1e-5)
        entropy = current_entropy(after, batch)[trained].mean()
        assert (entropy > before + 1e-3) if rises else entropy == pytest.approx(before, abs=1e-6)


@pytest.mark.medium
def test_a_dew_train_run_with_clip_higher_a_dual_clip_and_gspo_records_each_clip(tmp_path):
    """The built-in copy task on a tiny model, for real, with an entropy bonus: every step's
    line holds the split clip fractions, each a share in [0, 1], the low and high ones adding
    up to the whole, and the policy's entropy, between 0 and log(vocabulary)."""
    from dew import train

    tiny = {"d_model": 16, "heads": 2, "layers": 1, "d_ff": 32, "tasks": 16, "samples": 0}
    config = TrainConfig(
        steps=2,
        batch_size=2,
        groups=4,
        clip_high=0.28,
        clip_dual=3.0,
        ratio_level="sequence",
        entropy_coef=0.01,
        **tiny,
    )
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        train.train(config, tmp_path / "run")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 2
    for record in records:
        parts = [record[f"clip_fraction/{side}"] for side in ("low", "high", "dual")]
        assert all(0 <= part <= 1 for part in parts)
        assert record["clip_fraction"] == pytest.approx(parts[0] + parts[1])
        assert 0 < record["entropy"] < np.log(256)


def test_batch_std_advantages_centre_each_group_and_scale_by_the_whole_batch():
    """A decisive group (rewards 0 and 1) beside one that barely differs (0.5 and 0.51): by
    its own std the second's advantages are as large as the first's (±1); by the batch's
    they stay small, as NumPy computes them."""
    rewards = [[0.0, 1.0], [0.5, 0.51]]
    groups = [
        [one_call(Status.COMPLETED, r, sample=s, group=g) for s, r in enumerate(group)]
        for g, group in enumerate(rewards)
    ]
    spread = np.std(np.asarray(rewards, np.float64).ravel())
    for estimator, expected in [
        ("group", [[(r - np.mean(g)) / (np.std(g) + 1e-6) for r in g] for g in rewards]),
        ("batch", [[(r - np.mean(g)) / (spread + 1e-6) for r in g] for g in rewards]),
        ("mean", [[r - np.mean(g) for r in g] for g in rewards]),
    ]:
        packed = pack(groups, width=16, rows=4, estimator=estimator)
        laid = np.asarray(packed.batch["advantages"])[np.asarray(packed.batch["loss_mask"]) > 0]
        want = np.repeat(np.ravel(expected), 2)  # each rollout trains 2 completion tokens
        np.testing.assert_allclose(np.sort(laid), np.sort(want).astype(np.float32), rtol=1e-6)


def test_the_estimator_is_a_dew_train_option_the_run_trains_with(tmp_path):
    """The scheduler of a real `dew train` run packs with the configured estimator: its trace
    records it."""
    from dew import replay, train

    tiny = {"d_model": 16, "heads": 2, "layers": 1, "d_ff": 32, "tasks": 16, "samples": 0}
    config = TrainConfig(steps=1, batch_size=2, groups=4, estimator="batch", **tiny)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        try:
            train.train(config, tmp_path / "run", record=tmp_path / "run.trace")
        except train.NothingTrained:  # every group of the one step scored alike: a real end
            pass
    assert replay.read_trace(tmp_path / "run.trace").config["estimator"] == "batch"


def test_fit_takes_the_estimator_and_names_a_bad_one():
    from dew.data import Task
    from dew.envs import Score
    from dew.train import fit

    with pytest.raises(ValueError, match="estimator must be one of .*'batch'.*got 'std'"):
        fit(
            [Task("1+1")],
            lambda task, reply: Score(float(reply.strip() == "2")),
            prompt=lambda task: task.name,
            max_tokens=2,
            steps=1,
            batch_size=1,
            groups=2,
            estimator="std",
        )


def test_a_bad_estimator_option_is_refused_naming_it(capsys, tmp_path):
    line = refusal(capsys, ["train", "--run", str(tmp_path / "run"), "--estimator", "std"])
    assert "estimator must be one of ('group', 'batch', 'mean', 'rloo'), got 'std'" in line


def reference_learning_rate(step: int, *, peak: float, warmup: int, decay: str, steps: int):
    """The schedule by its formulas: linear warmup from 0, then the decay to 0 at `steps`."""
    if step < warmup:
        return peak * step / warmup
    done = min(1.0, (step - warmup) / max(1, steps - warmup))
    if decay == "linear":
        return peak * (1 - done)
    if decay == "cosine":
        return peak * 0.5 * (1 + np.cos(np.pi * done))
    return peak


def reference_adam(grads: list[np.ndarray], rates: list[float], max_norm: float | None):
    """Adam's updates in NumPy (b1 0.9, b2 0.999, eps 1e-8), each gradient first scaled down
    to `max_norm` where it is larger."""
    m = v = np.zeros_like(grads[0])
    updates = []
    for t, (g, rate) in enumerate(zip(grads, rates, strict=True), start=1):
        norm = np.sqrt((g**2).sum())
        if max_norm is not None and norm > max_norm:
            g = g * max_norm / norm
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g**2
        updates.append(-rate * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8))
    return updates


@pytest.mark.parametrize(
    "warmup, decay, max_norm",
    [(0, "constant", None), (3, "linear", None), (2, "cosine", 0.5), (0, "cosine", None)],
)
def test_the_optimizer_steps_at_the_scheduled_rate_behind_the_clip(warmup, decay, max_norm):
    """dew train's optimizer (`_optimizer`) over 8 updates of gradients whose norms vary
    around the clip, against Adam, the schedule and the clip written in NumPy."""
    from dew.train._run import _optimizer

    config = TrainConfig(
        steps=8, learning_rate=0.01, warmup_steps=warmup, lr_decay=decay, max_grad_norm=max_norm
    )
    optimizer, schedule = _optimizer(config)
    rates = [
        reference_learning_rate(k, peak=0.01, warmup=warmup, decay=decay, steps=8) for k in range(8)
    ]
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(3) * scale for scale in (0.1, 2.0, 0.3, 5.0, 1.0, 0.2, 3, 1)]
    params = jnp.zeros(3, jnp.float32)
    with jax.numpy_dtype_promotion("standard"):  # optax's, as in test_train
        np.testing.assert_allclose([float(schedule(k)) for k in range(8)], rates, rtol=1e-5)
        state = optimizer.init(params)
        for grad, expected in zip(grads, reference_adam(grads, rates, max_norm), strict=True):
            update, state = optimizer.update(jnp.asarray(grad, jnp.float32), state, params)
            np.testing.assert_allclose(np.asarray(update), expected, rtol=2e-5, atol=1e-9)


def test_the_defaults_keep_plain_adam_so_older_checkpoints_resume():
    from dew.train._run import _optimizer

    optimizer, _ = _optimizer(TrainConfig(learning_rate=0.01))
    params = jnp.zeros(3, jnp.float32)
    plain = optax.adam(0.01).init(params)
    assert jax.tree.structure(optimizer.init(params)) == jax.tree.structure(plain)


@pytest.mark.medium
def test_a_dew_train_run_records_the_scheduled_learning_rate(tmp_path):
    from dew import train

    tiny = {"d_model": 16, "heads": 2, "layers": 1, "d_ff": 32, "tasks": 16, "samples": 0}
    config = TrainConfig(
        steps=4,
        batch_size=2,
        groups=4,
        learning_rate=0.01,
        warmup_steps=2,
        lr_decay="linear",
        max_grad_norm=1.0,
        **tiny,
    )
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        train.train(config, tmp_path / "run")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rates = [json.loads(line)["learning_rate"] for line in lines]
    # Warmup 0, 0.005; then 0.01 falling linearly to 0 at step 4.
    np.testing.assert_allclose(rates, [0.0, 0.005, 0.01, 0.005], rtol=1e-6)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr-decay", "step"], "lr_decay must be one of"),
        (["--max-grad-norm", "0"], "max_grad_norm must be"),
        (["--warmup-steps", "-1"], "warmup_steps must be"),
        (
            ["--steps", "10", "--warmup-steps", "10", "--lr-decay", "cosine"],
            r"warmup_steps must be below steps x ppo_epochs x minibatches \(10, .*\) for lr_decay "
            r"cosine.*got 10",
        ),
    ],
)
def test_bad_schedule_options_are_refused_naming_them(argv, message, capsys, tmp_path):
    line = refusal(capsys, ["train", "--run", str(tmp_path / "run"), *argv])
    assert re.search(message, line), line


def test_kept_checkpoints_are_the_last_k_each_readable_and_the_newest_resumes(tmp_path):
    from dew.train import Checkpoint, load_checkpoint, read_kept, save_checkpoint

    def saved(updates: int) -> Checkpoint:
        variables = {"w": jnp.full(3, float(updates), jnp.float32)}
        return Checkpoint(variables, {"m": jnp.zeros(2, jnp.float32)}, updates, updates)

    directory = tmp_path / "checkpoints"
    for updates in range(1, 6):
        save_checkpoint(directory, saved(updates), keep=3)
    template = saved(0)
    newest = load_checkpoint(directory, template.variables, template.opt_state)
    assert newest.updates == 5
    kept = read_kept(directory)
    assert [record["updates"] for record in kept] == [4, 3]
    for record in kept:
        old = load_checkpoint(directory, template.variables, template.opt_state, record=record)
        assert old.updates == record["updates"]
        np.testing.assert_array_equal(np.asarray(old.variables["w"]), [record["updates"]] * 3)
    # The arrays of the three kept checkpoints, and no others.
    assert len([path for path in directory.iterdir() if path.name.startswith("state-")]) == 3
    # Keeping one again lets the earlier go at the next commit.
    save_checkpoint(directory, saved(6))
    assert read_kept(directory) == []
    assert len([path for path in directory.iterdir() if path.name.startswith("state-")]) == 1


def test_a_kept_checkpoint_whose_arrays_are_gone_is_no_longer_kept(tmp_path):
    from dew.train import Checkpoint, read_kept, save_checkpoint

    directory = tmp_path / "checkpoints"
    for updates in range(1, 4):
        variables = {"w": jnp.zeros(2, jnp.float32)}
        save_checkpoint(directory, Checkpoint(variables, {}, updates, updates), keep=3)
    gone = read_kept(directory)[1]["arrays"]  # update 1's
    (directory / gone).unlink()
    save_checkpoint(directory, Checkpoint({"w": jnp.zeros(2, jnp.float32)}, {}, 4, 4), keep=3)
    assert [record["updates"] for record in read_kept(directory)] == [3, 2]


@pytest.mark.medium
def test_a_dew_train_run_keeps_its_last_checkpoints_and_resumes_from_the_newest(tmp_path):
    from dew import train
    from dew.train import read_kept

    tiny = {"d_model": 16, "heads": 2, "layers": 1, "d_ff": 32, "tasks": 16, "samples": 0}
    config = TrainConfig(
        steps=3, batch_size=2, groups=4, checkpoint_every=1, keep_checkpoints=2, **tiny
    )
    run = tmp_path / "run"
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        train.train(config, run)
        assert [record["updates"] for record in read_kept(run / "checkpoints")] == [2]
        trainer = train.train(attrs.evolve(config, steps=4), run, resume=True)
    assert trainer.updates == 4
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    assert [record["updates"] for record in read_kept(run / "checkpoints")] == [3]
    held = [path for path in (run / "checkpoints").iterdir() if path.name.startswith("state-")]
    assert len(held) == 2


@pytest.mark.medium
def test_keep_best_holds_the_best_evaluations_checkpoint_through_a_resume(tmp_path):
    """Issue 44 item 6 (a gap: only the newest checkpoints were kept): with keep_best,
    checkpoints/best holds the trainer's state at the first evaluation of the run's highest
    greedy held-out reward, its evaluation in the record, and every checkpoint kept shows its
    arrays are that update's. The run is synchronous (ahead 0: the same rollouts every time):
    its best comes before the resume, whose evaluations only tie it, so a resumed run that
    did not read back the best it has to beat would replace it. --resume reads the newest."""
    from dew import train
    from dew.train import load_variables, read_kept
    from dew.train._checkpoint import read_commit

    config = TrainConfig(
        task="guess", steps=8, batch_size=4, groups=8, tasks=64, samples=0, seed=1, ahead=0,
        eval_every=1, eval_tasks=8, eval_samples=0, keep_best=True,
        checkpoint_every=1, keep_checkpoints=8,
    )  # fmt: skip
    run = tmp_path / "run"
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        train.train(attrs.evolve(config, steps=4), run)
        before = read_commit(run / "checkpoints" / "best")
        trainer = train.train(config, run, resume=True)
    evaluations = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["updates"] for e in evaluations] == list(range(9))
    greedy = [e["greedy"] for e in evaluations]
    best = evaluations[greedy.index(max(greedy))]
    record = read_commit(run / "checkpoints" / "best")
    assert record["updates"] == best["updates"] == before["updates"] > 0, greedy
    assert max(greedy[5:]) == max(greedy), greedy  # the resumed run's evaluations tie it
    assert record["metadata"]["eval"] == {k: v for k, v in best.items() if k != "rewards"}
    assert read_commit(run / "checkpoints")["updates"] == trainer.updates == 8
    (kept,) = [r for r in read_kept(run / "checkpoints") if r["updates"] == best["updates"]]
    same = load_variables(run / "checkpoints", trainer.variables, record=kept)
    held = load_variables(run / "checkpoints" / "best", trainer.variables)
    for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(same), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.medium
def test_keep_best_of_a_model_run_holds_its_folder_beside_it(tmp_path):
    """A --model run's best checkpoint has its own checkpoint folder, best/model, holding
    the very params of dew's checkpoint beside it (a tiny random Qwen2 on the copy task)."""
    from _checkpoint import tiny_qwen2
    from dew.cli import main
    from dew.models import hf
    from dew.train import load_variables

    folder = tiny_qwen2(tmp_path / "tiny")
    run = tmp_path / "run"
    argv = ["train", "--model", str(folder), "--run", str(run), "--steps", "2", "--keep-best"]
    argv += ["--batch-size", "2", "--groups", "2", "--tasks", "4", "--max-tokens", "3"]
    argv += ["--eval-every", "1", "--eval-tasks", "2", "--eval-samples", "0", "--samples", "0"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    best = run / "checkpoints" / "best"
    _, params = hf.load(best / "model")
    held = load_variables(best, params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(held), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keep_best_without_evaluations_is_refused_naming_it(capsys, tmp_path):
    with pytest.raises(ValueError, match="keep_best keeps the best evaluation's checkpoint"):
        TrainConfig(keep_best=True)
    line = refusal(capsys, ["train", "--keep-best", "--run", str(tmp_path / "r")])
    assert "keep_best" in line and "eval_every" in line, line


@pytest.mark.medium
def test_a_best_checkpoint_without_its_evaluation_is_refused_at_resume_in_one_line(
    capsys, tmp_path
):
    """A --keep-best run resumed over a checkpoints/best whose record holds no evaluation (not
    written by --keep-best, or edited) is refused before anything starts, naming the file; it
    was a traceback once the run had begun."""
    run = tmp_path / "run"
    argv = ["train", "--run", str(run), "--keep-best", "--eval-every", "1", "--eval-tasks", "2"]
    argv += ["--batch-size", "2", "--groups", "2", "--tasks", "4", "--samples", "0"]
    argv += ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
    from dew.cli import main

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main([*argv, "--steps", "1"]) == 0
    record = run / "checkpoints" / "best" / "checkpoint.json"
    saved = json.loads(record.read_text())
    saved["metadata"]["eval"] = "edited"
    record.write_text(json.dumps(saved))
    capsys.readouterr()
    line = refusal(capsys, [*argv, "--steps", "2", "--resume"])
    assert f"{record} holds no evaluation" in line, line


def test_keeping_no_checkpoint_is_refused_naming_it(tmp_path):
    from dew.train import Checkpoint, save_checkpoint

    with pytest.raises(ValueError, match="keep_checkpoints must be an int within"):
        TrainConfig(keep_checkpoints=0)
    with pytest.raises(ValueError, match="keep must be an int"):
        save_checkpoint(tmp_path, Checkpoint({}, {}, 0, 0), keep=0)
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_the_record_holds_reward_std_and_the_length_of_what_trains():
    """Rollouts of 2, 4 and 6 completion tokens train; a TRUNCATED one of 8 trains only under
    truncation zero (under mask it is left out); one of two calls counts both calls' tokens."""
    from dew.objectives.rl.sessions import Call, Session, session_metrics

    two_calls = Session(
        Status.COMPLETED,
        tuple(
            Call(np.array([7 + k], np.int32), np.ones(3, np.int32), np.full(3, -0.5, np.float32), 0)
            for k in range(2)
        ),
        0.25,
    )
    sessions = [
        one_call(Status.COMPLETED, 1.0, sample=0, length=3),
        one_call(Status.AGENT_ERROR, 0.0, sample=1, length=5),
        one_call(Status.COMPLETED, 0.5, sample=2, length=7),
        one_call(Status.TRUNCATED, 0.75, sample=3, length=9),
        two_calls,
    ]
    rewards = [1.0, 0.0, 0.5, 0.75, 0.25]
    for truncation, lengths in [("mask", [2, 4, 6, 6]), ("zero", [2, 4, 6, 8, 6])]:
        packed = pack([sessions], width=16, rows=4, truncation=truncation)
        metrics = session_metrics(sessions, packed)
        assert metrics["reward/std"] == pytest.approx(np.std(rewards))
        assert metrics["length/mean"] == pytest.approx(np.mean(lengths))
        assert metrics["length/max"] == max(lengths)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    estimator=st.sampled_from(["k1", "k2", "k3", "abs"]),
    aggregation=st.sampled_from(AGGREGATIONS),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([0.05, 0.5, 30.0]),
)
@pytest.mark.medium
def test_each_reference_kl_estimator_matches_numpy(estimator, aggregation, seed, spread):
    """The loss and `kl/reference` under each estimator, against the NumPy reference (which
    states each formula once); a spread of 30 nats meets the clamp at 20."""
    rng = np.random.default_rng(seed)
    variables, batch = table(rng), random_batch(rng, spread=spread)
    objective = GRPOObjective(bigram, kl_coef=0.3, kl_estimator=estimator, aggregation=aggregation)
    loss, metrics = objective.loss(variables, batch)
    expected, kl = reference_loss(variables, batch, objective)
    np.testing.assert_allclose(float(loss), expected, rtol=2e-5, atol=2e-5 * max(1, abs(expected)))
    np.testing.assert_allclose(float(metrics["kl/reference"]), kl, rtol=2e-5, atol=2e-5)
    grads = jax.grad(lambda v: objective.loss(v, batch)[0])(variables)["table"]
    assert np.isfinite(np.asarray(grads)).all()


def test_the_kl_estimator_is_a_dew_train_option_and_a_bad_one_is_refused(capsys, tmp_path):
    assert _levers(TrainConfig(kl_coef=0.1, kl_estimator="k2"))["kl_estimator"] == "k2"
    assert GRPOObjective(bigram).kl_estimator == "k3"  # today's penalty, unchanged
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        GRPOObjective(bigram, kl_estimator="k4")
    line = refusal(capsys, ["train", "--run", str(tmp_path / "run"), "--kl-estimator", "k4"])
    assert "kl_estimator must be one of ('k3', 'k1', 'k2', 'abs'), got 'k4'" in line


def test_the_reference_sync_copies_the_updated_params_every_nth_update():
    """`reference_sync(3)` chained after SGD, over 7 updates, against the params NumPy computes:
    the initial ones until the 3rd update, the 3rd's until the 6th, then the 6th's."""
    from dew.train._reference import reference_sync, synced_reference

    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.standard_normal(4), jnp.float32)}
    optimizer = optax.chain(optax.sgd(0.1), reference_sync(3))
    state = optimizer.init(params)
    history = [np.asarray(params["w"])]
    for update in range(1, 8):
        grads = {"w": jnp.asarray(rng.standard_normal(4), jnp.float32)}
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(np.asarray(params["w"]))
        want = history[update // 3 * 3]
        reference = synced_reference(state, params, every=3)
        np.testing.assert_array_equal(np.asarray(reference["w"]), want)
        if update % 3:  # held in the state, an exact copy of the params it was handed
            np.testing.assert_array_equal(np.asarray(state[1].reference["w"]), want)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        reference_sync(0)
    with pytest.raises(ValueError, match="holds 0 reference_sync states"):
        synced_reference(optax.sgd(0.1).init(params), params, every=3)


@pytest.mark.medium
def test_a_re_synced_reference_is_checkpointed_so_a_resumed_run_goes_on_against_it(tmp_path):
    """`dew train --kl-coef 0.1 --ref-sync-every 2`, for real: a batch packed right after a
    sync meets a reference equal to the policy (kl/reference ~ 0), the others one update
    behind (> 0); the checkpoint at 3 updates holds update 2's weights as the reference (its
    own weights are update 3's), and the run resumed from it goes on against that reference:
    the resumed trainer holds it, and its first batch, packed at 3 updates, meets a reference
    one update behind (kl/reference > 0, not the ~0 of a reference re-derived from the
    checkpoint's weights)."""
    from dew import train
    from dew.train import load_variables, read_kept
    from dew.train._reference import synced_reference

    tiny = {"d_model": 16, "heads": 2, "layers": 1, "d_ff": 32, "tasks": 16, "samples": 0}
    config = TrainConfig(
        steps=3,
        batch_size=2,
        groups=4,
        entropy_coef=0.05,  # the tiny policy scores no reward: the bonus moves its weights
        kl_coef=0.1,
        ref_sync_every=2,
        learning_rate=0.01,
        checkpoint_every=1,
        keep_checkpoints=3,
        **tiny,
    )
    run = tmp_path / "run"
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        stopped = train.train(config, run)
        (update_2,) = [
            record for record in read_kept(run / "checkpoints") if record["updates"] == 2
        ]
        weights_2 = load_variables(run / "checkpoints", stopped.variables, record=update_2)
        resumed = train.train(attrs.evolve(config, steps=4), run, resume=True)
    held = synced_reference(stopped.opt_state, stopped.variables, every=2)
    jax.tree.map(np.testing.assert_array_equal, held, weights_2)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(stopped.variables), strict=True)
    )
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [line["kl/reference"] for line in lines]
    # Step k's batch is packed at k updates: synced at 0 (the initial weights) and 2.
    assert [value < 1e-6 for value in kl] == [True, False, True, False], kl
    # At 4 updates the resumed run synced again: its reference is its own weights now.
    jax.tree.map(
        np.testing.assert_array_equal,
        synced_reference(resumed.opt_state, resumed.variables, every=2),
        resumed.variables,
    )


def test_a_reference_sync_without_a_kl_penalty_is_refused_naming_it(capsys, tmp_path):
    with pytest.raises(ValueError, match="ref_sync_every re-syncs the KL penalty's reference"):
        TrainConfig(ref_sync_every=2)
    line = refusal(capsys, ["train", "--run", str(tmp_path / "run"), "--ref-sync-every", "-1"])
    assert "ref_sync_every" in line, line


def wandb_records(path) -> list:
    """The protobuf records of a W&B run file (`run-ID.wandb`), read with wandb's own message
    definitions: after a 7-byte header (`:W&B`, magic, version), LevelDB's log format of
    32 KiB blocks, each record in pieces with a 7-byte header (crc32c, length, kind: 1 whole,
    2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, offset, pending, records = 32768, 7, b"", []
    while offset + 7 <= len(data):
        room = block - offset % block
        if room < 7:  # a block's tail too short for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if kind == 0 and length == 0:  # zeros pad the block's end
            offset += room
            continue
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.medium
def test_a_dew_train_run_logs_its_config_and_every_line_to_wandb_offline(tmp_path):
    """`dew train --wandb PROJECT`, for real and offline (no network here): the W&B run file
    under RUN/wandb/ holds the run's config and, at each step `updates`, every finite number
    of that step's metrics line."""
    from dew import train

    tiny = {"d_model": 16, "heads": 2, "layers": 1, "d_ff": 32, "tasks": 16, "samples": 0}
    config = TrainConfig(steps=2, batch_size=2, groups=4, wandb="dew-tests", **tiny)
    run = tmp_path / "run"
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        train.train(config, run)
    (written,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(written)
    (started,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert started.project == "dew-tests"
    logged_config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert {key: logged_config[key] for key in ("steps", "wandb", "wandb_mode")} == {
        "steps": 2,
        "wandb": "dew-tests",
        "wandb_mode": "offline",
    }
    history = {
        record.history.step.num: {
            # A key may come split at its slashes (nested_key) rather than whole (key).
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        for record in records
        if record.WhichOneof("record_type") == "history"
    }
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(history) == [line["updates"] for line in lines] == [1, 2]
    for line in lines:
        numbers = {
            name: value
            for name, value in line.items()
            if name not in ("step", "updates")
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and np.isfinite(value)
        }
        assert {"loss", "entropy", "learning_rate", "reward/mean"} <= set(numbers)
        logged = history[line["updates"]]
        assert {name: logged[name] for name in numbers} == pytest.approx(numbers, rel=1e-12)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--wandb", "team/project"], "wandb must be a W&B project's name"),
        (["--wandb", "p", "--wandb-mode", "cloud"], "wandb_mode must be one of"),
    ],
)
@pytest.mark.medium
def test_bad_wandb_options_are_refused_naming_them(argv, message, capsys, tmp_path):
    line = refusal(capsys, ["train", "--run", str(tmp_path / "run"), *argv])
    assert message in line, line
