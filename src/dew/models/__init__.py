"""The model protocol, and a small decoder-only transformer in pure JAX that implements it.

`Model` is what the objective and the engine need of a language model: random params, next-token
logits over packed rows for training, and the same logits computed incrementally over a key/value
cache for sampling. `Transformer` (the functions below, bound to a `TransformerConfig`) is one
implementation; any other (say, a `flax.nnx` module behind the same methods) trains and serves
through the same objective, engine and scheduler.

The transformer's params are a plain pytree of arrays. `apply` takes packed rows: tokens,
positions (restarting at 0 in each segment) and segment ids (0 = padding); attention is causal
and never crosses a segment. For sampling, `init_cache`, `prefill` and `decode` compute the same
logits incrementally over a key/value cache of fixed [slots, max_len] sequences, one token per
slot per step.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, runtime_checkable

import attrs
import jax
import jax.numpy as jnp

from dew._checks import int_at_least
from dew.models._adapted import project

Params = Any
"""A model's params: a pytree of arrays."""

Cache = Any
"""A model's key/value cache: a pytree of arrays of fixed shape."""


@runtime_checkable
class Model(Protocol):
    """What `GRPOObjective` and `RolloutServer` need of a language model.

    The methods are pure functions of their arguments, traced under `jax.jit` with the model as a
    static argument: a model must be hashable and equal to any model that computes the same
    functions (a frozen attrs class over its configuration is).

    A model whose params may be sharded over a device mesh may also define
    `cache_shardings(mesh, cache)`, a tree of `jax.sharding.Sharding`s laid out as `cache`: the
    engine places its cache on them while it serves params sharded over `mesh`, so that its
    steps find the cache in the layout they hand it back in and compile once (`HFModel` does).

    A model may also split `__call__` in two, `hidden_states(params, tokens, positions,
    segment_ids) -> float[rows, width, hidden]` and `head(params, hidden) -> float32[...,
    vocab]`, with `__call__` their composition: the objective then scores a chunk of positions
    at a time (`GRPOObjective(logit_chunk=...)`) and never holds the [rows, width, vocab] logits,
    2.5 GB for one 4,096-token row over a 151,936-token vocabulary (`Transformer` and `HFModel`
    do).

    A model whose training forward draws at random (a LoRA adapter's dropout,
    `dew.models.hf.lora.LoRAModel`) says so with a true `stochastic` attribute: its `__call__`
    and `hidden_states` then take a keyword `key`, a PRNG key, which a training step hands them
    (`GRPOObjective.update_fn`, from the run's seed and its update count); every other call
    (rescoring, sampling, evaluation) gives none and gets the deterministic forward.

    Attributes:
        vocab: the number of token ids; logits' last axis.
        max_len: the longest sequence (prompt + completion) it can take.
    """

    vocab: int
    max_len: int

    def init(self, key: jax.Array) -> Params:
        """Random params; their tree layout, shapes and dtypes are the ones the engine serves."""
        ...

    def __call__(
        self, params: Params, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """Next-token logits over packed rows, as `apply` documents: int32[rows, width] tokens,
        positions (from 0 in each segment) and segment ids (0 = padding) ->
        float32[rows, width, vocab]."""
        ...

    def init_cache(self, *, slots: int, max_len: int) -> Cache:
        """An empty cache of `slots` sequences of up to `max_len` tokens."""
        ...

    def prefill(
        self, params: Params, cache: Cache, tokens: jax.Array, slot: jax.Array
    ) -> tuple[Cache, jax.Array]:
        """Run a prompt from position 0 into one slot: int32[T] tokens (padded at the end),
        int32 scalar slot -> the cache with the slot's positions 0..T-1 written, and
        float32[T, vocab], the logits at each position (as `__call__` gives them for one
        segment). Later decode steps overwrite what the padding wrote before attending to it."""
        ...

    def decode(
        self, params: Params, cache: Cache, tokens: jax.Array, positions: jax.Array
    ) -> tuple[Cache, jax.Array]:
        """Advance every slot by one token: int32[slots] tokens at int32[slots] positions ->
        the cache with them written, and float32[slots, vocab], each slot's logits of the next
        token given the slot's positions 0..position."""
        ...


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

    vocab: int = attrs.field(default=260, validator=int_at_least(1))
    d_model: int = attrs.field(default=64, validator=int_at_least(1))
    heads: int = attrs.field(default=4, validator=int_at_least(1))
    layers: int = attrs.field(default=2, validator=int_at_least(1))
    d_ff: int = attrs.field(default=256, validator=int_at_least(1))
    max_len: int = attrs.field(default=512, validator=int_at_least(1))

    def __attrs_post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} must divide by heads {self.heads}")

    @property
    def head_dim(self) -> int:
        """Each attention head's width: d_model / heads."""
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


