"""The Llama-family decoder in JAX: `HFModel`, a `dew.models.Model` over a checkpoint's params.

One block serves every family (`_config.FAMILIES`): RMSNorm, grouped-query attention with RoPE
(optionally Llama 3's scaling, q/k/v and output biases, per-head q/k RMSNorm), a SwiGLU MLP, and
an output projection that is the embedding when tied. Params keep the checkpoint's dtype
(float32 or bfloat16); norms, softmax and RoPE's angles are computed in float32, as
`transformers` does, and logits are always float32.

Packed rows, the prompt's prefill and each decode step run the same block; the key/value cache
is `dew.models`' layout (per layer and block of positions, [slots, kv_heads, block, head_dim]),
so a decode step reads only the blocks in use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from dew._checks import int_at_least
from dew.models import (
    _lead,
    _starts,
    _write_prompt,
    _write_step,
    cache_blocks,
    through_layers,
)
from dew.models._adapted import project
from dew.models.hf import _params, sharding
from dew.models.hf._config import HFConfig, check_dtype

# A numpy scalar, not a jax one: making a jax array at import would start JAX's backend, which
# a process joining a pool must leave to jax.distributed.initialize.
_NEGATIVE = np.float32(-1e30)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x over its last axis divided by its root mean square (in float32), then scaled; in
    x's dtype, as transformers' RMSNorm."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(eps))
    return _lead(weight, x.ndim) * normed.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, config: HFConfig) -> jax.Array:
    """x ([..., T, heads, head_dim]) rotated by RoPE at `positions` ([..., T]): each half of
    the head pairs with the other (transformers' rotate_half layout)."""
    inverse = jnp.asarray(config.inverse_frequencies())
    angles = positions.astype(jnp.float32)[..., None] * _lead(inverse, positions.ndim + 1)
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # one for every head
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _product(spec: str) -> Callable:
    """The einsum `spec` of x and a weight, summed in float32 and returned in x's dtype.

    In bfloat16, XLA's CPU backend runs a product summed in float32 on the processor's
    bfloat16 matrix units where it has them (AMX), and one summed in bfloat16 as float32
    arithmetic: 850 against 150 GFLOP a CPU-second for SmolLM2-135M's [1952, 576] x [576, 1536]
    on this repository's Xeon. In float32 it is the plain einsum."""

    def product(x: jax.Array, weight: jax.Array) -> jax.Array:
        return jnp.einsum(spec, x, weight, preferred_element_type=jnp.float32).astype(x.dtype)

    return product


_into_heads = _product("...h,hnd->...nd")
_out_of_heads = _product("...nd,ndh->...h")
_matmul = _product("...i,io->...o")


def _project(x: jax.Array, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
    """x [..., hidden] into heads with weight [hidden, heads, head_dim] (+ bias)."""
    out = project(x, weight, _into_heads)
    return out if bias is None else out + _lead(bias, out.ndim)


def block_qkv(layer: dict, x: jax.Array, positions: jax.Array, config: HFConfig):
    """The block's queries [..., T, heads, hd] and RoPE'd keys and values [..., T, kv_heads,
    hd] of the residual stream x [..., T, hidden] at `positions` [..., T]."""
    h = rms_norm(x, layer["attn_norm"], config.rms_eps)
    q = _project(h, layer["q"], layer.get("q_bias"))
    k = _project(h, layer["k"], layer.get("k_bias"))
    v = _project(h, layer["v"], layer.get("v_bias"))
    if config.qk_norm:
        q = rms_norm(q, layer["q_norm"], config.rms_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_eps)
    return rope(q, positions, config), rope(k, positions, config), v


def block_finish(layer: dict, x: jax.Array, attended: jax.Array, config: HFConfig) -> jax.Array:
    """Add the attention's output projection and the SwiGLU MLP to the residual stream."""
    out = project(attended.astype(x.dtype), layer["o"], _out_of_heads)
    if "o_bias" in layer:
        out = out + _lead(layer["o_bias"], out.ndim)
    x = x + out
    h = rms_norm(x, layer["mlp_norm"], config.rms_eps)
    gated = jax.nn.silu(project(h, layer["gate"], _matmul)) * project(h, layer["up"], _matmul)
    return x + project(gated, layer["down"], _matmul)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grouped-query attention where `allowed`: q [..., Q, heads, hd], k and v [..., K,
    kv_heads, hd], allowed bool[..., Q, K] -> [..., Q, heads, hd]. Query head n reads key head
    n // groups (transformers' repeat_kv). A query with no allowed key gets zeros."""
    kv_heads, head_dim = k.shape[-2], q.shape[-1]
    grouped = q.reshape(*q.shape[:-2], kv_heads, q.shape[-2] // kv_heads, head_dim)
    scores = jnp.einsum("...qngd,...knd->...ngqk", grouped, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(head_dim))
    mask = allowed[..., None, None, :, :]
    weights = jnp.where(mask, jax.nn.softmax(jnp.where(mask, scores, _NEGATIVE), axis=-1), 0.0)
    out = jnp.einsum(
        "...ngqk,...knd->...qngd",
        weights.astype(v.dtype),
        v,
        preferred_element_type=jnp.float32,  # on the matrix units in bfloat16 (`_product`)
    )
    return out.astype(v.dtype).reshape(q.shape)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens]


def unembed(params: dict, x: jax.Array, config: HFConfig, limit: int | None) -> jax.Array:
    """float32[..., vocab]: the next-token logits of the final hidden states; ids at or above
    `limit` (when below vocab) get -1e9, so they are never drawn and their probability is 0."""
    head = params["embed"] if config.tied else params["lm_head"]
    h = rms_norm(x, params["norm"], config.rms_eps)
    logits = jnp.einsum("...h,vh->...v", h, head, preferred_element_type=jnp.float32)
    if limit is None or limit >= config.vocab:
        return logits
    usable = _lead(jnp.arange(config.vocab) < limit, logits.ndim)
    return jnp.where(usable, logits, jnp.float32(-1e9))


def apply(
    params, tokens, positions, segment_ids, *, config: HFConfig, limit: int | None = None
) -> jax.Array:
    """Next-token logits over packed rows: int32[rows, width] tokens, positions (from 0 in each
    segment) and segment ids (0 = padding) -> float32[rows, width, vocab]. A token attends to
    earlier tokens of its own segment only."""
    x = hidden_states(params, tokens, positions, segment_ids, config=config)
    return unembed(params, x, config, limit)


def hidden_states(
    params, tokens, positions, segment_ids, *, config: HFConfig, remat: bool = False
) -> jax.Array:
    """The residual stream after the last layer over packed rows ([rows, width, hidden], the
    params' dtype), before `unembed`'s norm and head: `apply` is `unembed` of it, kept apart so
    the objective can score a chunk of positions at a time. With `remat`, each layer's
    activations are recomputed in the backward pass instead of kept
    (`dew.models.through_layers`)."""
    width = tokens.shape[-1]
    causal = jnp.tril(jnp.ones((width, width), bool))
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    allowed = _lead(causal, same.ndim) & same & (segment_ids[..., :, None] != 0)
    rows = tokens.shape[:-1]

    # The layers run on the rows' positions as one axis, [rows * width, hidden], and only the
    # attention splits them into rows: over [rows, width, hidden] XLA's CPU compiler lays the
    # backward pass's weight gradients out with transposes of three axes, which made the MLP's
    # gradient a third slower (an SmolLM2-135M-shaped MLP, 16 x 122 positions).
    def step(layer: dict, x: jax.Array) -> jax.Array:
        q, k, v = block_qkv(layer, x, positions.reshape(-1), config)
        attended = attend(*(a.reshape(*rows, width, *a.shape[1:]) for a in (q, k, v)), allowed)
        return block_finish(layer, x, attended.reshape(q.shape), config)

    x = embed(params, tokens.reshape(-1))
    x = through_layers(step, params["layers"], x, remat=remat)
    return x.reshape(*rows, width, x.shape[-1])


def init_cache(config: HFConfig, dtype: str, *, slots: int, max_len: int) -> list[dict]:
    """An empty key/value cache: per layer, "k" and "v" as `dew.models.cache_blocks` splits
    positions, each block [slots, kv_heads, block, head_dim] in the params' dtype."""
    return [
        {
            name: [
                jnp.zeros((slots, config.kv_heads, stop - start, config.head_dim), dtype)
                for start, stop in cache_blocks(max_len)
            ]
            for name in ("k", "v")
        }
        for _ in range(config.layers)
    ]


def prefill(params, cache, tokens, slot, *, config: HFConfig, limit: int | None = None):
    """Run a prompt (int32[T], padded at its end) from position 0 into cache slot `slot`: the
    cache with the slot's positions 0..T-1 written, and float32[T, vocab] logits."""
    width = tokens.shape[0]
    positions = jnp.arange(width, dtype=jnp.int32)
    causal = jnp.tril(jnp.ones((width, width), bool))
    x = embed(params, tokens)
    written = []
    for layer, cached in zip(params["layers"], cache, strict=True):
        q, k, v = block_qkv(layer, x, positions, config)
        written.append(
            {
                name: _write_prompt(cached[name], new.transpose(1, 0, 2)[None], slot)
                for name, new in (("k", k), ("v", v))
            }
        )
        x = block_finish(layer, x, attend(q, k, v, causal), config)
    return written, unembed(params, x, config, limit)


def _attend_cache(q, keys: list, values: list, positions):
    """Each slot's attention over its cached positions 0..position, reading only the blocks up
    to the one holding the longest position (a `lax.switch` branch per block count).

    q: [slots, heads, hd]; keys, values: per block [slots, kv_heads, block, hd];
    positions: int32[slots] -> [slots, heads, hd].
    """
    slots, heads, head_dim = q.shape
    kv_heads = keys[0].shape[1]
    grouped = q.reshape(slots, kv_heads, heads // kv_heads, head_dim)
    scale = jnp.sqrt(jnp.float32(head_dim))
    starts = _starts(keys)

    def over(count: int):
        def attend(grouped, keys, values):
            scores = jnp.concatenate(
                [
                    jnp.einsum(
                        "sngd,snld->sngl", grouped, block, preferred_element_type=jnp.float32
                    )
                    for block in keys[:count]
                ],
                axis=-1,
            )
            span = jnp.arange(scores.shape[-1], dtype=jnp.int32)
            allowed = span[None, None, None, :] <= positions[:, None, None, None]
            weights = jax.nn.softmax(jnp.where(allowed, scores / scale, _NEGATIVE), axis=-1)
            weights = weights.astype(values[0].dtype)
            mixed = [
                jnp.einsum("sngl,snld->sngd", weights[..., start : start + block.shape[2]], block)
                for block, start in zip(values[:count], starts, strict=False)
            ]
            return functools.reduce(jnp.add, mixed)

        return attend

    stops = [start + block.shape[2] for block, start in zip(keys, starts, strict=True)]
    needed = jnp.searchsorted(jnp.asarray(stops, jnp.int32), jnp.max(positions), side="right")
    branches = [over(count) for count in range(1, len(keys) + 1)]
    return jax.lax.switch(needed, branches, grouped, keys, values).reshape(q.shape)


def decode(params, cache, tokens, positions, *, config: HFConfig, limit: int | None = None):
    """Advance every slot by one token (int32[slots] tokens at int32[slots] positions): the
    cache with each written, and float32[slots, vocab], each slot's next-token logits."""
    x = embed(params, tokens)
    written = []
    for layer, cached in zip(params["layers"], cache, strict=True):
        q, k, v = block_qkv(layer, x[:, None], positions[:, None], config)
        keys = _write_step(cached["k"], k[:, 0], positions)
        values = _write_step(cached["v"], v[:, 0], positions)
        written.append({"k": keys, "v": values})
        x = block_finish(layer, x, _attend_cache(q[:, 0], keys, values, positions), config)
    return written, unembed(params, x, config, limit)


def init(key: jax.Array, config: HFConfig, dtype: str) -> dict[str, Any]:
    """Random params of `config` in `dtype`: normal(0, 0.02) weights, unit norm gains, zero
    biases, laid out as a loaded checkpoint's."""
    tree = _params.empty_tree(config)
    leaves = list(_params.leaves(config))
    for leaf, leaf_key in zip(leaves, jax.random.split(key, len(leaves)), strict=True):
        kind = leaf.entry.kind
        if kind == "ones":
            value = jnp.ones(leaf.shape, dtype)
        elif kind == "zeros":
            value = jnp.zeros(leaf.shape, dtype)
        else:
            value = (jax.random.normal(leaf_key, leaf.shape, jnp.float32) * 0.02).astype(dtype)
        _params.set_leaf(tree, leaf.path, value)
    return tree


def _dtype(instance, attribute, value):
    check_dtype(value)


@attrs.frozen
class HFModel:
    """A Llama-family checkpoint's decoder as a `dew.models.Model`.

    Args:
        config: the checkpoint's shape (`HFConfig`, read from its `config.json`).
        dtype: the params' dtype, "float32" or "bfloat16"; logits are float32 either way.
        vocab_limit: the tokenizer's vocabulary where it is smaller than the embedding rows
            (checkpoints pad their rows to a round number: Qwen2.5 has 151936 for 151665
            tokens): the rows from it on are never sampled nor given probability, since no
            text decodes from them. None scores every row.
        remat: recompute each layer's activations in the backward pass instead of keeping them
            (see `hidden_states`): a training step's memory for less than one more forward pass.
            The values are the same either way.
    """

    config: HFConfig = attrs.field(validator=attrs.validators.instance_of(HFConfig))
    dtype: str = attrs.field(default="float32", validator=_dtype)
    vocab_limit: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least(1))
    )
    remat: bool = attrs.field(
        default=False, kw_only=True, validator=attrs.validators.instance_of(bool)
    )

    @property
    def vocab(self) -> int:
        """Embedding rows: every token id is below this."""
        return self.config.vocab

    @property
    def max_len(self) -> int:
        """The longest sequence the checkpoint was made for (`max_position_embeddings`)."""
        return self.config.max_len

    def init(self, key: jax.Array) -> dict:
        """Random params laid out as a loaded checkpoint's (see `init`)."""
        return init(key, self.config, self.dtype)

    def __call__(self, params, tokens, positions, segment_ids) -> jax.Array:
        """Next-token logits over packed rows (see `apply`)."""
        return self.head(params, self.hidden_states(params, tokens, positions, segment_ids))

    def hidden_states(self, params, tokens, positions, segment_ids) -> jax.Array:
        """The last layer's residual stream over packed rows (see `hidden_states`)."""
        return hidden_states(
            params, tokens, positions, segment_ids, config=self.config, remat=self.remat
        )

    def head(self, params, hidden: jax.Array) -> jax.Array:
        """float32[..., vocab]: the next-token logits of `hidden_states`' output (see
        `unembed`)."""
        return unembed(params, hidden, self.config, self.vocab_limit)

    def init_cache(self, *, slots: int, max_len: int) -> list[dict]:
        """An empty key/value cache (see `init_cache`)."""
        return init_cache(self.config, self.dtype, slots=slots, max_len=max_len)

    def cache_shardings(self, mesh, cache) -> list[dict]:
        """Where each leaf of `cache` goes on `mesh` when the params are sharded over it (see
        `dew.models.hf.sharding.cache_shardings`)."""
        return sharding.cache_shardings(self, mesh, cache)

    def prefill(self, params, cache, tokens, slot):
        """Run a prompt into one slot of the cache (see `prefill`)."""
        return prefill(params, cache, tokens, slot, config=self.config, limit=self.vocab_limit)

    def decode(self, params, cache, tokens, positions):
        """Advance every slot by one token (see `decode`)."""
        return decode(params, cache, tokens, positions, config=self.config, limit=self.vocab_limit)
