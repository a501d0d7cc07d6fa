"""GRPOObjective against plain NumPy: packed scoring equals scoring each chain alone, support
renormalisation, one compilation per shape, behaviour importance, the decoupled PPO loss."""

import math

import jax
import numpy as np
import optax
import pytest

from dew import models
from dew.objectives.rl.grpo import GRPOObjective

CONFIG = models.TransformerConfig(vocab=32, d_model=32, heads=2, layers=2, d_ff=64, max_len=64)
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def params():
    return models.init(jax.random.key(0), CONFIG)


def transformer(traces: list | None = None):
    """`models.model(CONFIG)`, noting the shape of each call (under jit: each trace) in `traces`
    when given."""
    bound = models.model(CONFIG)

    def noted(variables, tokens, positions, segment_ids):
        if traces is not None:
            traces.append(tokens.shape)
        return bound(variables, tokens, positions, segment_ids)

    return noted


MODEL = transformer()
# Shared, so tests of the default objective on one shape compile it once between them.
OBJECTIVE = GRPOObjective(MODEL)
SCORE_ALONE = jax.jit(MODEL)


def random_packing(rng, rows: int, width: int):
    """Random chains laid greedily into rows, each its own segment, random tokens in padding.

    Returns the packed batch and the chains as (row, start, tokens).
    """
    tokens = rng.integers(0, CONFIG.vocab, (rows, width)).astype(np.int32)
    positions = np.zeros((rows, width), np.int32)
    segment_ids = np.zeros((rows, width), np.int32)
    placed = []
    for row in range(rows):
        start = 0
        while True:
            length = int(rng.integers(1, width // 2 + 1))
            if start + length > width or rng.random() < 0.1:
                break
            span = slice(start, start + length)
            positions[row, span] = np.arange(length)
            segment_ids[row, span] = len(placed) + 1
            placed.append((row, start, tokens[row, span].copy()))
            start += length
    follows = positions > 0
    loss_mask = (follows & (rng.random((rows, width)) < 0.7)).astype(np.float32)
    batch = {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}
    batch["loss_mask"] = loss_mask
    return batch, placed


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    peak = logits.max(-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))


def scored_alone(params, placed, rows: int, width: int, temperature: float = 1.0) -> np.ndarray:
    """The reference: each chain scored by one model call on just its tokens, [1, length], its
    logits divided by temperature."""
    expected = np.zeros((rows, width))
    for row, start, chain in placed:
        length = len(chain)
        ones = np.ones((1, length), np.int32)
        logits = np.asarray(
            SCORE_ALONE(params, chain[None], np.arange(length, dtype=np.int32)[None], ones)
        )
        lp = log_softmax(logits[0].astype(np.float64) / temperature)
        expected[row, start + 1 : start + length] = lp[np.arange(length - 1), chain[1:]]
    return expected


@pytest.mark.medium
@pytest.mark.parametrize("seed", range(3))
def test_packed_log_probs_equal_each_chain_alone(params, seed):
    rng = np.random.default_rng(seed)
    rows, width = 3, 24
    batch, placed = random_packing(rng, rows, width)
    assert len(placed) >= 3
    got = OBJECTIVE.packed_log_probs(params, batch)
    assert got.shape == (rows, width) and got.dtype == np.float32
    np.testing.assert_allclose(
        np.asarray(got), scored_alone(params, placed, rows, width), **TOLERANCE
    )


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_packed_log_probs_are_of_the_sampling_temperature(params, temperature):
    rng = np.random.default_rng(7)
    rows, width = 3, 24
    batch, placed = random_packing(rng, rows, width)
    got = GRPOObjective(MODEL, temperature=temperature).packed_log_probs(params, batch)
    expected = scored_alone(params, placed, rows, width, temperature)
    np.testing.assert_allclose(np.asarray(got), expected, **TOLERANCE)
    # The temperature is not a no-op: at 1 the same rows score otherwise.
    untempered = np.asarray(OBJECTIVE.packed_log_probs(params, batch))
    assert np.abs(untempered - expected).max() > 0.05


def random_support(rng, batch, capacity: int):
    """Kept-token sets at some trained positions (each holding the drawn token), flattened per
    row into (position, token) slots in random order; -1 fills the unused slots."""
    rows, _ = batch["tokens"].shape
    support_tokens = np.full((rows, capacity), -1, np.int32)
    support_positions = np.full((rows, capacity), -1, np.int32)
    kept_at = {}
    for row in range(rows):
        slots = []
        for position in np.flatnonzero(batch["loss_mask"][row]):
            if rng.random() < 0.5:
                continue
            others = rng.choice(CONFIG.vocab, int(rng.integers(0, 4)), replace=False)
            kept = np.unique(np.append(others, batch["tokens"][row, position]))
            if len(slots) + len(kept) > capacity:
                break
            kept_at[row, position] = kept
            slots += [(position, token) for token in kept]
        order = rng.permutation(capacity)[: len(slots)]
        for slot, (position, token) in zip(order, slots, strict=True):
            support_positions[row, slot] = position
            support_tokens[row, slot] = token
    return support_tokens, support_positions, kept_at


@pytest.mark.parametrize("seed", range(3))
def test_support_renormalises_over_kept_tokens(params, seed):
    rng = np.random.default_rng(10 + seed)
    rows, width = 3, 24
    batch, _ = random_packing(rng, rows, width)
    support_tokens, support_positions, kept_at = random_support(rng, batch, capacity=30)
    assert len(kept_at) >= 3
    objective = OBJECTIVE
    full = np.asarray(objective.packed_log_probs(params, batch))
    batch |= {"support_tokens": support_tokens, "support_positions": support_positions}
    got = np.asarray(objective.packed_log_probs(params, batch))

    logits = np.asarray(
        MODEL(params, batch["tokens"], batch["positions"], batch["segment_ids"])
    ).astype(np.float64)
    expected = full.astype(np.float64)
    for (row, position), kept in kept_at.items():
        before = logits[row, position - 1]
        normaliser = np.log(np.exp(before[kept] - before.max()).sum()) + before.max()
        expected[row, position] = before[batch["tokens"][row, position]] - normaliser
    np.testing.assert_allclose(got, expected, **TOLERANCE)
    for row, position in kept_at:
        assert got[row, position] >= full[row, position]


def test_one_compilation_per_shape(params):
    traces = []
    objective = GRPOObjective(transformer(traces))
    rng = np.random.default_rng(3)
    first, _ = random_packing(rng, 2, 16)
    second, _ = random_packing(rng, 2, 16)
    assert not np.array_equal(first["segment_ids"], second["segment_ids"])
    a = objective.packed_log_probs(params, first)
    b = objective.packed_log_probs(params, second)
    assert not np.allclose(np.asarray(a), np.asarray(b))
    assert traces == [(2, 16)]
    wider, _ = random_packing(rng, 2, 20)
    objective.packed_log_probs(params, wider)
    assert traces == [(2, 16), (2, 20)]


def trained_batch(rng, params, rows: int = 3, width: int = 24, *, spread: float = 0.3):
    """A packed batch with advantages, and proximal and behaviour log-probs near the params'."""
    batch, _ = random_packing(rng, rows, width)
    current = np.asarray(OBJECTIVE.packed_log_probs(params, batch))
    mask = batch["loss_mask"]
    proximal = (current + spread * rng.standard_normal((rows, width))) * (mask > 0)
    behavior = (proximal + 2 * spread * rng.standard_normal((rows, width))) * (mask > 0)
    batch["advantages"] = rng.standard_normal((rows, width)).astype(np.float32)
    batch["proximal_logprobs"] = proximal.astype(np.float32)
    batch["behavior_logprobs"] = behavior.astype(np.float32)
    batch["versions"] = np.zeros((rows, width), np.int32)
    return batch, current


def test_behavior_importance_is_capped_and_masked(params):
    rng = np.random.default_rng(4)
    batch, _ = trained_batch(rng, params, spread=1.0)
    objective = GRPOObjective(transformer(), importance_cap=2.0)
    got = np.asarray(objective.behavior_importance(batch))
    ratio = np.exp(
        batch["proximal_logprobs"].astype(np.float64)
        - batch["behavior_logprobs"].astype(np.float64)
    )
    expected = np.where(batch["loss_mask"] > 0, np.minimum(ratio, 2.0), 0.0)
    np.testing.assert_allclose(got, expected, **TOLERANCE)
    trained = batch["loss_mask"] > 0
    assert np.any(got[trained] == 2.0) and np.any(got[trained] < 1.0)


def reference_loss(batch, current, entropy, clip: float, cap: float) -> dict[str, float]:
    """The decoupled PPO loss and its metrics in NumPy, float64; `entropy` is the policy's at
    each token, float64[rows, width]."""
    trained = batch["loss_mask"] > 0
    advantages = batch["advantages"].astype(np.float64)
    log_importance = np.where(
        trained, batch["proximal_logprobs"] - batch["behavior_logprobs"].astype(np.float64), 0
    )
    importance = np.where(trained, np.minimum(np.exp(log_importance), cap), 0)
    ratio = np.exp(np.where(trained, current - batch["proximal_logprobs"].astype(np.float64), 0))
    surrogate = np.minimum(ratio * advantages, np.clip(ratio, 1 - clip, 1 + clip) * advantages)
    count = max(trained.sum(), 1)
    low = (advantages < 0) & (ratio < 1 - clip)
    high = (advantages > 0) & (ratio > 1 + clip)
    binds = low | high
    loss = -(importance * surrogate)[trained].sum() / count
    k3 = np.exp(log_importance) - 1 - log_importance
    return {
        "loss": loss,
        "kl/behavior_proximal": k3[trained].sum() / count,
        "clip_fraction": binds[trained].sum() / count,
        "clip_fraction/low": low[trained].sum() / count,
        "clip_fraction/high": high[trained].sum() / count,
        "importance/mean": importance[trained].sum() / count,
        "importance/max": importance.max(),
        "ratio/mean": ratio[trained].sum() / count,
        "entropy": entropy[trained].sum() / count,
        "tokens": trained.sum(),
    }


@pytest.mark.parametrize("use_jit", [False, True])
def test_loss_matches_numpy(params, use_jit):
    rng = np.random.default_rng(5)
    batch, current = trained_batch(rng, params)
    objective = GRPOObjective(transformer(), clip=0.2, importance_cap=3.0)
    loss_fn = jax.jit(objective.loss) if use_jit else objective.loss
    loss, metrics = loss_fn(params, batch)
    logits = np.asarray(MODEL(params, batch["tokens"], batch["positions"], batch["segment_ids"]))
    log_p = log_softmax(logits)
    # The distribution at p predicts token p + 1: shifted by one, as the log-probs are.
    entropy = np.pad(-(np.exp(log_p) * log_p).sum(-1)[:, :-1], ((0, 0), (1, 0)))
    expected = reference_loss(batch, current, entropy, clip=0.2, cap=3.0)
    assert set(metrics) == set(expected)
    np.testing.assert_allclose(float(loss), expected["loss"], **TOLERANCE)
    for name, value in expected.items():
        np.testing.assert_allclose(float(metrics[name]), value, err_msg=name, **TOLERANCE)
    # The batch exercises both sides of the clip and of the cap.
    assert 0 < expected["clip_fraction"] < 1
    assert expected["importance/max"] == 3.0
    assert expected["kl/behavior_proximal"] > 0


def test_loss_without_trained_tokens_is_zero(params):
    rng = np.random.default_rng(6)
    batch, _ = trained_batch(rng, params)
    batch["loss_mask"] = np.zeros_like(batch["loss_mask"])
    loss, metrics = jax.jit(OBJECTIVE.loss)(params, batch)
    assert float(loss) == 0.0
    assert {name: float(value) for name, value in metrics.items()} == {
        "loss": 0.0,
        "kl/behavior_proximal": 0.0,
        "clip_fraction": 0.0,
        "clip_fraction/low": 0.0,
        "clip_fraction/high": 0.0,
        "importance/mean": 0.0,
        "importance/max": 0.0,
        "ratio/mean": 0.0,
        "entropy": 0.0,
        "tokens": 0.0,
    }


@pytest.mark.medium
def test_gradient_is_finite_and_nonzero(params):
    rng = np.random.default_rng(7)
    batch, _ = trained_batch(rng, params)
    support_tokens, support_positions, _ = random_support(rng, batch, capacity=30)
    batch |= {"support_tokens": support_tokens, "support_positions": support_positions}
    # A wild proximal log-prob at an untrained token must not leak into the gradient.
    batch["proximal_logprobs"][batch["loss_mask"] == 0] = -200.0
    grads, _ = jax.jit(jax.grad(OBJECTIVE.loss, has_aux=True))(params, batch)
    leaves = jax.tree.leaves(grads)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in leaves)
    assert float(optax.tree.norm(grads)) > 0


