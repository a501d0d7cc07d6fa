"""How an engine draws a token: temperature, then top-k, then top-p over the top-k renormalised
distribution, the drawn token's log-prob under that distribution, and the compiled prefill and
decode steps of `RolloutServer` that draw with it.

Apart from the server's call bookkeeping (`_engine.py`) because it is pure JAX: every function
here is traced, and `sample` is public as `dew.serve.sample` for engines of one's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,
    *,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row from temperature-scaled, top-k and top-p filtered logits.

    Tokens are ranked by scaled logit, ties broken by the lower token id. Top-k keeps the first
    `top_k` ranks; top-p then keeps each rank whose preceding ranks hold less than `top_p` of the
    top-k renormalised probability (so the most likely token is always kept). The token is drawn
    from the kept tokens' renormalised distribution, and its log-prob is taken under it.

    Args:
        logits: float32[rows, vocab].
        temperature: float32[rows]; 0 draws the most likely token.
        top_k: int32[rows]; vocab (or more) keeps every token.
        top_p: float32[rows]; inf keeps every token.
        keys: uint32[rows, 2], each row's PRNG key.

    Returns:
        int32[rows] the drawn tokens, float32[rows] their log-probs under the filtered
        distribution, bool[rows, vocab] the kept tokens.
    """
    return _draw(logits, temperature=temperature, top_k=top_k, top_p=top_p, keys=keys, top=0)[:3]


def _draw(logits, *, temperature, top_k, top_p, keys, top: int):
    """`sample`, and where `top` > 0 each row's `top` most likely token ids (int32[rows, top])
    and their log-probs (float32[rows, top]) under the same filtered distribution, most likely
    first; None and None for 0."""
    rows, vocab = logits.shape
    greedy = temperature == 0
    scaled = logits / jnp.where(greedy, jnp.float32(1), temperature)[:, None]
    k = jnp.where(greedy, jnp.int32(1), top_k)

    def rank_filter(scaled):
        order = jnp.argsort(-scaled, axis=-1, stable=True)
        ranked = jnp.take_along_axis(scaled, order, axis=-1)
        in_top_k = jnp.arange(vocab, dtype=jnp.int32)[None, :] < k[:, None]
        probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
        mass_before = jnp.concatenate(
            [jnp.zeros((rows, 1), jnp.float32), jnp.cumsum(probs, axis=-1)[:, :-1]], axis=-1
        )
        keep_ranked = in_top_k & (mass_before < top_p[:, None])
        row_ids = jnp.arange(rows, dtype=jnp.int32)[:, None]
        return jnp.zeros((rows, vocab), bool).at[row_ids, order].set(keep_ranked)

    # Sorting is most of a step's sampling cost on CPU: a step whose rows all keep every token
    # skips it.
    filtering = jnp.any((k < vocab) | (top_p < jnp.inf))
    kept = jax.lax.cond(
        filtering, rank_filter, lambda scaled: jnp.ones((rows, vocab), bool), scaled
    )
    filtered = jnp.where(kept, scaled, -jnp.inf)
    log_probs = jax.nn.log_softmax(filtered, axis=-1)
    tokens = _inverse_cdf(jnp.exp(log_probs), keys)
    chosen = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    if not top:
        return tokens, chosen, kept, None, None
    values, ids = jax.lax.top_k(log_probs, top)
    return tokens, chosen, kept, ids, values


def _inverse_cdf(probs: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row drawn from `probs` by inverting its cumulative distribution.

    One uniform number per row, where drawing Gumbel noise for every token (as
    `jax.random.categorical` does) costs a random number per vocabulary entry: most of a wide
    step's sampling time. A token of probability 0 is never drawn: its cumulative sum equals
    the one before it, so the count of sums at or below the uniform steps over it.

    Args:
        probs: float32[rows, vocab], each row summing to about 1.
        keys: uint32[rows, 2].

    Returns:
        int32[rows].
    """
    cumulative = jnp.cumsum(probs, axis=-1)
    uniform = jax.vmap(jax.random.uniform)(keys) * cumulative[:, -1]
    drawn = jnp.sum(cumulative <= uniform[:, None], axis=-1, dtype=jnp.int32)
    # Rounding can put the uniform at the total: then the last token of nonzero probability.
    last = probs.shape[-1] - 1 - jnp.argmax(probs[:, ::-1] > 0, axis=-1).astype(jnp.int32)
    return jnp.minimum(drawn, last)


@functools.partial(jax.jit, static_argnames=("model", "top"), donate_argnames=("cache",))
def _decode_step(
    params, cache, tokens, positions, temperature, top_k, top_p, keys, counters, *, model, top
):
    """One decode step over every slot: the new cache and each slot's drawn token, its log-prob,
    the kept tokens and (`top` > 0, a second compilation only a call asking for them brings
    about) the `top` most likely tokens and their log-probs.

    keys: uint32[slots, 2] each call's key; counters: int32[slots] the index of the token drawn,
    folded into the key so each token of a call has its own randomness.
    """
    cache, logits = model.decode(params, cache, tokens, positions)
    folded = jax.vmap(jax.random.fold_in)(keys, counters)
    drawn = _draw(logits, temperature=temperature, top_k=top_k, top_p=top_p, keys=folded, top=top)
    return (cache, *drawn)


@functools.partial(jax.jit, static_argnames=("model", "top"), donate_argnames=("cache",))
def _prefill_step(
    params, cache, tokens, length, slot, temperature, top_k, top_p, key, *, model, top
):
    """Prefill one prompt (int32[bucket], `length` real tokens) into `slot` and draw its first
    token: the new cache, the token, its log-prob, the kept tokens, and the top tokens and
    their log-probs as `_decode_step` gives them."""
    cache, logits = model.prefill(params, cache, tokens, slot)
    last = jax.lax.dynamic_slice_in_dim(logits, length - 1, 1, axis=0)
    drawn = _draw(
        last,
        temperature=temperature[None],
        top_k=top_k[None],
        top_p=top_p[None],
        keys=jax.random.fold_in(key, jnp.int32(0))[None],
        top=top,
    )
    return (cache, *(None if value is None else value[0] for value in drawn))
