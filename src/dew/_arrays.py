"""A copy of a tree of arrays that its receiver owns: the engine takes one of the weights each
push hands it, the trainer one of the weights it starts from and of any state it will donate.

A foundation module, beside `_checks` and `_errors`, because both the engines' room and the
trainer's need it and neither may import the other's private modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def copy_tree(tree):
    """A copy the caller cannot change or donate away after handing it over: one dispatch for
    the whole tree rather than one per leaf, since `RolloutServer.load` runs on the scheduler's
    trio thread."""
    return jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), tree)
