"""Activation checkpointing (issue 42, item 3): a model with `remat` trains exactly as the plain
one (the same loss and gradients), in less memory, and `dew train --remat` builds it."""

import argparse

import attrs
import jax
import numpy as np
import pytest

from _hf_folders import chat_checkpoint
from _hf_params import drawn
from dew import models
from dew.models import hf
from dew.objectives.rl.grpo import GRPOObjective
from dew.train import TrainConfig
from dew.train._cli import configure_cli
from dew.train._config_preflight import _load_tokenizer
from dew.train._run import _model
from test_chunked_logprobs import MODELS, packed


@pytest.mark.medium
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_remat_step_equals_the_plain_step(name):
    model = MODELS[name]
    params = (
        drawn(model, seed=2) if isinstance(model, hf.HFModel) else model.init(jax.random.key(2))
    )
    batch = packed(7)
    gradients = {}
    for remat in (False, True):
        objective = GRPOObjective(attrs.evolve(model, remat=remat), kl_coef=0.1)
        batch["reference_logprobs"] = batch["proximal_logprobs"]
        step = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
        gradients[remat] = step(params, batch)
    (plain, plain_metrics), plain_grads = gradients[False]
    (remat, remat_metrics), remat_grads = gradients[True]
    np.testing.assert_allclose(float(remat), float(plain), rtol=0, atol=1e-6)
    for key, value in plain_metrics.items():
        np.testing.assert_allclose(float(remat_metrics[key]), float(value), rtol=0, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6 * max(1.0, np.abs(b).max())
        ),
        remat_grads,
        plain_grads,
    )


@pytest.mark.medium
def test_remat_keeps_less_for_the_backward_pass():
    """The compiled gradient of an 8-block transformer over 2 x 256 positions needs under half
    the scratch memory with remat: only each block's input is kept, not its attention scores
    and MLP."""
    model = models.model(
        models.TransformerConfig(vocab=64, d_model=64, heads=4, layers=8, d_ff=256, max_len=256)
    )
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = packed(8, 2, 256, support=False)
    batch["tokens"] = batch["tokens"] % 64

    def scratch(remat: bool) -> int:
        objective = GRPOObjective(attrs.evolve(model, remat=remat))
        step = jax.jit(jax.grad(lambda p, b: objective.loss(p, b)[0]))
        return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    plain, remat = scratch(False), scratch(True)
    assert remat < 0.5 * plain, (plain, remat)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_dew_train_remat_builds_its_model_with_remat(checkpoint, tmp_path):
    parser = argparse.ArgumentParser()
    configure_cli(parser)
    assert parser.parse_args([]).remat is None
    assert parser.parse_args(["--remat"]).remat is True
    model = None
    if checkpoint:
        shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
        shape |= {"num_attention_heads": 2, "num_key_value_heads": 1}
        model = str(chat_checkpoint(tmp_path / "qwen2", shape | {"max_position_embeddings": 64}))
    for remat in (False, True):
        config = TrainConfig(model=model, remat=remat)
        built, _ = _model(config, 32, _load_tokenizer(config))
        assert built.remat is remat


def test_remat_must_be_a_bool():
    with pytest.raises(TypeError, match="'remat' must be <class 'bool'>"):
        TrainConfig(remat="yes")
    with pytest.raises(TypeError, match="'remat' must be <class 'bool'>"):
        models.Transformer(models.TransformerConfig(), remat=1)