def _lead(array: jax.Array, ndim: int) -> jax.Array:
    """`array` with leading unit axes up to `ndim`: explicit broadcasting, clean under strict
    rank promotion."""
    return array.reshape((1,) * (ndim - array.ndim) + array.shape)


def layer_norm(params: dict, x: jax.Array) -> jax.Array:
    """x normalised over its last axis, then scaled and shifted by params' `scale` and `bias`."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    normed = (x - mean) * jax.lax.rsqrt(var + 1e-5)
    return normed * _lead(params["scale"], x.ndim) + _lead(params["bias"], x.ndim)


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
    qkv = project(layer_norm(block["ln1"], x), block["qkv"], jnp.matmul)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    shape = x.shape[:-1] + (config.heads, config.head_dim)
    return q.reshape(shape), k.reshape(shape), v.reshape(shape)


def block_finish(block: dict, x: jax.Array, attended: jax.Array) -> jax.Array:
    """Add the attention output and the MLP to the residual stream."""
    x = x + project(attended.reshape(x.shape), block["out"], jnp.matmul)
    up = jax.nn.gelu(project(layer_norm(block["ln2"], x), block["up"], jnp.matmul))
    return x + project(up, block["down"], jnp.matmul)


def embed(params: dict, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """float[..., d_model]: token embeddings plus learned position embeddings."""
    return params["embed"][tokens] + params["position"][positions]


def unembed(params: dict, x: jax.Array) -> jax.Array:
    """float[..., vocab]: next-token logits of the final hidden states."""
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
    return unembed(params, hidden_states(params, tokens, positions, segment_ids, config=config))


def hidden_states(
    params: dict,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    config: TransformerConfig,
    remat: bool = False,
) -> jax.Array:
    """The residual stream after the last block over packed rows, before `unembed`.

    `apply` is `unembed` of it. Kept apart so that the objective can turn it into log-probs a
    chunk of positions at a time, never holding the [rows, width, vocab] logits.

    Args:
        params, tokens, positions, segment_ids, config: as `apply` takes them.
        remat: recompute each block's activations in the backward pass instead of keeping them
            (see `through_layers`): a block's input is all a gradient keeps of it.

    Returns:
        float32[rows, width, d_model].
    """
    width = tokens.shape[-1]
    causal = jnp.tril(jnp.ones((width, width), bool))
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    allowed = _lead(causal, same.ndim) & same & (segment_ids[..., :, None] != 0)

    def step(block: dict, x: jax.Array) -> jax.Array:
        q, k, v = block_qkv(block, x, config)
        return block_finish(block, x, attend(q, k, v, allowed))

    return through_layers(step, params["blocks"], embed(params, tokens, positions), remat=remat)


def through_layers(step, layers: list, x: jax.Array, *, remat: bool) -> jax.Array:
    """x through `step(layer, x)` for each of `layers` in turn.

    With `remat`, the backward pass keeps only each layer's input and recomputes the rest
    (`_recomputed`).
    """
    if remat:
        step = _recomputed(step)
    for layer in layers:
        x = step(layer, x)
    return x


def _recomputed(step):
    """`step(layer, x)` whose gradient keeps only its inputs and runs `step` again to get it.

    Not `jax.checkpoint`: XLA's CPU compiler drops the optimisation barrier it sets, and its
    scheduler then runs each layer's recomputation as soon as the layer's input is there, in
    the forward pass, so every layer's activations are live at once (an 8-layer step compiled
    to the same scratch memory with and without it). Here the recomputation reads its input
    through a choice on the cotangent that the layer above hands back, so it cannot start
    before the backward pass reaches its layer. Before, the layers ran as a `lax.scan` (whose
    body XLA does keep apart) over their params stacked: a copy of every layer's params in the
    step (SmolLM2-135M: 0.40 GiB), and of their gradients.
    """

    @jax.custom_vjp
    def run(layer, x):
        return step(layer, x)

    def forward(layer, x):
        return step(layer, x), (layer, x)

    def backward(inputs, cotangent):
        layer, x = inputs
        # The same x, unless the cotangent is NaN, when the gradient is not finite anyway.
        x = jnp.where(jnp.isnan(cotangent.reshape(-1)[0]), jnp.zeros_like(x), x)
        return jax.vjp(step, layer, x)[1](cotangent)

    run.defvjp(forward, backward)
    return run


def model(config: TransformerConfig, *, remat: bool = False) -> Transformer:
    """The transformer of `config` as a `Model`: the `model(variables, tokens, positions,
    segment_ids)` the objective takes, and what the engine serves; `remat` as `Transformer`."""
    return Transformer(config, remat=remat)


_FIRST_BLOCK = 32


def cache_blocks(max_len: int) -> list[tuple[int, int]]:
    """The position ranges [start, stop) a cache of `max_len` positions is kept in: 0..32, then
    blocks that double (32..64, 64..128, ...), the last cut at max_len.

    A decode step reads only the blocks up to the one holding the longest live position, so
    short sequences do not pay to read the whole cache (a step is bound by that read: at 32
    slots of 256 positions the cache is 16 MiB a step).
    """
    blocks, start = [], 0
    while start < max_len:
        stop = min(max_len, max(_FIRST_BLOCK, 2 * start))
        blocks.append((start, stop))
        start = stop
    return blocks


def init_cache(config: TransformerConfig, *, slots: int, max_len: int) -> list[dict]:
    """An empty key/value cache for `slots` sequences of up to `max_len` tokens.

    Each layer's keys and values are kept in the blocks of positions `cache_blocks` gives, one
    array each, so that a decode step reads only the blocks in use without copying any. Heads
    lead positions, so a step's attention reads each slot's head as contiguous runs.

    Returns:
        One dict per layer with "k" and "v": per block, float32[slots, heads, block, head_dim].
    """
    return [
        {
            name: [
                jnp.zeros((slots, config.heads, stop - start, config.head_dim), jnp.float32)
                for start, stop in cache_blocks(max_len)
            ]
            for name in ("k", "v")
        }
        for _ in range(config.layers)
    ]


def prefill(
    params: dict,
    cache: list[dict],
    tokens: jax.Array,
    slot: jax.Array,
    *,
    config: TransformerConfig,
) -> tuple[list[dict], jax.Array]:
    """Run one prompt from position 0, writing its keys and values into one slot of the cache.

    The slot's cache holds the prompt afterwards, so `decode` can continue it. Padding after the
    prompt writes keys and values that later decode steps overwrite before they attend to them.

    Args:
        params: from `init`.
        cache: from `init_cache`, with max_len >= T.
        tokens: int32[T], the prompt (padded at its end to a length that compiles once).
        slot: int32 scalar, the cache slot to fill.
        config: the params' config.

    Returns:
        The cache with the slot's positions 0..T-1 written, and float32[T, vocab]: at each
        position, the logits of the next token (as `apply` gives them for one segment).
    """
    width = tokens.shape[0]
    positions = jnp.arange(width, dtype=jnp.int32)
    causal = jnp.tril(jnp.ones((width, width), bool))
    x = embed(params, tokens, positions)
    written = []
    for block, layer in zip(params["blocks"], cache, strict=True):
        q, k, v = block_qkv(block, x, config)
        written.append(
            {
                name: _write_prompt(layer[name], new.transpose(1, 0, 2)[None], slot)
                for name, new in (("k", k), ("v", v))
            }
        )
        x = block_finish(block, x, attend(q, k, v, causal))
    return written, unembed(params, x)


def _starts(blocks: list[jax.Array]) -> list[int]:
    """Each cache block's first position."""
    lengths = [block.shape[2] for block in blocks]
    return [sum(lengths[:i]) for i in range(len(lengths))]


