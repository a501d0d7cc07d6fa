"""Decoupled PPO's behaviour importance over a packed batch, and the loss's aggregation.

Where each packed sequence lies, the behaviour importance weight proximal / behaviour at each
level (token, sequence, geometric) as each correction applies it (truncated, masked), the
behaviour-proximal mismatch split by where it comes from, and the per-token losses averaged as
`GRPOObjective`'s `aggregation` says. Pure functions of `[rows, width]` arrays, kept apart from
the objective, which picks among them by its settings: each a formula a reader can take alone
(docs/concepts.md derives them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.rl._surrogate import sequence_mean


def require(batch: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """Raises: KeyError naming each of `keys` the batch lacks, and the keys it has."""
    missing = [key for key in keys if key not in batch]
    if missing:
        raise KeyError(f"batch lacks {', '.join(map(repr, missing))}; it has {sorted(batch)}")


def sequence_index(batch: Mapping[str, Any]) -> tuple[jax.Array, int]:
    """Each cell's sequence, int32[rows * width], and how many indices there can be: a
    sequence is one segment of one row (segment ids restart in each row and are at most the
    width), and padding, segment 0, is a sequence of its own that no trained token is in."""
    segment_ids = jnp.asarray(batch["segment_ids"], jnp.int32)
    rows, width = segment_ids.shape
    row = jnp.arange(rows, dtype=jnp.int32)[:, None] * jnp.int32(width + 1)
    return (row + segment_ids).reshape(-1), rows * (width + 1)


def mismatch_metrics(batch: Mapping[str, Any], *, version: int) -> dict[str, float]:
    """The behaviour–proximal mismatch of a packed batch, split by where it comes from.

    Both are the k3 estimate of KL(behaviour || proximal), the mean over trained tokens of
    (rho - 1) - log rho with rho = proximal / behaviour:

    - `mismatch/engine`: over the tokens sampled at `version`, the proximal policy's own
      version. Behaviour and proximal are then the same weights computed twice (by the engine
      and by the trainer), so this is the engine–trainer difference alone: float noise for an
      engine that computes as the trainer does, more for another kernel, dtype or quantisation.
    - `staleness/kl`: over the tokens sampled at older versions: how far the policy moved since
      they were sampled (plus the engine's own share, which `mismatch/engine` shows).

    A figure over no tokens is left out (a synchronous run has no stale tokens).

    Args:
        batch: `loss_mask`, `behavior_logprobs`, `proximal_logprobs` float32[rows, width] and
            `versions` int32[rows, width] (each completion token's call version), as
            `RolloutScheduler` returns them.
        version: the version the proximal log-probs were rescored under (the trainer's updates).

    Returns:
        The figures that are defined, as floats.

    Raises:
        KeyError: naming a missing key.
    """
    require(batch, ("loss_mask", "behavior_logprobs", "proximal_logprobs", "versions"))
    trained = np.asarray(batch["loss_mask"]) > 0
    log_rho = (
        np.asarray(batch["proximal_logprobs"], np.float64)[trained]
        - np.asarray(batch["behavior_logprobs"], np.float64)[trained]
    )
    k3 = np.expm1(log_rho) - log_rho
    current = np.asarray(batch["versions"])[trained] == version
    metrics = {}
    for name, where in (("mismatch/engine", current), ("staleness/kl", ~current)):
        if where.any():
            metrics[name] = float(k3[where].mean())
    return metrics


def importance_weights(
    batch: Mapping[str, Any],
    proximal: jax.Array | None,
    *,
    level: str,
    correction: str,
    cap: float,
    floor: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The behaviour importance over a batch, each bool or float32[rows, width]: trained
    tokens; the log of the level's weight there (0 elsewhere, so nothing downstream
    overflows on untrained tokens); the weight as the correction applies it; and the tokens
    the correction keeps (the trained ones, less those masking leaves out).

    Args:
        batch: `loss_mask`, `behavior_logprobs`, `proximal_logprobs`; `segment_ids` at the
            sequence and geometric levels.
        proximal: the proximal log-probs, or None for the batch's `proximal_logprobs`.
        level, correction, cap, floor: `GRPOObjective`'s `importance_level`, `correction`,
            `importance_cap` and `importance_floor`.
    """
    trained = jnp.asarray(batch["loss_mask"], jnp.float32) > 0
    behavior = jnp.asarray(batch["behavior_logprobs"], jnp.float32)
    if proximal is None:
        proximal = jnp.asarray(batch["proximal_logprobs"], jnp.float32)
    log_weight = jnp.where(trained, proximal - behavior, jnp.float32(0))
    if level == "geometric":
        log_weight = sequence_mean(log_weight, trained, *sequence_index(batch))
    elif level == "sequence":
        index, segments = sequence_index(batch)
        sums = jax.ops.segment_sum(log_weight.reshape(-1), index, num_segments=segments)
        log_weight = jnp.where(trained, sums[index].reshape(trained.shape), jnp.float32(0))
    cap = jnp.float32(cap)
    if correction == "truncate":
        # min after exp, so a token at the cap weighs the cap exactly; an overflow to inf
        # is capped all the same, and the weight carries no gradient.
        weight = jnp.where(trained, jnp.minimum(jnp.exp(log_weight), cap), jnp.float32(0))
        return trained, log_weight, weight, trained
    kept = trained & (log_weight <= jnp.log(cap))
    if floor > 0:
        kept = kept & (log_weight >= jnp.log(jnp.float32(floor)))
    # Masked before exp: a kept weight is at most the cap, so it cannot overflow.
    weight = jnp.exp(jnp.where(kept, log_weight, jnp.float32(0)))
    return trained, log_weight, jnp.where(kept, weight, jnp.float32(0)), kept


def aggregate(
    weight: jax.Array, per_token: jax.Array, batch: Mapping[str, Any], aggregation: str
) -> jax.Array:
    """The loss from per-token losses, float32[rows, width], each weighted by `weight` (the
    loss mask at kept tokens, 0 elsewhere), as `aggregation` says (`GRPOObjective`'s)."""
    total = jnp.where(weight > 0, weight * per_token, jnp.float32(0))
    if aggregation == "token_mean":
        return total.sum() / jnp.maximum(weight.sum(), jnp.float32(1))
    if aggregation == "constant":
        return total.sum() / jnp.float32(weight.size)
    index, segments = sequence_index(batch)
    sums = jax.ops.segment_sum(total.reshape(-1), index, num_segments=segments)
    weights = jax.ops.segment_sum(weight.reshape(-1), index, num_segments=segments)
    present = weights > 0
    means = jnp.where(present, sums / jnp.where(present, weights, jnp.float32(1)), 0.0)
    return means.sum() / jnp.maximum(present.sum().astype(jnp.float32), jnp.float32(1))