def test_update_fn_lowers_the_loss(params):
    rng = np.random.default_rng(8)
    batch, _ = trained_batch(rng, params)
    objective = OBJECTIVE
    optimizer = optax.sgd(1e-3)
    update = objective.update_fn(optimizer)
    variables, opt_state, metrics = update(params, optimizer.init(params), batch)
    assert float(metrics["grad_norm"]) > 0
    np.testing.assert_allclose(
        float(metrics["loss"]), float(objective.loss(params, batch)[0]), **TOLERANCE
    )
    assert float(objective.loss(variables, batch)[0]) < float(metrics["loss"])


def test_a_non_finite_step_leaves_the_weights_and_optimizer_state_as_they_were(params):
    """A NaN advantage makes the loss and gradient NaN: the step reports it and changes
    nothing, so NaN never reaches the weights."""
    batch, _ = trained_batch(np.random.default_rng(8), params)
    trained = np.argwhere(np.asarray(batch["loss_mask"]) > 0)[0]
    advantages = np.array(batch["advantages"])
    advantages[tuple(trained)] = np.nan
    batch = {**batch, "advantages": advantages}
    optimizer = optax.sgd(1e-3, momentum=0.9)  # a state to keep as well
    state = optimizer.init(params)
    variables, opt_state, metrics = OBJECTIVE.update_fn(optimizer)(params, state, batch)
    assert not math.isfinite(float(metrics["loss"]))
    before, after = jax.tree.leaves((params, state)), jax.tree.leaves((variables, opt_state))
    for new, old in zip(after, before, strict=True):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("clip", 0.0),
        ("clip", 1.0),
        ("clip", -0.1),
        ("clip", math.nan),
        ("clip", True),
        ("clip", "0.2"),
        ("importance_cap", 0.5),
        ("importance_cap", math.inf),
        ("importance_cap", math.nan),
        ("importance_cap", None),
        ("temperature", 0.0),
        ("temperature", -1.0),
        ("temperature", math.inf),
        ("temperature", "1"),
    ],
)
def test_bad_hyper_parameters_raise(argument, value):
    with pytest.raises(ValueError, match=f"^{argument} must be"):
        GRPOObjective(transformer(), **{argument: value})


def test_model_must_be_callable():
    with pytest.raises(ValueError, match="^model must be callable"):
        GRPOObjective("transformer")


def test_hyper_parameters_are_keyword_only():
    with pytest.raises(TypeError):
        GRPOObjective(transformer(), 0.2)


@pytest.mark.medium
def test_missing_keys_are_named(params):
    rng = np.random.default_rng(9)
    batch, _ = trained_batch(rng, params)
    objective = OBJECTIVE
    del batch["proximal_logprobs"]
    with pytest.raises(KeyError, match="proximal_logprobs"):
        objective.loss(params, batch)
    with pytest.raises(KeyError, match="support_positions"):
        objective.packed_log_probs(params, batch | {"support_tokens": batch["tokens"]})
