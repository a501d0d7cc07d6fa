"""GRPOObjective's levers against plain NumPy on random batches: the importance weight's level
(token, sequence, geometric) and correction (truncate, mask), the loss aggregation, the
reference KL, the importance metrics and the mismatch split; gradients stay finite at extreme
weights, and bad settings are refused naming the argument.

The model is a bigram table (the logits of a token are a row of the variables): a real model
whose log-probs are cheap to compute in NumPy, so hypothesis can draw many batches.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.objectives.rl.grpo import (
    AGGREGATIONS,
    CORRECTIONS,
    IMPORTANCE_LEVELS,
    GRPOObjective,
    mismatch_metrics,
)

VOCAB = 7
ROWS, WIDTH = 3, 12
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}


def assert_trains_alike(rescore, current, variables, batch, bare) -> dict:
    """`current` over `bare` (no proximal log-probs) gives `rescore`'s loss, gradient and
    every one of its metrics over `batch` (rescored at `variables`); returns `current`'s
    metrics."""
    (loss, metrics), grads = jax.value_and_grad(rescore.loss, has_aux=True)(variables, batch)
    (loss_c, metrics_c), grads_c = jax.value_and_grad(current.loss, has_aux=True)(variables, bare)
    np.testing.assert_allclose(float(loss_c), float(loss), **TOLERANCE)
    np.testing.assert_allclose(grads_c["table"], grads["table"], **TOLERANCE)
    for name, value in metrics.items():
        np.testing.assert_allclose(float(metrics_c[name]), float(value), **TOLERANCE)
    return metrics_c


def bigram(variables, tokens, positions, segment_ids):
    """float32[rows, width, vocab]: the logits after each token are its row of the table."""
    return variables["table"][tokens]


def table(rng) -> dict:
    return {"table": jnp.asarray(rng.standard_normal((VOCAB, VOCAB)), jnp.float32)}


def random_batch(rng, *, spread: float) -> dict[str, np.ndarray]:
    """Random segments laid into rows, a random loss mask past each segment's first token,
    advantages, and behaviour, proximal and reference log-probs spread around each other."""
    tokens = rng.integers(0, VOCAB, (ROWS, WIDTH)).astype(np.int32)
    positions = np.zeros((ROWS, WIDTH), np.int32)
    segment_ids = np.zeros((ROWS, WIDTH), np.int32)
    for row in range(ROWS):
        start, segment = 0, 1
        while start < WIDTH and rng.random() < 0.85:
            length = int(rng.integers(1, WIDTH - start + 1))
            positions[row, start : start + length] = np.arange(length)
            segment_ids[row, start : start + length] = segment
            start, segment = start + length, segment + 1
    mask = ((positions > 0) & (rng.random((ROWS, WIDTH)) < 0.8)).astype(np.float32)
    noise = lambda: spread * rng.standard_normal((ROWS, WIDTH))  # noqa: E731
    proximal = (-rng.exponential(1.0, (ROWS, WIDTH)) + 0.0) * mask
    return {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segment_ids,
        "loss_mask": mask,
        "advantages": (rng.standard_normal((ROWS, WIDTH)) * mask).astype(np.float32),
        "proximal_logprobs": proximal.astype(np.float32),
        "behavior_logprobs": (np.minimum(proximal + noise(), 0) * mask).astype(np.float32),
        "reference_logprobs": (np.minimum(proximal + noise(), 0) * mask).astype(np.float32),
        "versions": np.where(mask > 0, rng.integers(0, 3, (ROWS, WIDTH)), -1).astype(np.int32),
    }


def current_log_probs(variables, batch) -> np.ndarray:
    """The bigram's log-prob of each token given the one before it in its segment, float64."""
    logits = np.asarray(variables["table"], np.float64)[batch["tokens"]]
    logits -= logits.max(-1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    out = np.zeros((ROWS, WIDTH))
    for row, p in itertools.product(range(ROWS), range(1, WIDTH)):
        segment = batch["segment_ids"][row, p]
        if segment and batch["segment_ids"][row, p - 1] == segment:
            out[row, p] = log_softmax[row, p - 1, batch["tokens"][row, p]]
    return out


def current_entropy(variables, batch) -> np.ndarray:
    """The entropy -sum_v p_v log p_v of the bigram's distribution at each token its log-prob
    is taken at (0 elsewhere, as `current_log_probs`), float64."""
    logits = np.asarray(variables["table"], np.float64)[batch["tokens"]]
    logits -= logits.max(-1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    entropy = -(np.exp(log_softmax) * log_softmax).sum(-1)
    out = np.zeros((ROWS, WIDTH))
    for row, p in itertools.product(range(ROWS), range(1, WIDTH)):
        segment = batch["segment_ids"][row, p]
        if segment and batch["segment_ids"][row, p - 1] == segment:
            out[row, p] = entropy[row, p - 1]
    return out


def sequences(batch) -> list[np.ndarray]:
    """Each (row, segment)'s trained cells, as boolean masks over the batch."""
    trained = batch["loss_mask"] > 0
    found = []
    for row in range(ROWS):
        for segment in np.unique(batch["segment_ids"][row]):
            cells = np.zeros_like(trained)
            cells[row] = batch["segment_ids"][row] == segment
            if segment and (cells & trained).any():
                found.append(cells & trained)
    return found


def reference_weights(batch, objective) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The level's log weight, the applied weight and the kept tokens, in NumPy float64."""
    trained = batch["loss_mask"] > 0
    log_w = np.where(
        trained,
        batch["proximal_logprobs"].astype(np.float64) - batch["behavior_logprobs"],
        0.0,
    )
    level = log_w.copy()
    if objective.importance_level != "token":
        for cells in sequences(batch):
            total = log_w[cells].sum()
            level[cells] = (
                total if objective.importance_level == "sequence" else total / cells.sum()
            )
    with np.errstate(over="ignore"):
        raw = np.exp(level)
    if objective.correction == "truncate":
        kept = trained
        weight = np.where(trained, np.minimum(raw, objective.importance_cap), 0.0)
    else:
        kept = trained & (raw <= objective.importance_cap) & (raw >= objective.importance_floor)
        weight = np.where(kept, raw, 0.0)
    return level, weight, kept


def reference_loss(variables, batch, objective) -> tuple[float, float | None]:
    """The loss and the reference KL metric (None without kl_coef), in NumPy float64, with the
    surrogate's levers too (clip_high, clip_dual, ratio_level, the entropy bonus:
    tests/test_practitioner_options)."""
    current = current_log_probs(variables, batch)
    trained = batch["loss_mask"] > 0
    _, weight, kept = reference_weights(batch, objective)
    log_ratio = np.where(trained, current - batch["proximal_logprobs"], 0.0)
    if objective.ratio_level == "sequence":  # GSPO: the sequence's mean log-ratio
        for cells in sequences(batch):
            log_ratio[cells] = log_ratio[cells].mean()
    ratio = np.exp(log_ratio)
    advantages = batch["advantages"].astype(np.float64)
    low = 1 - objective.clip
    high = 1 + (objective.clip if objective.clip_high is None else objective.clip_high)
    surrogate = np.minimum(ratio * advantages, np.clip(ratio, low, high) * advantages)
    if objective.clip_dual is not None:
        bounded = np.maximum(surrogate, objective.clip_dual * advantages)
        surrogate = np.where(advantages < 0, bounded, surrogate)
    per_token = -weight * surrogate - objective.entropy_coef * current_entropy(variables, batch)
    kl = None
    if objective.kl_coef > 0:
        gap = np.clip(np.where(kept, batch["reference_logprobs"] - current, 0.0), -20, 20)
        estimate = {
            "k1": -gap,
            "k2": gap**2 / 2,
            "abs": np.abs(gap),
            "k3": np.expm1(gap) - gap,
        }[objective.kl_estimator]
        per_token = per_token + objective.kl_coef * estimate
        kl = estimate[kept].sum() / max(kept.sum(), 1)
    m = np.where(kept, batch["loss_mask"], 0.0)
    if objective.aggregation == "token_mean":
        loss = (m * per_token).sum() / max(m.sum(), 1)
    elif objective.aggregation == "constant":
        loss = (m * per_token).sum() / (ROWS * WIDTH)
    else:
        means = [
            (m * per_token)[cells].sum() / m[cells].sum()
            for cells in sequences(batch)
            if m[cells].sum() > 0
        ]
        loss = sum(means) / max(len(means), 1)
    return float(loss), kl


SETTINGS = st.fixed_dictionaries(
    {
        "importance_level": st.sampled_from(IMPORTANCE_LEVELS),
        "correction": st.sampled_from(CORRECTIONS),
        "aggregation": st.sampled_from(AGGREGATIONS),
        "kl_coef": st.sampled_from([0.0, 0.3]),
        "importance_cap": st.sampled_from([1.0, 2.0, 5.0]),
    }
)


def objective_of(settings: dict, floor: float) -> GRPOObjective:
    floor = floor if settings["correction"] == "mask" else 0.0
    return GRPOObjective(bigram, importance_floor=floor, **settings)


# 60 examples (was 120, half the CPU): each of three bugs put into the importance weights in a
# scratch copy (no floor under masking; masking ignoring the cap at the sequence level; no cap
# on truncated geometric weights) failed the test at 30 examples as at 60.
@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    chosen=SETTINGS,
    floor=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([0.05, 0.5, 2.0]),
)
@pytest.mark.medium
def test_the_loss_and_weights_match_numpy(chosen, floor, seed, spread):
    rng = np.random.default_rng(seed)
    variables, batch = table(rng), random_batch(rng, spread=spread)
    objective = objective_of(chosen, floor)
    _, weight, kept = reference_weights(batch, objective)
    np.testing.assert_allclose(
        np.asarray(objective.behavior_importance(batch)), weight, **TOLERANCE
    )
    loss, metrics = objective.loss(variables, batch)
    expected, kl = reference_loss(variables, batch, objective)
    np.testing.assert_allclose(float(loss), expected, **TOLERANCE)
    assert ("kl/reference" in metrics) == (kl is not None)
    if kl is not None:
        np.testing.assert_allclose(float(metrics["kl/reference"]), kl, **TOLERANCE)
    trained = batch["loss_mask"] > 0
    got = objective.importance_metrics(batch)
    if trained.any():
        assert got["importance/masked"] == pytest.approx(1 - kept[trained].mean(), abs=1e-9)
        level, _, _ = reference_weights(batch, objective)
        for q in (10, 50, 90):
            want = np.percentile(np.exp(level[trained]), q)
            np.testing.assert_allclose(got[f"importance/p{q}"], want, rtol=1e-4)
    else:
        assert got == {}


def test_the_defaults_are_decoupled_ppo_with_token_weights_truncated_at_five():
    objective = GRPOObjective(bigram)
    assert (objective.importance_level, objective.correction, objective.aggregation) == (
        "token",
        "truncate",
        "token_mean",
    )
    assert (objective.importance_cap, objective.importance_floor, objective.kl_coef) == (5, 0, 0)


def test_masking_leaves_out_and_counts_what_truncation_caps():
    rng = np.random.default_rng(3)
    batch = random_batch(rng, spread=2.0)
    truncate = GRPOObjective(bigram, importance_cap=2.0)
    mask = GRPOObjective(bigram, correction="mask", importance_cap=2.0, importance_floor=0.5)
    capped = np.asarray(truncate.behavior_importance(batch))
    masked = np.asarray(mask.behavior_importance(batch))
    trained = batch["loss_mask"] > 0
    assert (capped[trained] == 2.0).any() and truncate.importance_metrics(batch)[
        "importance/masked"
    ] == 0.0
    # Masking zeroes what truncation caps at 2, and what lies below the floor.
    assert (masked[trained & (capped == 2.0)] == 0).all()
    share = mask.importance_metrics(batch)["importance/masked"]
    assert 0 < share < 1
    assert share == pytest.approx(((masked == 0) & trained).sum() / trained.sum())


@pytest.mark.parametrize("level", IMPORTANCE_LEVELS)
def test_masking_leaves_out_what_lies_below_the_floor_at_every_level(level):
    """Row 0's trained tokens drawn at e^-1 (0.37) of the proximal policy's probability, the
    other rows' at it: a floor of 0.5 leaves out row 0's tokens at the token level, its
    sequences (weights e^-n and e^-1) at the sequence and geometric levels, and keeps the
    rest at weight 1. The property's random batches hardly reach a geometric mean below 0.5:
    the floor left out at that level alone passed it at 60 examples as at 120."""
    batch = random_batch(np.random.default_rng(5), spread=0.5)
    trained = batch["loss_mask"] > 0
    below = trained & (np.arange(ROWS) == 0)[:, None]
    behavior = batch["behavior_logprobs"]
    batch["proximal_logprobs"] = np.where(below, behavior - 1.0, behavior).astype(np.float32)
    objective = GRPOObjective(
        bigram,
        importance_level=level,
        correction="mask",
        importance_cap=2.0,
        importance_floor=0.5,
    )
    assert below.any() and (trained & ~below).any()
    weight = np.asarray(objective.behavior_importance(batch))
    np.testing.assert_array_equal(weight, np.where(trained & ~below, 1.0, 0.0))
    masked = objective.importance_metrics(batch)["importance/masked"]
    assert masked == pytest.approx(below.sum() / trained.sum())


@pytest.mark.parametrize(
    "level, correction, aggregation",
    list(itertools.product(IMPORTANCE_LEVELS, CORRECTIONS, AGGREGATIONS)),
)
def test_gradients_stay_finite_at_extreme_weights(level, correction, aggregation):
    """Behaviour log-probs 150 nats from the proximal ones either way (a token weight of
    e^±150, a sequence's far beyond, past float32) and a reference as far from the current
    policy; the proximal policy is the current one rescored, as the scheduler makes it."""
    rng = np.random.default_rng(11)
    variables, batch = table(rng), random_batch(rng, spread=0.1)
    trained = batch["loss_mask"] > 0
    sign = np.where(rng.random((ROWS, WIDTH)) < 0.5, 1.0, -1.0)
    proximal = current_log_probs(variables, batch)
    batch["proximal_logprobs"] = np.where(trained, proximal, 0.0).astype(np.float32)
    batch["behavior_logprobs"] = np.where(trained, proximal - 150.0 * sign, 0.0).astype(np.float32)
    batch["reference_logprobs"] = np.where(trained, proximal - 150.0, 0.0).astype(np.float32)
    objective = GRPOObjective(
        bigram,
        importance_level=level,
        correction=correction,
        importance_floor=0.5 if correction == "mask" else 0.0,
        aggregation=aggregation,
        kl_coef=1.0,
    )
    grads, metrics = jax.grad(objective.loss, has_aux=True)(variables, batch)
    assert np.isfinite(np.asarray(grads["table"])).all()
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["kl/reference"]))
    if correction == "truncate":  # masking may leave every token out
        assert float(optax.tree.norm(grads)) > 0


