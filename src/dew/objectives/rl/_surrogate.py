"""The PPO surrogate of `GRPOObjective`: the ratio's level and the clip's variants; and the
estimators of its reference KL term.

Kept apart from the objective's scoring and weighting, since these are the levers a practitioner
turns first and each is a formula of its own (docs/concepts.md states them):

- the ratio current / proximal per token (PPO) or per sequence, the geometric mean of its
  tokens' ratios (GSPO, arXiv:2507.18071): a sequence's tokens then clip together;
- the clip's bounds apart, [1 - clip, 1 + clip_high] (clip-higher, DAPO arXiv:2503.14476), so a
  token the policy finds unlikely can rise further than a likely one can fall;
- a dual clip (arXiv:1912.09729): with a negative advantage, min(r A, clip(r) A) alone falls
  without bound as the ratio grows (a token at current - proximal = 50 would weigh e^50), so it
  is held at clip_dual x A;
- the per-token estimate of KL(current || reference) the reference penalty adds: k1, k2, k3
  (Schulman's "Approximating KL divergence") or abs.

Every function is pure, from arrays to arrays, on `[rows, width]` cells.
"""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k3", "k1", "k2", "abs")
"""The per-token estimates of KL(current || reference) over the current policy's samples, with
d = log reference - log current: k1 = -d (unbiased, negative at some tokens), k2 = d^2 / 2
(biased, low variance), k3 = e^d - d - 1 (unbiased, never negative: the default), abs = |d|."""
RATIO_LEVELS = ("token", "sequence")
"""Where the PPO ratio current / proximal is taken: each token's own, or its sequence's
geometric mean over trained tokens (GSPO), the same for each of the sequence's tokens."""
# The reference KL's log-ratio is clamped here: beyond it exp overflows float32's gradient,
# and a token the reference finds e^20 times likelier is held back hard enough.
_KL_LOG_RATIO = 20.0


def upper_clip(clip: float, clip_high: float | None) -> float:
    """The clip's upper epsilon: `clip_high`, or the symmetric `clip` where it is None."""
    return clip if clip_high is None else clip_high


def check_clip_dual(clip: float, clip_high: float | None, clip_dual: float | None) -> None:
    """Raises: ValueError naming clip_dual, its bound and its value, where it is not above the
    clip's upper bound 1 + upper_clip: lower, it would hold tokens the clip leaves be."""
    bound = 1 + upper_clip(clip, clip_high)
    if clip_dual is not None and clip_dual <= bound:
        raise ValueError(
            f"clip_dual must be above 1 + the upper clip ({bound:g}): lower, it would hold "
            f"tokens the clip leaves be, got {clip_dual}"
        )


def sequence_mean(
    values: jax.Array, trained: jax.Array, index: jax.Array, segments: int
) -> jax.Array:
    """Each trained cell's sequence mean of `values` over the sequence's trained cells.

    Args:
        values: float32[rows, width]; only trained cells count.
        trained: bool[rows, width].
        index, segments: each cell's sequence, int32[rows * width], and how many there can be
            (`_importance.sequence_index`).

    Returns:
        float32[rows, width]: the mean at trained cells, 0 elsewhere (so nothing downstream
        overflows on an untrained cell).
    """
    kept = jnp.where(trained, values, jnp.float32(0)).reshape(-1)
    sums = jax.ops.segment_sum(kept, index, num_segments=segments)
    counts = jax.ops.segment_sum(
        trained.reshape(-1).astype(jnp.float32), index, num_segments=segments
    )
    means = sums / jnp.maximum(counts, jnp.float32(1))
    return jnp.where(trained, means[index].reshape(trained.shape), jnp.float32(0))


@attrs.frozen
class Surrogate:
    """The clipped surrogate per token and where each clip acted, float32 and bool[rows, width].

    Attributes:
        value: the surrogate min(r A, clip(r) A), raised to clip_dual x A where A < 0 and the
            dual clip binds; the loss is its negative (times the behaviour weight).
        low: cells whose gradient the lower bound removes (A < 0, r < 1 - clip).
        high: cells whose gradient the upper bound removes (A > 0, r > 1 + clip_high).
        dual: cells the dual clip holds (A < 0, r > clip_dual); none without one.
    """

    value: jax.Array
    low: jax.Array
    high: jax.Array
    dual: jax.Array


def clipped_surrogate(
    ratio: jax.Array,
    advantages: jax.Array,
    *,
    clip_low: float,
    clip_high: float,
    clip_dual: float | None,
) -> Surrogate:
    """PPO's clipped surrogate with separate bounds and an optional dual clip.

    Args:
        ratio: current / proximal, float32[rows, width] (per token or per sequence).
        advantages: float32[rows, width].
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        clip_dual: with a negative advantage, the surrogate is at least clip_dual x A (so the
            loss of a token is at most clip_dual x |A|); None for no bound.

    Returns:
        The `Surrogate`.
    """
    low, high = jnp.float32(1.0 - clip_low), jnp.float32(1.0 + clip_high)
    value = jnp.minimum(ratio * advantages, jnp.clip(ratio, low, high) * advantages)
    negative = advantages < 0
    dual = jnp.zeros(ratio.shape, bool)
    if clip_dual is not None:
        bound = jnp.float32(clip_dual) * advantages
        dual = negative & (value < bound)
        value = jnp.where(negative, jnp.maximum(value, bound), value)
    return Surrogate(
        value=value,
        low=negative & (ratio < low),
        high=(advantages > 0) & (ratio > high),
        dual=dual,
    )


def reference_kl(
    reference: jax.Array, current: jax.Array, kept: jax.Array, estimator: str
) -> jax.Array:
    """Each kept token's `estimator` of KL(current || reference), float32[rows, width]; 0
    where not kept.

    Args:
        reference, current: the reference and current log-probs, float32[rows, width].
        kept: bool[rows, width], the tokens the loss keeps.
        estimator: one of `KL_ESTIMATORS`.
    """
    # d = reference - current, over the behaviour's samples; clamped and masked first,
    # so neither an untrained token nor a wild one overflows k3's e^d.
    gap = jnp.clip(
        jnp.where(kept, reference - current, jnp.float32(0)), -_KL_LOG_RATIO, _KL_LOG_RATIO
    )
    if estimator == "k1":
        return -gap
    if estimator == "k2":
        return jnp.float32(0.5) * gap * gap
    if estimator == "abs":
        return jnp.abs(gap)
    return jnp.expm1(gap) - gap
