"""Params of a `dew.models.hf` model drawn with NumPy, for the tests' worker processes.

`HFModel.init` runs op by op, compiling a program for each shape and operation: seconds of a
short worker's time, spent again in every process of a pool. These params are drawn at once
and are the same in every process.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def drawn(model, seed: int = 0) -> dict:
    """Params of `model`, every one nonzero so each takes part: weights and biases about 0.02,
    norm gains 1.02."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        if jax.tree_util.keystr(path).endswith("norm']"):
            return jnp.full(leaf.shape, 1.02, leaf.dtype)
        return jnp.asarray(rng.normal(0.02, 0.02, leaf.shape).astype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(draw, jax.eval_shape(model.init, jax.random.key(0)))
