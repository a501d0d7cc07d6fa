"""The log-prob pass of `GRPOObjective`: each target token's log-prob under the model's head,
a chunk of positions at a time, and the entropy of the distribution it is taken under.

Kept apart from the objective because it is the part that meets memory: a vocabulary of 151,936
tokens over a batch's positions is gigabytes of logits, so no pass here ever holds more than a
chunk's; and a filtered (top-k/top-p) sampler's support renormalises the softmax over the tokens
it kept. `GRPOObjective` runs the model over the rows and hands the hidden states here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def summed_in_float32(
    head: Callable[[Any, jax.Array], jax.Array], params: Any, states: jax.ShapeDtypeStruct
) -> Callable[[jax.Array], jax.Array]:
    """`head(params, ·)` for `target_log_probs`, whose backward pass differentiates the head in
    float32 where the params it reads are narrower (bfloat16): the same logits, and a gradient
    that differs by rounding only.

    The log-prob pass runs the head once a chunk, and each chunk's backward pass adds the head
    weights' gradient into a running sum held in the weights' dtype. For a bfloat16 head (the
    tied embedding, [vocab, hidden]), every chunk then converted the whole weight to float32
    for the hidden states' gradient (113 MB for SmolLM2-135M, 544 MB for Qwen2.5-0.5B) and
    rounded the running sum to bfloat16 after adding its own. Here the weights the head reads
    are converted to float32 once, before the chunks, and each chunk's backward pass runs the
    head in float32 from that copy: the gradients add up in float32 and are rounded to the
    weights' dtype once, after the last chunk. The forward pass (and its recomputation for the
    softmax's gradient) still runs the head on the params as they are. The price is the float32
    copy and the float32 sum, each the size of those weights, while the pass runs.

    Args:
        head: `head(params, states) -> logits` float32[n, vocab], as `dew.models.Model`'s.
        params: the params `head` is given.
        states: the shape and dtype of the hidden states a chunk hands the head, [n, hidden].

    Returns:
        `states -> logits`: `functools.partial(head, params)` itself where every param the
        head reads is float32 already (nothing changes, bit for bit), else the head above.
    """
    leaves, tree = jax.tree.flatten(params)
    read = _read_leaves(head, tree, leaves, states)
    narrow = [i for i in read if jnp.dtype(leaves[i].dtype) != jnp.float32]
    if not narrow:
        return functools.partial(head, params)
    wide = [leaves[i].astype(jnp.float32) for i in read]

    def with_read(values: list[jax.Array]) -> Any:
        # The leaves the head does not read stay as they are: it traces nothing of them.
        held = list(leaves)
        for i, value in zip(read, values, strict=True):
            held[i] = value
        return jax.tree.unflatten(tree, held)

    @jax.custom_vjp
    def logits(own: list[jax.Array], wide: list[jax.Array], hidden: jax.Array) -> jax.Array:
        return head(with_read(own), hidden)

    def forward(own, wide, hidden):
        return logits(own, wide, hidden), (wide, hidden)

    def backward(residuals, cotangent):
        wide, hidden = residuals
        _, pull = jax.vjp(
            lambda values, states: head(with_read(values), states),
            wide,
            hidden.astype(jnp.float32),
        )
        wide_grads, hidden_grad = pull(cotangent)
        # The params' own leaves get none: their gradient reaches them through `wide`, once.
        return None, wide_grads, hidden_grad.astype(hidden.dtype)

    logits.defvjp(forward, backward)
    own = [leaves[i] for i in read]
    return lambda hidden: logits(own, wide, hidden)


def _read_leaves(
    head: Callable[[Any, jax.Array], jax.Array],
    tree: Any,
    leaves: list[Any],
    states: jax.ShapeDtypeStruct,
) -> list[int]:
    """The indices of the `leaves` of params (laid out as `tree`) that `head` reads, found by
    tracing it (nothing is computed): a model's head reads its norm and output projection, not
    the layers."""
    structs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    traced = jax.make_jaxpr(lambda values, hidden: head(jax.tree.unflatten(tree, values), hidden))(
        structs, states
    ).jaxpr
    used = {id(var) for eqn in traced.eqns for var in eqn.invars}
    used |= {id(var) for var in traced.outvars}
    return [i for i, var in enumerate(traced.invars[: len(leaves)]) if id(var) in used]


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
