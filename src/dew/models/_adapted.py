"""A projection with a LoRA adapter beside it, unmerged: how a training forward drops out the
adapter's input.

A LoRA adapter usually enters the forward merged into the weight (W + scale * B @ A), one
matmul as the base model's. Dropout on the adapter branch's input (PEFT's `lora_dropout`)
cannot be merged: the branch sees `dropout(x)` where the weight sees `x`, a mask per token and
feature. So a training step with dropout hands the forward, in each targeted weight's place,
an `Adapted` leaf, and every projection of dew's forwards goes through `project`: an array is
multiplied as it always was (the merged path, bit for bit), an `Adapted` leaf computes

    x W + scale * (dropout(x) A^T) B^T

in float32 for the branch, as PEFT's `LoraLayer` does in train mode.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def dropout_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Which features an adapter branch keeps: bool[shape], each True with probability
    1 - rate, drawn from `key` (the mask `Adapted` applies to its input flattened to
    [..., in], for a test to recompute)."""
    return jax.random.bernoulli(key, 1.0 - rate, shape)


@jax.tree_util.register_pytree_node_class
class Adapted:
    """A projection's weight with its adapter beside it and the dropout key of its branch.

    Args:
        weight: the base's weight leaf, as the forward multiplies it ([in, out] or a layout in
            heads: `in_axes` leading axes are the input's).
        lora_A: float32[rank, in]; lora_B: float32[out, rank] (PEFT's layout).
        key: the branch's dropout key for this call.
        scale: alpha / rank.
        rate: the dropout probability, in (0, 1).
        in_axes: how many of `weight`'s leading axes the input fills (2 for a projection out
            of heads, [heads, head_dim, out]; 1 otherwise).
    """

    def __init__(self, weight, lora_A, lora_B, key, *, scale: float, rate: float, in_axes: int):
        self.weight, self.lora_A, self.lora_B, self.key = weight, lora_A, lora_B, key
        self.scale, self.rate, self.in_axes = scale, rate, in_axes

    def tree_flatten(self):
        return (self.weight, self.lora_A, self.lora_B, self.key), (
            self.scale,
            self.rate,
            self.in_axes,
        )

    @classmethod
    def tree_unflatten(cls, static, children):
        scale, rate, in_axes = static
        return cls(*children, scale=scale, rate=rate, in_axes=in_axes)

    def __call__(self, x: jax.Array, product: Callable) -> jax.Array:
        """`product(x, weight)` plus the adapter's branch over `dropout(x)`, in its dtype."""
        out = product(x, self.weight)
        flat = x.reshape(*x.shape[: x.ndim - self.in_axes], -1).astype(jnp.float32)
        kept = dropout_mask(self.key, flat.shape, self.rate)
        dropped = jnp.where(kept, flat / jnp.float32(1.0 - self.rate), jnp.float32(0))
        branch = (dropped @ self.lora_A.T) @ self.lora_B.T * jnp.float32(self.scale)
        return out + branch.reshape(out.shape).astype(out.dtype)


def project(x: jax.Array, weight, product: Callable) -> jax.Array:
    """x through a projection: `product(x, weight)` for a weight array (the forward's own
    matmul or einsum), an `Adapted` weight's own sum for one with its adapter unmerged."""
    if isinstance(weight, Adapted):
        return weight(x, product)
    return product(x, weight)
