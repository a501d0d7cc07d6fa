"""The model protocol: `dew.models.Transformer` and an independent flax.nnx model, each served by
the engine and trained through the same scheduler."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _nnx_model import NnxModel
from dew import models
from dew.envs.environment import Score
from dew.envs.prompts import PromptSource
from dew.envs.tasks import task_dataset
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.serve import RolloutServer, ServedSource, tokenizer
from dew.train import Trainer

MAX_LEN = 64
TRANSFORMER = models.Transformer(
    models.TransformerConfig(d_model=32, heads=2, layers=2, d_ff=64, max_len=MAX_LEN)
)
NNX = NnxModel(width=32, heads=2, layers=1, max_len=MAX_LEN)
MODELS = pytest.mark.parametrize("model", [TRANSFORMER, NNX], ids=["dew", "nnx"])


@MODELS
def test_both_are_models_and_hashable(model):
    assert isinstance(model, models.Model)
    assert hash(model) == hash(type(model)(**_fields(model)))
    assert models.model(TRANSFORMER.config) == TRANSFORMER


def _fields(model) -> dict:
    return (
        {"config": model.config}
        if isinstance(model, models.Transformer)
        else {
            name: getattr(model, name) for name in ("vocab", "width", "heads", "layers", "max_len")
        }
    )


@pytest.mark.medium
@MODELS
def test_prefill_then_decode_gives_the_logits_of_the_whole_sequence(model):
    params = model.init(jax.random.key(1))
    sequence = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab, 12), jnp.int32)
    positions = jnp.arange(12, dtype=jnp.int32)
    full = model(params, sequence[None], positions[None], jnp.ones((1, 12), jnp.int32))[0]
    cache = model.init_cache(slots=2, max_len=MAX_LEN)
    # The prompt's first 8 tokens, padded to 16, into slot 1; then four decode steps.
    padded = jnp.zeros(16, jnp.int32).at[:8].set(sequence[:8])
    cache, logits = jax.jit(model.prefill)(params, cache, padded, jnp.int32(1))
    np.testing.assert_allclose(logits[:8], full[:8], atol=1e-4)
    decode = jax.jit(model.decode)
    for position in range(8, 12):
        tokens = jnp.zeros(2, jnp.int32).at[1].set(sequence[position])
        at = jnp.zeros(2, jnp.int32).at[1].set(position)
        cache, logits = decode(params, cache, tokens, at)
        np.testing.assert_allclose(logits[1], full[position], atol=1e-4)


def ascii_first(task, reply: str) -> Score:
    """1 for a reply that starts with an ASCII character: about half a random policy's replies
    earn it, so most groups have a signal."""
    return Score(float(reply[:1].isascii()))


@pytest.mark.medium
@MODELS
def test_served_and_trained_through_the_scheduler(model):
    params = model.init(jax.random.key(0))
    server = RolloutServer(model, params, slots=16, max_len=MAX_LEN)
    prompts = PromptSource(server, lambda task: "count " + task.name, ascii_first, max_tokens=2)
    source = ServedSource(prompts, server)
    objective = GRPOObjective(model)
    lines = []
    trainer = Trainer(objective, optax.sgd(1e-2), params, on_step=lines.append)
    scheduler = RolloutScheduler(
        objective, source, server, width=32, rows=8, groups=4, truncation="score"
    )
    try:
        trainer.run(scheduler, scheduler.tasks(task_dataset(8, 2)), steps=3)
    finally:
        scheduler.close()
    assert [line["updates"] for line in lines] == [1, 2, 3]
    assert all(math.isfinite(line["loss"]) for line in lines)
    assert any(line["grad_norm"] > 0 for line in lines)
    assert all(line["groups"] == 2 for line in lines)
    assert server.version >= 2
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), trainer.variables, params)
    assert max(jax.tree.leaves(moved)) > 0


class WrongLogits(NnxModel):
    """Breaks the protocol: its decode step returns one row of logits, not one per slot."""

    def decode(self, params, cache, tokens, positions):
        cache, logits = super().decode(params, cache, tokens, positions)
        return cache, logits[:1]


@MODELS
def test_the_engine_grows_a_cache_laid_out_as_dews_and_holds_any_other_whole(model):
    """dew's blocks of positions let the engine hold only what its calls reach; a cache of one's
    own layout (the nnx model's: positions before heads, one array a layer) is held whole."""
    server = RolloutServer(model, model.init(jax.random.key(0)), slots=4, max_len=MAX_LEN)
    whole = MAX_LEN if model is NNX else 32
    assert server.stats().cache_positions == whole


class Counted(NnxModel):
    """Counts the traces of its prefill."""

    traces = 0

    def prefill(self, *args):
        type(self).traces += 1
        return super().prefill(*args)


def test_an_engine_made_again_for_a_model_does_not_trace_its_check_again():
    """A run makes an engine for each evaluation: the check of the model's protocol (a traced
    prefill and decode, 2 CPU-s for a 135M-param model) runs once for each model, layouts of
    params and cache, and slots."""
    model = Counted(width=32, heads=2)
    params = model.init(jax.random.key(0))
    for slots in (4, 4, 2):
        RolloutServer(model, params, slots=slots, max_len=MAX_LEN)
    assert Counted.traces == 2
    RolloutServer(Counted(width=32, heads=2), params, slots=4, max_len=MAX_LEN)  # an equal one
    assert Counted.traces == 2


@pytest.mark.medium
def test_the_engine_refuses_what_breaks_the_protocol():
    params = NNX.init(jax.random.key(0))
    with pytest.raises(TypeError, match="model must be a dew.models.Model .* got dict"):
        RolloutServer({"vocab": 260}, params)
    for _ in range(2):  # a model refused is refused again: only what passed is remembered
        with pytest.raises(ValueError, match=r"decode must return .* logits\[4, 260\]"):
            RolloutServer(WrongLogits(width=32, heads=2), params, slots=4)
    small = NnxModel(vocab=200, width=32, heads=2)
    with pytest.raises(ValueError, match=r"tokenizer's vocabulary \(260 ids\) exceeds the model"):
        RolloutServer(small, small.init(jax.random.key(0)), tokenizer=tokenizer.BYTES)
    with pytest.raises(ValueError, match="params must have the tree layout of the model's init"):
        RolloutServer(NNX, TRANSFORMER.init(jax.random.key(0)))
    wider = NnxModel(width=64, heads=2).init(jax.random.key(0))
    bias = r"params\['blocks'\]\[0\]\['attention_norm'\]\['bias'\]\.value"
    with pytest.raises(ValueError, match=bias + r" must be float32\[32\], got float32\[64\]"):
        RolloutServer(NNX, wider)