def _write_prompt(blocks: list[jax.Array], new: jax.Array, slot: jax.Array) -> list[jax.Array]:
    """Write a prompt's keys or values (float32[1, heads, T, head_dim], positions 0..T-1) into
    one slot of a layer's blocks."""
    zero = jnp.int32(0)
    written = []
    for block, start in zip(blocks, _starts(blocks), strict=True):
        part = new[:, :, start : start + block.shape[2]]
        if part.shape[2]:
            block = jax.lax.dynamic_update_slice(block, part, (slot, zero, zero, zero))
        written.append(block)
    return written


def _write_step(blocks: list[jax.Array], new: jax.Array, positions: jax.Array) -> list[jax.Array]:
    """Write each slot's key or value (float32[slots, heads, head_dim]) at its position, into
    the block that holds the position: the other blocks get an index past their end, which the
    scatter drops."""
    rows = jnp.arange(new.shape[0], dtype=jnp.int32)
    written = []
    for block, start in zip(blocks, _starts(blocks), strict=True):
        size = block.shape[2]
        inside = (positions >= start) & (positions < start + size)
        at = jnp.where(inside, positions - start, jnp.int32(size))
        written.append(block.at[rows, :, at].set(new, mode="drop"))
    return written


def _attend_cache(
    q: jax.Array, keys: list[jax.Array], values: list[jax.Array], positions: jax.Array
) -> jax.Array:
    """Each slot's attention over its cached positions 0..position, reading only the blocks up
    to the one holding the longest position (a branch per block count, all in one compilation).

    Args:
        q: float32[slots, heads, head_dim].
        keys, values: per block, float32[slots, heads, block, head_dim].
        positions: int32[slots].

    Returns:
        float32[slots, heads, head_dim].
    """
    scale = jnp.sqrt(jnp.float32(q.shape[-1]))
    starts = _starts(keys)

    def over(count: int):
        """The attention over the first `count` blocks: scores block by block, one softmax
        over them all, then each block's share of the mixing."""

        def attend(q, keys, values):
            scores = jnp.concatenate(
                [jnp.einsum("shd,shld->shl", q, block) for block in keys[:count]], axis=-1
            )
            span = jnp.arange(scores.shape[-1], dtype=jnp.int32)
            allowed = span[None, None, :] <= positions[:, None, None]
            weights = jax.nn.softmax(jnp.where(allowed, scores / scale, -1e30), axis=-1)
            mixed = [
                jnp.einsum("shl,shld->shd", weights[:, :, start : start + block.shape[2]], block)
                for block, start in zip(values[:count], starts, strict=False)
            ]
            return functools.reduce(jnp.add, mixed)

        return attend

    stops = [start + block.shape[2] for block, start in zip(keys, starts, strict=True)]
    needed = jnp.searchsorted(jnp.asarray(stops, jnp.int32), jnp.max(positions), side="right")
    branches = [over(count) for count in range(1, len(keys) + 1)]
    return jax.lax.switch(needed, branches, q, keys, values)


