"""Chunked log-probs (issue 42, item 1): `GRPOObjective` scores a model that splits its hidden
states from its head a chunk of positions at a time, to the same values and gradients as the
whole logits, and its compiled step holds no [tokens, vocab] array.

The unchunked path is the same objective over the model as a plain callable: it computes the
whole [rows, width, vocab] logits, as every model was scored before chunking.
"""

import jax
import numpy as np
import optax
import pytest

from _hf_params import drawn
from dew import models
from dew.models import hf
from dew.objectives.rl import _logprobs
from dew.objectives.rl.grpo import GRPOObjective

VOCAB = 300


def hf_model(*, tied: bool) -> hf.HFModel:
    """A small Qwen2-shaped model (biased q/k/v), its head the embedding or its own."""
    config = hf.HFConfig(
        "Qwen2ForCausalLM",
        vocab=VOCAB,
        hidden=32,
        intermediate=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=8,
        max_len=64,
        qkv_bias=True,
        tied=tied,
    )
    return hf.HFModel(config, "float32")


MODELS = {
    "dew": models.model(
        models.TransformerConfig(vocab=VOCAB, d_model=32, heads=2, layers=2, d_ff=64, max_len=64)
    ),
    "hf-untied": hf_model(tied=False),
    "hf-tied": hf_model(tied=True),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_and_params(request):
    model = MODELS[request.param]
    if isinstance(model, hf.HFModel):
        return model, drawn(model, seed=1)
    return model, model.init(jax.random.key(1))


def whole(model):
    """The model as a plain callable: the objective then scores its whole logits."""

    def logits(variables, tokens, positions, segment_ids):
        return model(variables, tokens, positions, segment_ids)

    return logits


def packed(seed: int, rows: int = 3, width: int = 20, *, support: bool = True) -> dict:
    """Random chains packed into rows, trained where a loss mask says, with advantages,
    behaviour and proximal log-probs, and (with `support`) a top-k support at some positions
    that always keeps the token drawn there."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (rows, width)).astype(np.int32)
    positions = np.zeros((rows, width), np.int32)
    segment_ids = np.zeros((rows, width), np.int32)
    for row in range(rows):
        start, segment = 0, 1
        while start < width - 2:
            length = int(rng.integers(2, width // 2))
            stop = min(width, start + length)
            positions[row, start:stop] = np.arange(stop - start)
            segment_ids[row, start:stop] = segment
            start, segment = stop + int(rng.integers(0, 2)), segment + 1
    mask = ((positions > 0) & (rng.random((rows, width)) < 0.8)).astype(np.float32)
    proximal = np.where(mask > 0, rng.uniform(-7, -4, (rows, width)), 0).astype(np.float32)
    behavior = (proximal + 0.3 * rng.standard_normal((rows, width)) * mask).astype(np.float32)
    batch = {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segment_ids,
        "loss_mask": mask,
        "advantages": rng.standard_normal((rows, width)).astype(np.float32),
        "proximal_logprobs": proximal,
        "behavior_logprobs": behavior,
    }
    if support:
        capacity = 24
        kept_tokens = np.full((rows, capacity), -1, np.int32)
        kept_positions = np.full((rows, capacity), -1, np.int32)
        for row in range(rows):
            entries = []
            for position in np.flatnonzero(mask[row])[::2]:
                others = rng.choice(VOCAB, 3, replace=False)
                entries += [
                    (position, t) for t in np.unique(np.append(others, tokens[row, position]))
                ]
            entries = entries[:capacity]
            kept_positions[row, : len(entries)] = [p for p, _ in entries]
            kept_tokens[row, : len(entries)] = [t for _, t in entries]
        batch |= {"support_tokens": kept_tokens, "support_positions": kept_positions}
    return batch


@pytest.mark.parametrize("support", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 25, None])
def test_chunked_log_probs_equal_the_whole_logits(model_and_params, chunk, support):
    model, params = model_and_params
    batch = packed(2, support=support)
    got = GRPOObjective(model, logit_chunk=chunk, temperature=0.7).packed_log_probs(params, batch)
    want = GRPOObjective(whole(model), temperature=0.7).packed_log_probs(params, batch)
    assert np.count_nonzero(np.asarray(want)) > 20
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def reference_entropy(model, params, batch, temperature: float) -> float:
    """The mean entropy over trained tokens of the distribution each token's log-prob is taken
    under, in NumPy float64 from the model's whole logits: the softmax of the logits before it
    over the temperature, renormalised over the support where one covers the position."""
    logits = np.asarray(
        model(params, batch["tokens"], batch["positions"], batch["segment_ids"]), np.float64
    )
    covered: dict[tuple[int, int], list[int]] = {}
    if "support_tokens" in batch:
        for row, entry in np.ndindex(batch["support_positions"].shape):
            position = int(batch["support_positions"][row, entry])
            if position >= 1:
                covered.setdefault((row, position), []).append(
                    int(batch["support_tokens"][row, entry])
                )
    trained = np.argwhere(batch["loss_mask"] > 0)
    entropies = []
    for row, position in trained:
        scaled = logits[row, position - 1] / temperature
        scaled = scaled[covered[row, position]] if (row, position) in covered else scaled
        scaled = scaled - scaled.max()
        p = np.exp(scaled) / np.exp(scaled).sum()
        entropies.append(-(p * np.log(p)).sum())
    return float(np.mean(entropies))


@pytest.mark.medium
@pytest.mark.parametrize("support", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_the_entropy_rides_on_the_chunked_pass_and_matches_numpy(model_and_params, chunk, support):
    """Issue 44 item 1: `entropy` in the loss's metrics is the policy's mean token entropy over
    trained tokens, chunk by chunk as the log-probs are, over the support where there is one."""
    model, params = model_and_params
    batch = packed(4, support=support)
    objective = GRPOObjective(model, logit_chunk=chunk, temperature=0.7)
    _, metrics = jax.jit(objective.loss)(params, batch)
    want = reference_entropy(model, params, batch, temperature=0.7)
    np.testing.assert_allclose(float(metrics["entropy"]), want, rtol=1e-5)
    if support:  # the support's renormalised distribution, not the whole vocabulary's
        plain = {key: value for key, value in batch.items() if not key.startswith("support")}
        assert abs(want - reference_entropy(model, params, plain, temperature=0.7)) > 0.1


@pytest.fixture(scope="module")
def whole_loss(model_and_params):
    """The whole logits' loss and gradient on `packed(3)` per entropy coefficient, computed
    once for the chunk sizes each is compared with (a gradient's compile is most of each
    comparison's time)."""
    model, params = model_and_params
    batch = loss_batch()
    computed = {}

    def loss(entropy_coef: float):
        if entropy_coef not in computed:
            plain = GRPOObjective(whole(model), kl_coef=0.1, entropy_coef=entropy_coef)
            step = jax.jit(jax.value_and_grad(plain.loss, has_aux=True))
            computed[entropy_coef] = step(params, batch)
        return computed[entropy_coef]

    return loss


def loss_batch() -> dict:
    """`packed(3)` with reference log-probs, for the loss's KL term."""
    batch = packed(3)
    batch["reference_logprobs"] = batch["proximal_logprobs"] + np.float32(0.2) * batch["loss_mask"]
    return batch


# 5: twelve chunks of the 60 positions; None: the default, one chunk of a vocabulary this small
# (uneven and padded chunks: the log-prob tests and the even-chunks test below).
@pytest.mark.medium
@pytest.mark.parametrize("chunk", [5, None])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_chunked_loss_and_gradient_equal_the_whole_logits(
    model_and_params, whole_loss, chunk, entropy_coef
):
    model, params = model_and_params
    chunked = GRPOObjective(model, logit_chunk=chunk, kl_coef=0.1, entropy_coef=entropy_coef)
    step = jax.jit(jax.value_and_grad(chunked.loss, has_aux=True))
    (got, _), got_grads = step(params, loss_batch())
    (want, _), want_grads = whole_loss(entropy_coef)
    np.testing.assert_allclose(float(got), float(want), rtol=0, atol=1e-6)
    for path, leaf in jax.tree_util.tree_leaves_with_path(want_grads):
        assert np.any(np.asarray(leaf) != 0) or "bias" in jax.tree_util.keystr(path)
    # 1e-5 of each leaf's scale: the chunks sum a leaf's gradient over positions in another
    # order, and float32 sums of ~1 differ in their last bits (1.9e-5 at most seen, at 1.8).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * max(1.0, np.abs(b).max())
        ),
        got_grads,
        want_grads,
    )


