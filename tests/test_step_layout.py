"""How a checkpoint model's training step compiles on XLA's CPU backend (issue 42, the update's
seconds): what made the step slow, checked on the compiled program of a tiny model, never by
timing it."""

import re

import attrs
import jax
import jax.numpy as jnp

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


def test_a_bfloat16_models_products_sum_in_float32():
    """Every matrix product of a bfloat16 checkpoint's forward pass sums in float32 (and rounds
    to bfloat16 after): XLA's CPU backend runs those on the processor's bfloat16 matrix units
    (AMX) and one summed in bfloat16 as float32 arithmetic, 5.7 times slower for SmolLM2-135M's
    MLP shapes here; its 16 x 122 step with remat took 14.4 CPU-seconds against 11.0."""
    model = attrs.evolve(MODELS["hf-untied"], dtype="bfloat16")
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = packed(7)
    forward = jax.make_jaxpr(model.hidden_states)(
        params, batch["tokens"], batch["positions"], batch["segment_ids"]
    )
    products = [e for e in _equations(forward.jaxpr) if e.primitive.name == "dot_general"]
    assert len(products) >= 9  # q, k, v, the attention's two, o, gate, up, down
    summed = [e.params["preferred_element_type"] for e in products]
    assert all(dtype == jnp.float32 for dtype in summed), summed


def _equations(jaxpr) -> list:
    """The equations of `jaxpr` and of every jaxpr nested in them (jit's, custom VJPs')."""
    found = []
    for equation in jaxpr.eqns:
        found.append(equation)
        for value in equation.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _equations(inner)
    return found
