"""Row chunks (issues 42 and 43: a game's rows fit in memory): `GRPOObjective` runs the model
over `row_chunk` rows at a time, each chunk recomputed in the backward pass, to the same
log-probs, loss and gradient as every row at once, and its compiled step holds one chunk's
attention, not the batch's.

A row's attention is [heads, width, width]: 128 rows of 2,048 positions (TextArena's Wordle at
`dew train`'s defaults) held 8 GiB of scores a layer, which is what ran games out of memory.
"""

import jax
import numpy as np
import optax
import pytest

from _hf_params import drawn
from dew import models
from dew.objectives.rl.grpo import ATTENTION_CELLS, GRPOObjective
from test_chunked_logprobs import MODELS, packed

ROWS = 5
CHUNK = 2  # 5 rows in 3 chunks: the last one padded


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_and_params(request):
    model = MODELS[request.param]
    if request.param.startswith("hf"):
        return model, drawn(model, seed=1)
    return model, model.init(jax.random.key(1))


@pytest.mark.parametrize("support", [False, True])
def test_log_probs_by_row_chunks_equal_every_row_at_once(model_and_params, support):
    model, params = model_and_params
    batch = packed(2, rows=ROWS, support=support)
    got = GRPOObjective(model, row_chunk=CHUNK, temperature=0.7).packed_log_probs(params, batch)
    want = GRPOObjective(model, row_chunk=ROWS, temperature=0.7).packed_log_probs(params, batch)
    assert np.count_nonzero(np.asarray(want)) > 30
    # Float32 matmuls over fewer rows may round a last bit apart (1.4e-6 at -8.5 seen).
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.medium
def test_loss_and_gradient_by_row_chunks_equal_every_row_at_once(model_and_params):
    model, params = model_and_params
    batch = packed(3, rows=ROWS)
    batch["reference_logprobs"] = batch["proximal_logprobs"] + np.float32(0.2) * batch["loss_mask"]
    chunked = GRPOObjective(model, row_chunk=CHUNK, kl_coef=0.1, logit_chunk=7)
    plain = GRPOObjective(model, row_chunk=ROWS, kl_coef=0.1, logit_chunk=7)
    (got, got_metrics), got_grads = jax.jit(jax.value_and_grad(chunked.loss, has_aux=True))(
        params, batch
    )
    (want, want_metrics), want_grads = jax.jit(jax.value_and_grad(plain.loss, has_aux=True))(
        params, batch
    )
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6, atol=1e-6)
    assert float(got_metrics["tokens"]) == float(want_metrics["tokens"]) > 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(want_grads):
        assert np.any(np.asarray(leaf) != 0) or "bias" in jax.tree_util.keystr(path)
    # 1e-5 of each leaf's scale: the chunks sum a leaf's gradient over rows in another order.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * max(1.0, np.abs(b).max())
        ),
        got_grads,
        want_grads,
    )


def test_wide_rows_train_one_chunk_of_attention_at_a_time():
    """The compiled gradient over 16 rows of 1,024 positions (4 heads) at the default
    row_chunk needs under a third of the scratch memory of every row at once: one row's
    [heads, width, width] scores is 16 MiB, the batch's 256 MiB a layer."""
    rows, width = 16, 1024
    model = models.model(
        models.TransformerConfig(vocab=64, d_model=32, heads=4, layers=2, d_ff=64, max_len=width)
    )
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = jax.tree.map(np.asarray, packed(4, rows, width, support=False))
    batch["tokens"] = batch["tokens"] % 64
    assert ATTENTION_CELLS // width**2 < rows  # the default chunks these rows

    def scratch(objective) -> int:
        step = jax.jit(jax.grad(lambda p, b: objective.loss(p, b)[0]))
        return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    whole, chunked = scratch(GRPOObjective(model, row_chunk=rows)), scratch(GRPOObjective(model))
    assert chunked < whole / 3, (whole, chunked)


def test_a_narrow_batch_runs_every_row_at_once():
    """The default leaves a narrow batch (the built-in tasks' rows) one call over every row,
    the very program of a chunk that holds them all: the default run pays nothing for it."""
    model = MODELS["dew"]
    params = model.init(jax.random.key(1))
    batch = packed(5, rows=ROWS, support=False)
    assert ATTENTION_CELLS // 20**2 >= ROWS

    def program(objective) -> str:
        return jax.jit(objective.packed_log_probs).lower(params, batch).as_text()

    whole = program(GRPOObjective(model, row_chunk=ROWS))
    assert program(GRPOObjective(model)) == whole
    assert program(GRPOObjective(model, row_chunk=2)) != whole


def test_a_row_chunked_step_compiles_once_per_shape():
    model = MODELS["hf-tied"]
    params = drawn(model, seed=1)
    step = GRPOObjective(model, row_chunk=2).update_fn(optax.sgd(1e-3))
    state = optax.sgd(1e-3).init(params)
    for seed in (5, 6):
        params, state, metrics = step(params, state, packed(seed, rows=ROWS, support=False))
        assert np.isfinite(float(metrics["loss"]))
    assert step._cache_size() == 1


def test_a_row_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match="row_chunk"):
        GRPOObjective(MODELS["dew"], row_chunk=0)