def test_the_mismatch_splits_by_the_version_a_token_was_sampled_at():
    rng = np.random.default_rng(5)
    batch = random_batch(rng, spread=0.3)
    trained = batch["loss_mask"] > 0
    log_rho = (batch["proximal_logprobs"] - batch["behavior_logprobs"].astype(np.float64))[trained]
    k3 = np.expm1(log_rho) - log_rho
    fresh = batch["versions"][trained] == 2
    got = mismatch_metrics(batch, version=2)
    np.testing.assert_allclose(got["mismatch/engine"], k3[fresh].mean(), rtol=1e-12)
    np.testing.assert_allclose(got["staleness/kl"], k3[~fresh].mean(), rtol=1e-12)
    # Tokens sampled at the proximal version with the proximal's own log-probs: no mismatch.
    batch["behavior_logprobs"] = np.where(
        batch["versions"] == 2, batch["proximal_logprobs"], batch["behavior_logprobs"]
    )
    assert mismatch_metrics(batch, version=2)["mismatch/engine"] == 0.0
    # A figure over no tokens is left out.
    assert set(mismatch_metrics(batch, version=7)) == {"staleness/kl"}
    assert GRPOObjective(bigram).importance_metrics(batch, version=2).keys() >= {
        "mismatch/engine",
        "staleness/kl",
    }


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"importance_level": "row"}, "importance_level must be one of"),
        ({"correction": "clip"}, "correction must be one of"),
        ({"aggregation": "mean"}, "aggregation must be one of"),
        ({"kl_coef": -0.1}, "kl_coef must be a finite number >= 0"),
        ({"importance_floor": 1.5, "correction": "mask"}, "importance_floor must be within"),
        ({"importance_floor": 0.5}, "importance_floor bounds masking only"),
        ({"proximal": "loglinear"}, "proximal must be one of"),
    ],
)
def test_bad_settings_are_refused_naming_them(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOObjective(bigram, **settings)


def test_a_kl_coef_needs_reference_log_probs():
    rng = np.random.default_rng(2)
    variables, batch = table(rng), random_batch(rng, spread=0.1)
    del batch["reference_logprobs"]
    with pytest.raises(KeyError, match="reference_logprobs"):
        GRPOObjective(bigram, kl_coef=0.1).loss(variables, batch)


def test_an_empty_batch_leaves_the_weights_and_the_momentum_as_they_were():
    """After a real step the optimizer has momentum; a batch with no trained token (a step filtering
    emptied) must not move the weights on it."""
    rng = np.random.default_rng(9)
    variables, batch = table(rng), random_batch(rng, spread=0.3)
    objective = GRPOObjective(bigram)
    optimizer = optax.sgd(1e-2, momentum=0.9)
    update = objective.update_fn(optimizer)
    variables, state, _ = update(variables, optimizer.init(variables), batch)
    empty = {**batch, "loss_mask": np.zeros_like(batch["loss_mask"])}
    after, after_state, metrics = update(variables, state, empty)
    assert float(metrics["tokens"]) == 0.0
    np.testing.assert_array_equal(np.asarray(after["table"]), np.asarray(variables["table"]))
    for new, old in zip(jax.tree.leaves(after_state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


@pytest.mark.parametrize(
    ("level", "correction"),
    [("token", "truncate"), ("sequence", "mask"), ("geometric", "mask")],
)
def test_the_current_proximal_trains_as_the_rescored_one_without_the_batch_carrying_it(
    level, correction
):
    """Rescored under the weights the update takes, the proximal log-probs are the update's own:
    `proximal="current"` gives the same loss, gradient and weights from a batch without them."""
    rng = np.random.default_rng(11)
    variables, batch = table(rng), random_batch(rng, spread=0.4)
    levers = {"importance_level": level, "correction": correction, "kl_coef": 0.1}
    if correction == "mask":
        levers["importance_floor"] = 0.5
    rescore = GRPOObjective(bigram, **levers)
    current = GRPOObjective(bigram, proximal="current", **levers)
    batch["proximal_logprobs"] = np.asarray(rescore.packed_log_probs(variables, batch))
    bare = {key: value for key, value in batch.items() if key != "proximal_logprobs"}
    with pytest.raises(KeyError, match="proximal_logprobs"):
        rescore.loss(variables, bare)

    metrics_c = assert_trains_alike(rescore, current, variables, batch, bare)
    # The masked share the scheduler would have reported from its rescoring.
    masked = rescore.importance_metrics(batch)["importance/masked"]
    assert float(metrics_c["importance/masked"]) == pytest.approx(masked, abs=1e-6)
    assert (masked > 0) == (correction == "mask")

    optimizer = optax.sgd(0.1, momentum=0.9)
    state = optimizer.init(variables)
    after, _, _ = rescore.update_fn(optimizer)(variables, state, batch)
    after_c, _, _ = current.update_fn(optimizer)(variables, state, bare)
    np.testing.assert_allclose(after_c["table"], after["table"], **TOLERANCE)


@pytest.mark.medium
def test_the_current_proximal_is_the_update_start_not_a_later_weight():
    """Trained for a second update on the same batch, the rescored proximal stays at the first
    update's weights and the ratio moves off 1; the current one moves with the weights: the
    documented reason a loop of several updates per batch must rescore."""
    rng = np.random.default_rng(12)
    variables, batch = table(rng), random_batch(rng, spread=0.2)
    rescore = GRPOObjective(bigram)
    current = GRPOObjective(bigram, proximal="current")
    batch["proximal_logprobs"] = np.asarray(rescore.packed_log_probs(variables, batch))
    optimizer = optax.sgd(0.5)
    moved, _, _ = rescore.update_fn(optimizer)(variables, optimizer.init(variables), batch)
    ratio = float(rescore.loss(moved, batch)[1]["ratio/mean"])
    ratio_c = float(current.loss(moved, batch)[1]["ratio/mean"])
    assert ratio != pytest.approx(1.0, abs=1e-4)
    assert ratio_c == pytest.approx(1.0, abs=1e-6)
