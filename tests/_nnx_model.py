"""A second `dew.models.Model`, written with `flax.nnx` and independent of `dew.models`.

A small pre-norm transformer whose cache lays positions before heads ([slots, max_len, heads,
head_dim], the other way round from `dew.models`) and which ties nothing to dew's code: it shows
that the engine, the objective and the scheduler need only the protocol.
"""

from __future__ import annotations

import functools

import attrs
import jax
import jax.numpy as jnp
from flax import nnx

_MASKED = -1e30


class _Block(nnx.Module):
    """Attention and an MLP, each behind a layer norm, added to the residual stream."""

    def __init__(self, width: int, heads: int, hidden: int, rngs: nnx.Rngs):
        self.heads = heads
        self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
        self.query_key_value = nnx.Linear(width, 3 * width, rngs=rngs)
        self.attention_out = nnx.Linear(width, width, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
        self.mlp_in = nnx.Linear(width, hidden, rngs=rngs)
        self.mlp_out = nnx.Linear(hidden, width, rngs=rngs)

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of x: [..., T, width] -> 3 x [..., T, heads, head_dim]."""
        split = x.shape[:-1] + (self.heads, x.shape[-1] // self.heads)
        parts = jnp.split(self.query_key_value(self.attention_norm(x)), 3, axis=-1)
        return tuple(part.reshape(split) for part in parts)

    def finish(self, x: jax.Array, attended: jax.Array) -> jax.Array:
        x = x + self.attention_out(attended.reshape(x.shape))
        return x + self.mlp_out(nnx.relu(self.mlp_in(self.mlp_norm(x))))


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """q: [..., Q, heads, hd]; k, v: [..., K, heads, hd]; allowed: bool[..., Q, K]."""
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) * (1.0 / q.shape[-1] ** 0.5)
    mask = jnp.expand_dims(allowed, -3)
    weights = jax.nn.softmax(jnp.where(mask, scores, jnp.float32(_MASKED)), axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", jnp.where(mask, weights, jnp.float32(0)), v)


class NnxLanguageModel(nnx.Module):
    """Token and position embeddings, `layers` blocks, a final norm and an output projection."""

    def __init__(self, shape: NnxModel, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(shape.vocab, shape.width, rngs=rngs)
        self.positions = nnx.Embed(shape.max_len, shape.width, rngs=rngs)
        self.blocks = nnx.List(
            [_Block(shape.width, shape.heads, 4 * shape.width, rngs) for _ in range(shape.layers)]
        )
        self.norm = nnx.LayerNorm(shape.width, rngs=rngs)
        self.head = nnx.Linear(shape.width, shape.vocab, rngs=rngs)

    def logits(self, x: jax.Array) -> jax.Array:
        return self.head(self.norm(x))


@functools.cache
def _graph(shape: NnxModel) -> nnx.GraphDef:
    return nnx.graphdef(nnx.eval_shape(lambda: NnxLanguageModel(shape, nnx.Rngs(0))))


@attrs.frozen
class NnxModel:
    """`NnxLanguageModel` of this shape as a `dew.models.Model`: params are its `nnx.State`."""

    vocab: int = 260
    width: int = 32
    heads: int = 2
    layers: int = 1
    max_len: int = 64

    def _module(self, params) -> NnxLanguageModel:
        return nnx.merge(_graph(self), params)

    def init(self, key: jax.Array):
        return nnx.state(NnxLanguageModel(self, nnx.Rngs(params=key)))

    def __call__(self, params, tokens, positions, segment_ids) -> jax.Array:
        module = self._module(params)
        width = tokens.shape[-1]
        causal = jnp.tril(jnp.ones((width, width), bool))
        same = segment_ids[..., :, None] == segment_ids[..., None, :]
        allowed = causal.reshape((1,) * (same.ndim - 2) + causal.shape) & same
        allowed = allowed & (segment_ids[..., :, None] != 0)
        x = module.tokens(tokens) + module.positions(positions)
        for block in module.blocks:
            x = block.finish(x, _attend(*block.project(x), allowed))
        return module.logits(x)

    def init_cache(self, *, slots: int, max_len: int) -> list[tuple[jax.Array, jax.Array]]:
        shape = (slots, max_len, self.heads, self.width // self.heads)
        return [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(self.layers)]

    def prefill(self, params, cache, tokens, slot):
        module = self._module(params)
        width = tokens.shape[0]
        x = module.tokens(tokens) + module.positions(jnp.arange(width, dtype=jnp.int32))
        causal = jnp.tril(jnp.ones((width, width), bool))
        written = []
        for block, (keys, values) in zip(module.blocks, cache, strict=True):
            q, k, v = block.project(x)
            start = (slot, jnp.int32(0), jnp.int32(0), jnp.int32(0))
            keys = jax.lax.dynamic_update_slice(keys, k[None], start)
            values = jax.lax.dynamic_update_slice(values, v[None], start)
            written.append((keys, values))
            x = block.finish(x, _attend(q, k, v, causal))
        return written, module.logits(x)

    def decode(self, params, cache, tokens, positions):
        module = self._module(params)
        slots = tokens.shape[0]
        max_len = cache[0][0].shape[1]
        rows = jnp.arange(slots, dtype=jnp.int32)
        x = module.tokens(tokens) + module.positions(positions)
        allowed = jnp.arange(max_len, dtype=jnp.int32)[None, None, :] <= positions[:, None, None]
        written = []
        for block, (keys, values) in zip(module.blocks, cache, strict=True):
            q, k, v = block.project(x)
            keys = keys.at[rows, positions].set(k)
            values = values.at[rows, positions].set(v)
            written.append((keys, values))
            attended = _attend(q[:, None], keys, values, allowed)[:, 0]
            x = block.finish(x, attended)
        return written, module.logits(x)