def test_the_positions_are_split_into_even_chunks_none_past_the_one_asked():
    """Issue 42 item 4: 57 positions at 25 a chunk are scored in three chunks of 19, not of 25
    with 18 padded positions' logits (and their gradients) computed for nothing; the log-probs
    are the whole logits' all the same."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, VOCAB)).astype(np.float32)
    hidden = rng.standard_normal((3, 19, 8)).astype(np.float32)
    targets = rng.integers(0, VOCAB, (3, 19)).astype(np.int32)
    seen = []

    def head(states):
        seen.append(states.shape[0])
        return states @ weight

    got, _ = _logprobs.target_log_probs(
        head, hidden, targets, temperature=1.0, chunk=25, support=None
    )
    assert seen == [19]
    logits = hidden.astype(np.float64) @ weight
    picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    want = picked - np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


def test_the_training_step_holds_no_full_logits():
    """The compiled gradient of the loss over 2 x 256 positions of a 32,768-token vocabulary
    needs less than half the scratch memory of one [tokens, vocab] float32 array (64 MiB): the
    whole-logits path needs more than all of it."""
    vocab, rows, width = 32768, 2, 256
    model = models.model(
        models.TransformerConfig(vocab=vocab, d_model=32, heads=2, layers=1, d_ff=64, max_len=256)
    )
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = jax.tree.map(np.asarray, packed(4, rows, width, support=False))
    batch["tokens"] = batch["tokens"] * 100
    logits_bytes = rows * width * vocab * 4

    def scratch(objective) -> int:
        step = jax.jit(jax.grad(lambda p, b: objective.loss(p, b)[0]))
        return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    assert scratch(GRPOObjective(whole(model))) > logits_bytes
    # A chunk's logits and their gradient (8 MiB each) and the two [vocab, d_model] gradients.
    assert scratch(GRPOObjective(model, logit_chunk=64)) < logits_bytes / 2


def test_a_chunked_step_compiles_once_per_shape():
    model = MODELS["hf-tied"]
    params = drawn(model, seed=1)
    objective = GRPOObjective(model, logit_chunk=16)
    optimizer = optax.sgd(1e-3)
    step = objective.update_fn(optimizer)
    state = optimizer.init(params)
    for seed in (5, 6):
        params, state, metrics = step(params, state, packed(seed, support=False))
        assert np.isfinite(float(metrics["loss"]))
    assert step._cache_size() == 1


def test_a_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match="logit_chunk"):
        GRPOObjective(MODELS["dew"], logit_chunk=0)


def _tied_head_gradient(dtype: str, chunk: int | None) -> np.ndarray:
    """The tied embedding's gradient of the loss, as float32, for the tied model with its
    params rounded to bfloat16 (then held in `dtype`), scored `chunk` positions at a time."""
    import jax.numpy as jnp

    model = hf.HFModel(MODELS["hf-tied"].config, dtype)
    rounded = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), drawn(MODELS["hf-tied"], seed=1))
    params = jax.tree.map(lambda leaf: leaf.astype(dtype), rounded)
    objective = GRPOObjective(model, logit_chunk=chunk)
    grads = jax.jit(jax.grad(lambda p, b: objective.loss(p, b)[0]))(params, loss_batch())
    return np.asarray(grads["embed"].astype(jnp.float32))


@pytest.mark.medium
def test_a_bfloat16_tied_heads_gradient_is_summed_over_the_chunks_in_float32():
    """Issue 42: the tied embedding's gradient through the head, a chunk at a time, is summed
    in float32 and rounded to bfloat16 once, where each chunk rounded the running sum (and
    converted the whole embedding to float32 for its own backward pass). Scored one position a
    chunk (57 chunks), it is the one-chunk gradient but for one rounding of a few elements
    (before: 85 % of the elements differed, by up to 1.7 % of the gradient's scale), and the
    float32 model's gradient within bfloat16's precision."""
    whole = _tied_head_gradient("bfloat16", None)
    chunked = _tied_head_gradient("bfloat16", 1)
    exact = _tied_head_gradient("float32", None)
    scale = np.abs(exact).max()
    assert np.mean(chunked != whole) < 0.25
    assert np.abs(chunked - whole).max() <= 2**-7 * scale
    assert np.abs(chunked - exact).max() <= 2**-7 * scale


@pytest.mark.medium
def test_a_float32_head_is_scored_as_it_always_was():
    """The float32 path is left bit for bit as it was: where every param the head reads is
    float32, the head the log-prob pass runs is the model's own, given the params."""
    import jax.numpy as jnp

    model, params = MODELS["hf-tied"], drawn(MODELS["hf-tied"], seed=1)
    states = jax.ShapeDtypeStruct((1, model.config.hidden), jnp.float32)
    head = _logprobs.summed_in_float32(model.head, params, states)
    assert head.func == model.head and head.args == (params,)
