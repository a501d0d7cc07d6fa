"""A small decoder-only transformer in pure JAX, for the objective, the engine and the demos.

Params are a plain pytree of arrays. `apply` takes packed rows: tokens, positions (restarting at 0
in each segment) and segment ids (0 = padding); attention is causal and never crosses a segment.
"""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp


@attrs.frozen
class TransformerConfig:
    """Shape of the transformer.

    Args:
        vocab: number of token ids.
        d_model: width of the residual stream.
        heads: attention heads; d_model must divide by it.
        layers: transformer blocks.
        d_ff: hidden width of each block's MLP.
        max_len: longest position the learned position embedding covers.
    """

    vocab: int = 260
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 256
    max_len: int = 512

    def __attrs_post_init__(self):
        for name in ("vocab", "d_model", "heads", "layers", "d_ff", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} must divide by heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def init(key: jax.Array, config: TransformerConfig) -> dict:
    """Random params for `config`: scaled normal weights, unit layer-norm gains, zero biases."""
    keys = iter(jax.random.split(key, 3 + 4 * config.layers))

    def dense(fan_in: int, fan_out: int, scale: float = 1.0) -> jax.Array:
        return jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) * (
            scale / jnp.sqrt(jnp.float32(fan_in))
        )

    d, f = config.d_model, config.d_ff
    residual_scale = 1.0 / (2.0 * config.layers) ** 0.5
    blocks = []
    for _ in range(config.layers):
        blocks.append(
            {
                "ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
                "qkv": dense(d, 3 * d),
                "out": dense(d, d, residual_scale),
                "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
                "up": dense(d, f),
                "down": dense(f, d, residual_scale),
            }
        )
    return {
        "embed": jax.random.normal(next(keys), (config.vocab, d), jnp.float32) * 0.02,
        "position": jax.random.normal(next(keys), (config.max_len, d), jnp.float32) * 0.02,
        "blocks": blocks,
        "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "unembed": dense(d, config.vocab),
    }


def layer_norm(params: dict, x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * params["scale"] + params["bias"]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Multi-head attention of queries over keys where `allowed`.

    q: [..., Q, heads, head_dim]; k, v: [..., K, heads, head_dim]; allowed: bool[..., Q, K].
    A query with no allowed key (padding) gets zeros.
    """
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(allowed[..., None, :, :], scores, jnp.float32(-1e30))
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(allowed[..., None, :, :], weights, jnp.float32(0))
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def block_qkv(block: dict, x: jax.Array, config: TransformerConfig):
    """The block's queries, keys and values of x: [..., T, d_model] -> 3 x [..., T, heads, hd]."""
    qkv = layer_norm(block["ln1"], x) @ block["qkv"]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    shape = x.shape[:-1] + (config.heads, config.head_dim)
    return q.reshape(shape), k.reshape(shape), v.reshape(shape)


def block_finish(block: dict, x: jax.Array, attended: jax.Array) -> jax.Array:
    """Add the attention output and the MLP to the residual stream."""
    x = x + attended.reshape(x.shape) @ block["out"]
    return x + jax.nn.gelu(layer_norm(block["ln2"], x) @ block["up"]) @ block["down"]


def embed(params: dict, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    return params["embed"][tokens] + params["position"][positions]


def unembed(params: dict, x: jax.Array) -> jax.Array:
    return layer_norm(params["ln_f"], x) @ params["unembed"]


def apply(
    params: dict,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    config: TransformerConfig,
) -> jax.Array:
    """Next-token logits over packed rows.

    Args:
        params: from `init`.
        tokens: int32[rows, width].
        positions: int32[rows, width], each segment's positions from 0.
        segment_ids: int32[rows, width], 0 = padding; a token attends to earlier tokens of its own
            segment only.
        config: the params' config.

    Returns:
        float32[rows, width, vocab]: at each position, the logits of the next token.
    """
    width = tokens.shape[-1]
    causal = jnp.tril(jnp.ones((width, width), bool))
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    allowed = causal & same & (segment_ids[..., :, None] != 0)
    x = embed(params, tokens, positions)
    for block in params["blocks"]:
        q, k, v = block_qkv(block, x, config)
        x = block_finish(block, x, attend(q, k, v, allowed))
    return unembed(params, x)


def model(config: TransformerConfig):
    """`apply` bound to `config`: the `model(variables, tokens, positions, segment_ids)` the
    objective takes."""

    def bound(params, tokens, positions, segment_ids):
        return apply(params, tokens, positions, segment_ids, config=config)

    return bound
