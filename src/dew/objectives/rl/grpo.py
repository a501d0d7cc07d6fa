"""The GRPO objective over packed rows: per-token log-probs and the decoupled PPO loss.

Rollouts reach the trainer packed into fixed `[rows, width]` rows, several chains per row, each
chain a segment. `GRPOObjective` scores such rows with the model in one call, the way each chain
would score alone, and trains with decoupled PPO (AReaL, arXiv:2505.24298): the clipped surrogate
is taken against the *proximal* policy (the trainer's weights when the batch was packed, rescored
by `packed_log_probs`), and each token is weighted by the capped importance of proximal over
*behaviour* (what the engine sampled under, possibly several versions old). The two policies are
kept apart because the engine's log-probs are stale and computed by different kernels; clipping
against them would clip on noise.

The batch is a mapping of `[rows, width]` arrays: `tokens`, `positions`, `segment_ids` (0 =
padding), `loss_mask`, `advantages`, `behavior_logprobs`, `proximal_logprobs`, and optionally
`support_tokens` and `support_positions` (`[rows, S]`, position -1 = unused) where a filtered
(top-k/top-p) sampler drew tokens. The log-prob at `[r, p]` is that of `tokens[r, p]` given the
segment's tokens before `p`; it is 0 at a segment's first position and at padding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import optax

from dew._checks import at_least, in_range, is_callable, positive

Model = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]

SCORED = ("tokens", "positions", "segment_ids")
SUPPORT = ("support_tokens", "support_positions")
TRAINED = ("loss_mask", "advantages", "behavior_logprobs", "proximal_logprobs")


def _require(batch: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [key for key in keys if key not in batch]
    if missing:
        raise KeyError(f"batch lacks {', '.join(map(repr, missing))}; it has {sorted(batch)}")


def _support(batch: Mapping[str, Any]) -> bool:
    present = [key in batch for key in SUPPORT]
    if any(present) and not all(present):
        raise KeyError(f"batch must carry both or neither of {SUPPORT}, got {sorted(batch)}")
    return all(present)


@attrs.frozen(eq=False)
class GRPOObjective:
    """Decoupled PPO over packed rows of rollout chains.

    Args:
        model: `model(variables, tokens, positions, segment_ids) -> logits`, float[rows, width,
            vocab] the next-token logits at each position; attention must stay in its segment.
        clip: the surrogate clips the ratio to current / proximal to [1 - clip, 1 + clip].
        importance_cap: the behaviour importance weight proximal / behaviour is capped here, so
            one token the engine found unlikely cannot dominate the step.
        temperature: the engine's sampling temperature. Every log-prob here is of the logits
            divided by it, the distribution the engine drew from and reported its behaviour
            log-probs under; at another temperature, behaviour and proximal would differ by
            the temperature alone and the importance weights would correct for it, not for
            staleness.

    Raises:
        ValueError: naming the argument, for a model that is not callable, a clip outside (0, 1),
            an importance_cap below 1 (an on-policy token weighs 1) or a temperature that is
            not a finite number > 0 (greedy decoding has no log-probs to train on).
    """

    model: Model = attrs.field(validator=is_callable)
    clip: float = attrs.field(
        default=0.2, kw_only=True, validator=in_range(0, 1, low_open=True, high_open=True)
    )
    importance_cap: float = attrs.field(default=5.0, kw_only=True, validator=at_least(1))
    temperature: float = attrs.field(default=1.0, kw_only=True, validator=positive)
    # Built once per objective, so each batch shape compiles once for the objective's lifetime.
    _jitted_log_probs: Callable = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(lambda self: jax.jit(self._log_probs), takes_self=True),
    )

    def packed_log_probs(self, variables, batch: Mapping[str, Any]) -> jax.Array:
        """Score packed rows: each token's log-prob given its segment's earlier tokens.

        Jitted, once per `[rows, width]` (and support length) for this objective; the
        scheduler uses it to rescore the proximal policy.

        Args:
            variables: the model's variables.
            batch: `tokens`, `positions`, `segment_ids`, int32[rows, width]; optionally
                `support_tokens` and `support_positions`, int32[rows, S], where a token's
                log-prob is renormalised over the tokens kept at its position.

        Returns:
            float32[rows, width]: log-prob of `tokens[r, p]` from the logits at `p - 1` divided
            by `temperature`; 0 at a segment's first position and at padding.

        Raises:
            KeyError: naming a missing key, or a support key without its partner.
        """
        _require(batch, SCORED)
        keys = SCORED + (SUPPORT if _support(batch) else ())
        return self._jitted_log_probs(variables, {key: batch[key] for key in keys})

    def behavior_importance(self, batch: Mapping[str, Any]) -> jax.Array:
        """Per-token weight proximal / behaviour, capped at `importance_cap`.

        Decoupled PPO's correction for sampling under a stale or differently computed policy:
        the surrogate is taken against the proximal policy, and this reweights each token
        towards it from the behaviour policy the engine really sampled.

        Args:
            batch: `loss_mask`, `behavior_logprobs`, `proximal_logprobs`, float32[rows, width].

        Returns:
            float32[rows, width]: min(exp(proximal - behaviour), importance_cap) at trained
            tokens, 0 where `loss_mask` is 0.

        Raises:
            KeyError: naming a missing key.
        """
        _require(batch, ("loss_mask", "behavior_logprobs", "proximal_logprobs"))
        return self._importance(batch)[2]

    def loss(self, variables, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The importance-weighted clipped surrogate, to minimise, and what the step looked like.

        Pure: jit it and differentiate it with respect to `variables`.

        Args:
            variables: the model's variables being trained.
            batch: the packed keys `packed_log_probs` reads, plus `loss_mask`, `advantages`,
                `behavior_logprobs` and `proximal_logprobs`, float32[rows, width].

        Returns:
            The loss, minus the mean over loss-mask weight of importance x min(ratio x A,
            clip(ratio) x A) with ratio = exp(current - proximal); and float32 metrics over
            trained tokens (each 0 when there are none):
            `loss`; `kl/behavior_proximal`, the k3 estimate of KL(behaviour || proximal), the
            trainer-engine mismatch; `clip_fraction`, the share of tokens whose gradient the
            clip removes; `importance/mean`, `importance/max`; `ratio/mean`; `tokens`, the
            loss mask's total weight.

        Raises:
            KeyError: naming a missing key.
        """
        _require(batch, SCORED + TRAINED)
        keys = SCORED + (SUPPORT if _support(batch) else ())
        current = self._log_probs(variables, {key: batch[key] for key in keys})
        mask = jnp.asarray(batch["loss_mask"], jnp.float32)
        advantages = jnp.asarray(batch["advantages"], jnp.float32)
        proximal = jnp.asarray(batch["proximal_logprobs"], jnp.float32)
        trained, log_importance, importance = self._importance(batch)

        # Masked before exp, so an untrained token's ratio can't overflow into a NaN gradient.
        log_ratio = jnp.where(trained, current - proximal, jnp.float32(0))
        ratio = jnp.exp(log_ratio)
        low, high = jnp.float32(1.0 - self.clip), jnp.float32(1.0 + self.clip)
        unclipped = ratio * advantages
        clipped = jnp.clip(ratio, low, high) * advantages
        surrogate = jnp.minimum(unclipped, clipped)

        tokens = mask.sum()
        count = jnp.maximum(trained.sum().astype(jnp.float32), jnp.float32(1))

        def mean(values: jax.Array) -> jax.Array:
            return jnp.where(trained, values, jnp.float32(0)).sum() / count

        loss = -(mask * importance * surrogate).sum() / jnp.maximum(tokens, jnp.float32(1))
        clipped_out = ((advantages > 0) & (ratio > high)) | ((advantages < 0) & (ratio < low))
        # k3 = (r - 1) - log r with r = proximal / behaviour over behaviour's samples: unbiased
        # for KL(behaviour || proximal) and never negative, unlike the plain -log r.
        k3 = jnp.expm1(log_importance) - log_importance
        metrics = {
            "loss": loss,
            "kl/behavior_proximal": mean(k3),
            "clip_fraction": mean(clipped_out.astype(jnp.float32)),
            "importance/mean": mean(importance),
            "importance/max": jnp.max(importance),
            "ratio/mean": mean(ratio),
            "tokens": tokens,
        }
        return loss, metrics

    def update_fn(self, optimizer: optax.GradientTransformation) -> Callable:
        """A jitted training step on this loss with `optimizer`.

        Args:
            optimizer: an optax transformation; its state comes from `optimizer.init(variables)`.

        Returns:
            `update(variables, opt_state, batch) -> (variables, opt_state, metrics)`: one
            optimizer update; metrics are `loss`'s plus `grad_norm`, the gradient's global norm.
        """
        value_and_grad = jax.value_and_grad(self.loss, has_aux=True)

        @jax.jit
        def update(variables, opt_state, batch):
            (_, metrics), grads = value_and_grad(variables, batch)
            updates, opt_state = optimizer.update(grads, opt_state, variables)
            metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
            return optax.apply_updates(variables, updates), opt_state, metrics

        return update

    def _importance(self, batch: Mapping[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Trained tokens, bool[rows, width]; log(proximal / behaviour) there, 0 elsewhere so
        nothing downstream overflows on untrained tokens; and `behavior_importance`."""
        trained = jnp.asarray(batch["loss_mask"], jnp.float32) > 0
        behavior = jnp.asarray(batch["behavior_logprobs"], jnp.float32)
        proximal = jnp.asarray(batch["proximal_logprobs"], jnp.float32)
        log_importance = jnp.where(trained, proximal - behavior, jnp.float32(0))
        capped = jnp.minimum(jnp.exp(log_importance), jnp.float32(self.importance_cap))
        return trained, log_importance, jnp.where(trained, capped, jnp.float32(0))

    def _log_probs(self, variables, batch: Mapping[str, Any]) -> jax.Array:
        """`packed_log_probs` before jit: traced by it and by `loss`."""
        tokens = jnp.asarray(batch["tokens"], jnp.int32)
        segment_ids = jnp.asarray(batch["segment_ids"], jnp.int32)
        positions = jnp.asarray(batch["positions"], jnp.int32)
        rows, width = tokens.shape
        logits = self.model(variables, tokens, positions, segment_ids).astype(jnp.float32)
        logits = logits / jnp.float32(self.temperature)
        # Position p is predicted by the logits at p - 1: drop the last logits and first token.
        logits = logits[:, :-1]
        targets = tokens[:, 1:]
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        normaliser = jax.nn.logsumexp(logits, axis=-1)
        if SUPPORT[0] in batch:
            normaliser = self._support_normaliser(logits, normaliser, batch)
        follows = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
        scored = jnp.where(follows, picked - normaliser, jnp.float32(0))
        return jnp.concatenate([jnp.zeros((rows, 1), jnp.float32), scored], axis=1)

    @staticmethod
    def _support_normaliser(
        logits: jax.Array, normaliser: jax.Array, batch: Mapping[str, Any]
    ) -> jax.Array:
        """`normaliser` with the log-sum-exp over the kept tokens wherever support covers a
        position: a filtered sampler drew from the distribution renormalised over them.

        logits: float32[rows, width - 1, vocab] predicting positions 1..width-1; normaliser:
        float32[rows, width - 1]. Returns the same shape as normaliser.
        """
        kept = jnp.asarray(batch["support_tokens"], jnp.int32)
        where = jnp.asarray(batch["support_positions"], jnp.int32)
        rows, predicted = normaliser.shape
        # Index into the shifted logits; unused entries go one past the end, where scatters drop
        # them (a -1 would wrap round to the last position).
        used = (where >= 1) & (where <= predicted)
        slot = jnp.where(used, where - 1, predicted)
        row = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], slot.shape)
        kept_logits = logits[row, jnp.minimum(slot, predicted - 1), kept]
        empty = jnp.full((rows, predicted), -jnp.inf, jnp.float32)
        # The shift only steadies the sum; the log-sum-exp's gradient does not depend on it.
        peak = jax.lax.stop_gradient(empty.at[row, slot].max(kept_logits, mode="drop"))
        covered = jnp.isfinite(peak)
        shift = jnp.where(covered, peak, jnp.float32(0))
        # Unused entries are dropped by the scatter; zeroing their gap keeps their exp (and so
        # its gradient) finite.
        gap = jnp.where(used, kept_logits - shift[row, jnp.minimum(slot, predicted - 1)], 0.0)
        mass = (
            jnp.zeros((rows, predicted), jnp.float32).at[row, slot].add(jnp.exp(gap), mode="drop")
        )
        kept_normaliser = shift + jnp.log(jnp.where(covered, mass, jnp.float32(1)))
        return jnp.where(covered, kept_normaliser, normaliser)