def decode(
    params: dict,
    cache: list[dict],
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: TransformerConfig,
) -> tuple[list[dict], jax.Array]:
    """Advance every slot of the cache by one token.

    Each slot's token is written at its position and attends to the slot's cached positions up to
    and including it, so a slot's logits equal `apply`'s over the slot's whole sequence. Only the
    cache blocks up to the one holding the longest position are read.

    Args:
        params: from `init`.
        cache: from `init_cache`.
        tokens: int32[slots], each slot's next token.
        positions: int32[slots], its position, below max_len.
        config: the params' config.

    Returns:
        The cache with each slot's key and value written at its position, and
        float32[slots, vocab]: each slot's logits of the token after it.
    """
    x = embed(params, tokens, positions)
    written = []
    for block, layer in zip(params["blocks"], cache, strict=True):
        q, k, v = block_qkv(block, x, config)
        keys = _write_step(layer["k"], k, positions)
        values = _write_step(layer["v"], v, positions)
        written.append({"k": keys, "v": values})
        x = block_finish(block, x, _attend_cache(q, keys, values, positions))
    return written, unembed(params, x)


@attrs.frozen
class Transformer:
    """The transformer of a `TransformerConfig` as a `Model`: this module's functions bound to it.

    Args:
        config: the transformer's shape.
        remat: recompute each block's activations in the backward pass instead of keeping them
            (see `hidden_states`): a training step's memory for less than one more forward pass.
            The values are the same either way.
    """

    config: TransformerConfig = attrs.field(
        validator=attrs.validators.instance_of(TransformerConfig)
    )
    remat: bool = attrs.field(
        default=False, kw_only=True, validator=attrs.validators.instance_of(bool)
    )

    @property
    def vocab(self) -> int:
        """Token ids the model scores: every id is below this."""
        return self.config.vocab

    @property
    def max_len(self) -> int:
        """The longest sequence the model's positions cover."""
        return self.config.max_len

    def init(self, key: jax.Array) -> dict:
        """Random params (see `init`)."""
        return init(key, self.config)

    def __call__(self, params, tokens, positions, segment_ids) -> jax.Array:
        """Next-token logits over packed rows (see `apply`)."""
        return self.head(params, self.hidden_states(params, tokens, positions, segment_ids))

    def hidden_states(self, params, tokens, positions, segment_ids) -> jax.Array:
        """The final residual stream over packed rows (see `hidden_states`)."""
        return hidden_states(
            params, tokens, positions, segment_ids, config=self.config, remat=self.remat
        )

    def head(self, params, hidden: jax.Array) -> jax.Array:
        """float32[..., vocab]: the next-token logits of `hidden_states`' output (see `unembed`)."""
        return unembed(params, hidden)

    def init_cache(self, *, slots: int, max_len: int) -> list[dict]:
        """An empty key/value cache (see `init_cache`)."""
        return init_cache(self.config, slots=slots, max_len=max_len)

    def prefill(self, params, cache, tokens, slot) -> tuple[list[dict], jax.Array]:
        """Run a prompt into one slot of the cache (see `prefill`)."""
        return prefill(params, cache, tokens, slot, config=self.config)

    def decode(self, params, cache, tokens, positions) -> tuple[list[dict], jax.Array]:
        """Advance every slot by one token (see `decode`)."""
        return decode(params, cache, tokens, positions, config=self.config)
