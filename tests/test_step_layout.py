"""How a checkpoint model's training step compiles on XLA's CPU backend (issue 42, the update's
seconds): what made the step slow, checked on the compiled program of a tiny model, never by
timing it."""

import re

import jax

from dew.objectives.rl.grpo import GRPOObjective
from test_chunked_logprobs import MODELS, packed


def test_the_gradient_transposes_no_activation_into_rows_by_width():
    """The layers run on a batch's positions as one axis: the weights' gradients contract the
    activations over it, which XLA lays out by transposing each activation to [features,
    positions]. Over [rows, width] positions the transposes ran over three axes: the MLP's
    gradient of an SmolLM2-135M-shaped layer at 16 x 122 took a third longer, and its whole
    step 20.0 CPU-seconds against 17.2 (the same gradient)."""
    model = MODELS["hf-untied"]
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = packed(7)
    rows, width = batch["tokens"].shape
    objective = GRPOObjective(model)
    step = jax.jit(jax.grad(lambda p, b: objective.loss(p, b)[0]))
    compiled = step.lower(params, batch).compile().as_text()
    into_rows = re.findall(rf"= f32\[[\d,]*,{rows},{width}\]\{{[\d,]*\}} transpose\(", compiled)
    assert not into_rows, into_rows
