"""The log-prob pass of `GRPOObjective`: each target token's log-prob under the model's head,
a chunk of positions at a time, and the entropy of the distribution it is taken under.

Kept apart from the objective because it is the part that meets memory: a vocabulary of 151,936
tokens over a batch's positions is gigabytes of logits, so no pass here ever holds more than a
chunk's; and a filtered (top-k/top-p) sampler's support renormalises the softmax over the tokens
it kept. `GRPOObjective` runs the model over the rows and hands the hidden states here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def target_log_probs(
    head: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    targets: jax.Array,
    *,
    temperature: float,
    chunk: int,
    support: tuple[jax.Array, jax.Array] | None,
    entropy: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Each target's log-prob under the softmax of `head(hidden) / temperature`, `chunk`
    positions at a time, and (asked) the entropy of that softmax at each position.

    Each chunk's logits live only inside a `jax.checkpoint`ed step of a `lax.map`: the forward
    pass keeps each chunk's log-probs (and entropies), the backward pass recomputes the chunk's
    logits from its hidden states, so neither holds more than [chunk, vocab] logits. A chunk of
    every position is the plain computation. The entropy rides on the same logits, so it costs
    no second pass and no [positions, vocab] array.

    Args:
        head: hidden [n, hidden] -> logits float[n, vocab].
        hidden: [rows, predicted, hidden], the states predicting `targets`.
        targets: int32[rows, predicted].
        temperature: the logits are divided by it.
        chunk: positions (of rows x predicted, row-major) per step at most: the positions
            are split into as few steps as that allows, evened out between them.
        support: `support_tokens` and `support_positions`, int32[rows, S], positions in the
            batch's coordinates (1 .. predicted; others unused): where they cover a position,
            the softmax is over the tokens kept there (see `_support_normaliser`).
        entropy: None for none; `metric` for the entropy with no gradient (a figure of the
            record: its backward pass costs nothing); `trained` for the entropy with its
            gradient (an entropy bonus trains on it).

    Returns:
        float32[rows, predicted] log-probs, and float32[rows, predicted] entropies (nats) of
        the distribution each log-prob is taken under (renormalised over the support where
        one covers the position), or None.
    """
    rows, predicted = targets.shape
    cells = rows * predicted
    # A chunk past the positions there are would only pad them.
    chunk = max(1, min(chunk, cells))
    count = -(-cells // chunk)
    # As many chunks, each as even as they go: no larger than asked, and padded by fewer than
    # `count` positions in all, where `chunk`-sized ones would pad the last by up to a chunk
    # (510 positions at 220 a chunk: 150 padded positions' logits and gradients, at 170 none).
    chunk = -(-cells // count)
    padded = count * chunk
    flat = hidden.reshape(cells, hidden.shape[-1])
    flat = jnp.pad(flat, ((0, padded - cells), (0, 0))).reshape(count, chunk, hidden.shape[-1])
    goals = jnp.pad(targets.reshape(cells), (0, padded - cells)).reshape(count, chunk)
    starts = jnp.arange(count, dtype=jnp.int32) * jnp.int32(chunk)
    if support is not None:
        kept, where = support
        # Each support entry's cell in the flat order; an unused one goes past every chunk.
        used = (where >= 1) & (where <= predicted)
        row = jnp.arange(rows, dtype=jnp.int32)[:, None] * jnp.int32(predicted)
        cell = jnp.where(used, row + where - 1, jnp.int32(padded)).reshape(-1)
        kept = kept.reshape(-1)

    @jax.checkpoint
    def score(part: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        states, goal, start = part
        logits = head(states).astype(jnp.float32) / jnp.float32(temperature)
        picked = jnp.take_along_axis(logits, goal[:, None], axis=-1)[:, 0]
        whole = jax.nn.logsumexp(logits, axis=-1)
        normaliser, local = whole, None
        if support is not None:
            local = cell - start
            local = jnp.where((local >= 0) & (local < chunk), local, jnp.int32(chunk))
            normaliser = _support_normaliser(logits, whole, local, kept)
        if entropy is None:
            return picked - normaliser, jnp.zeros_like(normaliser)
        spread = _entropy(logits, whole, normaliser, local, kept if support is not None else None)
        if entropy == "metric":
            spread = jax.lax.stop_gradient(spread)
        return picked - normaliser, spread

    scored, spread = jax.lax.map(score, (flat, goals, starts))

    def unpadded(values: jax.Array) -> jax.Array:
        return values.reshape(padded)[:cells].reshape(rows, predicted)

    return unpadded(scored), None if entropy is None else unpadded(spread)


def _entropy(
    logits: jax.Array,
    whole: jax.Array,
    normaliser: jax.Array,
    cell: jax.Array | None,
    kept: jax.Array | None,
) -> jax.Array:
    """The entropy -sum_v p_v log p_v of the distribution each of n positions' log-probs are
    taken under: the softmax over the whole vocabulary, or over the kept tokens where a
    support covers the position.

    logits: float32[n, vocab]; whole: float32[n], their log-sum-exp; normaliser: float32[n],
    `_support_normaliser`'s (the kept tokens' log-sum-exp where covered); cell, kept: as
    `_support_normaliser` takes them, or None for no support. Returns float32[n].
    """
    # H = N - sum_v p_v z_v, since log p_v = z_v - N and p sums to 1; the whole vocabulary's
    # N, so no exp overflows where a support's smaller one stands.
    everywhere = whole - (jnp.exp(logits - whole[:, None]) * logits).sum(-1)
    if kept is None:
        return everywhere
    size = normaliser.shape[0]
    at = jnp.minimum(cell, size - 1)
    kept_logits = logits[at, kept]
    # An unused entry (cell = size) is dropped by the scatters; zeroing it keeps exp finite.
    used = cell < size
    gap = jnp.where(used, kept_logits - normaliser[at], jnp.float32(0))
    expected = jnp.zeros((size,), jnp.float32).at[cell].add(jnp.exp(gap) * kept_logits, mode="drop")
    covered = jnp.zeros((size,), jnp.bool_).at[cell].set(True, mode="drop")
    return jnp.where(covered, normaliser - expected, everywhere)


def _support_normaliser(
    logits: jax.Array, normaliser: jax.Array, cell: jax.Array, kept: jax.Array
) -> jax.Array:
    """`normaliser` with the log-sum-exp over the kept tokens wherever support covers a
    position: a filtered sampler drew from the distribution renormalised over them.

    logits: float32[n, vocab]; normaliser: float32[n]; cell: int32[S], each support entry's
    position among the n (n or more: unused, which scatters drop); kept: int32[S], its token.
    Returns float32[n].
    """
    size = normaliser.shape[0]
    used = cell < size
    at = jnp.minimum(cell, size - 1)
    kept_logits = logits[at, kept]
    empty = jnp.full((size,), -jnp.inf, jnp.float32)
    # The shift only steadies the sum; the log-sum-exp's gradient does not depend on it.
    peak = jax.lax.stop_gradient(empty.at[cell].max(kept_logits, mode="drop"))
    covered = jnp.isfinite(peak)
    shift = jnp.where(covered, peak, jnp.float32(0))
    # Unused entries are dropped by the scatter; zeroing their gap keeps their exp (and so its
    # gradient) finite.
    gap = jnp.where(used, kept_logits - shift[at], jnp.float32(0))
    mass = jnp.zeros((size,), jnp.float32).at[cell].add(jnp.exp(gap), mode="drop")
    kept_normaliser = shift + jnp.log(jnp.where(covered, mass, jnp.float32(1)))
    return jnp.where(covered, kept_normaliser, normaliser)
