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
segment's tokens before `p`; it is 0 at a segment's first position and at padding. With a
`kl_coef`, the batch also carries `reference_logprobs`, the frozen reference policy's log-probs
rescored over the same rows (`RolloutScheduler(reference=...)`).

Where each packed batch is trained by one update at the weights it was rescored under (as
`Trainer` does by default), the proximal log-probs are the update's own current log-probs, held
constant: `proximal="current"` takes them from the loss's forward pass instead of a rescoring
pass, the same values for one forward pass less per step. A batch trained by several updates
(`Trainer`'s `ppo_epochs` and `minibatches`) keeps the rescored ones, and the clip acts.

The levers a practitioner tunes, each documented with its formula in docs/concepts.md: the
behaviour importance weight's level (`importance_level`: per token, per sequence, or the
sequence's geometric mean) and how it is applied (`correction`: truncated at the cap, or tokens
outside `[importance_floor, importance_cap]` masked out of the loss); how the loss is averaged
(`aggregation`); a KL penalty to a reference policy (`kl_coef`); and an entropy bonus
(`entropy_coef`). The defaults are
decoupled PPO as AReaL trains it: token-level weights truncated at 5, the token mean.

This module holds the objective itself: its settings, its loss, its scoring of packed rows.
Beside it, each a formula or a mechanism a reader can take alone: `_importance` (the behaviour
importance weights, the mismatch figures, the loss's aggregation), `_surrogate` (the clipped
surrogate's variants and the reference KL's estimators), `_logprobs` (the chunked log-prob and
entropy pass over the model's head) and `_step_layout` (the guarded update step, its outputs
placed as its inputs were).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew._checks import at_least, in_range, int_at_least, is_callable, one_of, positive
from dew.objectives.rl._importance import (
    aggregate,
    importance_weights,
    mismatch_metrics,
    require,
    sequence_index,
)
from dew.objectives.rl._logprobs import summed_in_float32, target_log_probs
from dew.objectives.rl._step_layout import update_step
from dew.objectives.rl._surrogate import (
    KL_ESTIMATORS,
    RATIO_LEVELS,
    check_clip_dual,
    clipped_surrogate,
    reference_kl,
    sequence_mean,
    upper_clip,
)

__all__ = [
    "AGGREGATIONS",
    "ATTENTION_CELLS",
    "CORRECTIONS",
    "GRPOObjective",
    "IMPORTANCE_LEVELS",
    "LOGIT_CELLS",
    "PROXIMALS",
    "QUANTILES",
    "mismatch_metrics",
]

Model = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]

SCORED = ("tokens", "positions", "segment_ids")
SUPPORT = ("support_tokens", "support_positions")
TRAINED = ("loss_mask", "advantages", "behavior_logprobs", "proximal_logprobs")
REFERENCE = "reference_logprobs"

IMPORTANCE_LEVELS = ("token", "sequence", "geometric")
"""Where the behaviour importance weight is taken: each token's own, the product over its
sequence's trained tokens, or that product's geometric mean (see `GRPOObjective`)."""
CORRECTIONS = ("truncate", "mask")
"""How the weight is applied: capped at `importance_cap`, or masked outside its bounds."""
AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
"""How per-token losses become the loss (see `GRPOObjective`)."""
PROXIMALS = ("rescore", "current")
"""Where the proximal log-probs come from: the batch's rescoring, or the update's own forward
pass (see `GRPOObjective`)."""
QUANTILES = (10, 50, 90)
"""The percentiles of the importance weight that `importance_metrics` reports."""
LOGIT_CELLS = 2**25
"""The logits one chunk of the log-prob pass holds by default (128 MiB of float32): `logit_chunk`
is this over the model's vocabulary, 220 positions at Qwen's 151,936 tokens, still a matmul
large enough to run at full speed."""
ATTENTION_CELLS = 2**22
"""The query-key pairs of one row chunk's attention by default: `row_chunk` is this over the
width squared, so a chunk's scores stay near 16 MiB a head however wide the rows (one row of
2,048 positions a chunk, and every row of a narrow batch in one)."""


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
        clip_high: the clip's upper bound apart, [1 - clip, 1 + clip_high] (clip-higher, DAPO:
            a higher bound lets a token the policy finds unlikely rise further); None: `clip`.
        clip_dual: with a negative advantage A, a token's surrogate is at least clip_dual x A,
            so its loss is at most clip_dual x |A| however far the ratio grows (dual clip);
            above 1 + the upper clip; None: unbounded, as PPO.
        ratio_level: `token` (each token's current / proximal) or `sequence` (GSPO: the
            geometric mean of its sequence's trained tokens' ratios, the exp of their mean
            log-ratio, for each of its tokens, so a sequence clips as one).
        importance_cap: the behaviour importance weight proximal / behaviour is capped here
            (truncation), or a token or sequence whose weight lies above it is left out of the
            loss (masking), so one token the engine found unlikely cannot dominate the step.
        importance_level: `token` (each token's proximal / behaviour), `sequence` (the product
            over its sequence's trained tokens: a sequence is one packed segment, a chain) or
            `geometric` (that product's geometric mean); a sequence's weight applies to each of
            its tokens.
        correction: `truncate` (min(weight, importance_cap): truncated importance sampling)
            or `mask` (a token whose weight lies outside [importance_floor, importance_cap] is
            left out of the loss and counted: masked importance sampling, IcePop).
        importance_floor: masking's lower bound, in [0, 1]; 0 with `truncate`.
        aggregation: `token_mean` (over every trained token of the batch), `sequence_mean`
            (the mean over sequences of each one's token mean) or `constant` (the sum over
            trained tokens divided by the batch's rows x width, a constant: Dr. GRPO).
        kl_coef: the weight of the k3 estimate of KL(current || reference) in the loss; above
            0 the batch must carry `reference_logprobs`.
        kl_estimator: the per-token estimate of that KL, with d = log reference - log current
            clamped to [-20, 20]: `k3` (e^d - d - 1), `k1` (-d), `k2` (d^2 / 2) or `abs` (|d|).
        entropy_coef: an entropy bonus: each kept token's loss less entropy_coef x H_t, the
            entropy of the current policy's distribution at the token, so the update also
            pushes the policy's entropy up (verl's entropy_coeff); 0 (the default): none.
        temperature: the engine's sampling temperature. Every log-prob here is of the logits
            divided by it, the distribution the engine drew from and reported its behaviour
            log-probs under; at another temperature, behaviour and proximal would differ by
            the temperature alone and the importance weights would correct for it, not for
            staleness.
        proximal: where the loss takes the proximal log-probs from. `rescore`: the batch's
            `proximal_logprobs`, rescored under the trainer's weights before the update (the
            scheduler's `packed_log_probs` pass). `current`: the loss's own current log-probs,
            held constant (no gradient flows through them), and the scheduler skips its
            rescoring pass. The two are the same values wherever each packed batch is trained
            by one update at the weights it would have been rescored under, as `Trainer` and
            `dew train` train: then the ratio current / proximal is 1 at every token either
            way, and only the behaviour importance weight moves the gradient. A loop that
            trains one batch for several updates (epochs, minibatches: `Trainer`'s
            `ppo_epochs` and `minibatches`, which refuse `current`) must `rescore`: under
            `current` its ratio would stay 1 and the clip would never act.
        logit_chunk: positions scored at a time, for a model that splits `hidden_states` from
            its `head` (see `dew.models.Model`): each chunk's logits are computed, reduced to
            its log-probs and dropped, and recomputed in the backward pass (`jax.checkpoint`),
            so neither pass holds more than [logit_chunk, vocab] of them rather than [rows,
            width, vocab]. The values are the same. None: `LOGIT_CELLS` over the vocabulary.
            A model that only returns logits is scored whole.
        row_chunk: rows the model runs over at a time, each chunk's activations recomputed in
            the backward pass (`jax.checkpoint` in a `lax.map`), so neither pass holds the
            attention of more than `row_chunk` rows: a row's attention grows with its width
            squared, and a batch of 128 rows of 2,048 positions held 8 GiB of scores a layer.
            The values are the same. None: `ATTENTION_CELLS` over the width squared (every row
            at once for a narrow batch).

    Raises:
        ValueError: naming the argument, for a model that is not callable, a clip outside (0, 1),
            an importance_cap below 1 or an importance_floor outside [0, 1] (an on-policy token
            weighs 1 and must train), a floor other than 0 with `truncate` (it bounds only
            masking), a clip_high outside (0, 1), a clip_dual not above 1 + the upper clip (or
            above 100), an unknown level, correction, aggregation, proximal or kl_estimator, a
            negative kl_coef, an entropy_coef outside [0, 100], a temperature that is not a
            finite number > 0 (greedy decoding has no log-probs to train on), or a logit_chunk
            or row_chunk below 1.
    """

    model: Model = attrs.field(validator=is_callable)
    clip: float = attrs.field(
        default=0.2, kw_only=True, validator=in_range(0, 1, low_open=True, high_open=True)
    )
    clip_high: float | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(in_range(0, 1, low_open=True, high_open=True)),
    )
    clip_dual: float | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(in_range(1, 100))
    )
    ratio_level: str = attrs.field(default="token", kw_only=True, validator=one_of(RATIO_LEVELS))
    importance_cap: float = attrs.field(default=5.0, kw_only=True, validator=at_least(1))
    importance_level: str = attrs.field(
        default="token", kw_only=True, validator=one_of(IMPORTANCE_LEVELS)
    )
    correction: str = attrs.field(default="truncate", kw_only=True, validator=one_of(CORRECTIONS))
    importance_floor: float = attrs.field(default=0.0, kw_only=True, validator=in_range(0, 1))
    aggregation: str = attrs.field(
        default="token_mean", kw_only=True, validator=one_of(AGGREGATIONS)
    )
    kl_coef: float = attrs.field(default=0.0, kw_only=True, validator=at_least(0))
    kl_estimator: str = attrs.field(default="k3", kw_only=True, validator=one_of(KL_ESTIMATORS))
    entropy_coef: float = attrs.field(default=0.0, kw_only=True, validator=in_range(0, 100))
    temperature: float = attrs.field(default=1.0, kw_only=True, validator=positive)
    proximal: str = attrs.field(default="rescore", kw_only=True, validator=one_of(PROXIMALS))
    logit_chunk: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(int_at_least(1))
    )
    row_chunk: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(int_at_least(1))
    )
    # Built once per objective, so each batch shape compiles once for the objective's lifetime.
    _jitted_log_probs: Callable = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(lambda self: jax.jit(self._log_probs), takes_self=True),
    )
    _jitted_weights: Callable = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(lambda self: jax.jit(self._weights), takes_self=True),
    )

    def __attrs_post_init__(self):
        check_clip_dual(self.clip, self.clip_high, self.clip_dual)
        if self.correction == "truncate" and self.importance_floor != 0:
            raise ValueError(
                f"importance_floor bounds masking only: with correction='truncate' leave it 0, "
                f"got {self.importance_floor}"
            )

    @property
    def upper_clip(self) -> float:
        """The clip's upper epsilon: `clip_high`, or `clip` where it is None."""
        return upper_clip(self.clip, self.clip_high)

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
        require(batch, SCORED)
        keys = SCORED + (SUPPORT if _support(batch) else ())
        return self._jitted_log_probs(variables, {key: batch[key] for key in keys})

    def behavior_importance(self, batch: Mapping[str, Any]) -> jax.Array:
        """Per-token behaviour importance weight, at `importance_level`, as `correction` applies it.

        Decoupled PPO's correction for sampling under a stale or differently computed policy:
        the surrogate is taken against the proximal policy, and this reweights each token
        towards it from the behaviour policy the engine really sampled.

        Args:
            batch: `loss_mask`, `behavior_logprobs`, `proximal_logprobs`, float32[rows, width];
                `segment_ids` too at the sequence and geometric levels.

        Returns:
            float32[rows, width]: at trained tokens, the level's weight w (token: exp(proximal -
            behaviour); sequence: the product of the token weights over the sequence's trained
            tokens; geometric: their geometric mean) as min(w, importance_cap) under
            `truncate`, or w where it lies within [importance_floor, importance_cap] and 0
            where masking leaves the token out; 0 where `loss_mask` is 0.

        Raises:
            KeyError: naming a missing key.
        """
        self._require_weighted(batch)
        return self._weights(batch)[2]

    def importance_metrics(
        self, batch: Mapping[str, Any], *, version: int | None = None
    ) -> dict[str, float]:
        """What the behaviour importance looked like over a packed batch, for the step's record.

        Computed from the batch alone (behaviour and proximal log-probs, no model call), so the
        scheduler reports it beside the step's other figures. A figure over no tokens is left
        out.

        Args:
            batch: as `behavior_importance` reads it, plus `versions` (int32[rows, width], each
                completion token's call version) when `version` is given.
            version: the proximal policy's version (the trainer's updates when the rows were
                rescored), to split the mismatch by where it comes from.

        Returns:
            `importance/masked`, the share of trained tokens the correction leaves out (0 under
            `truncate`); `importance/p10`, `/p50`, `/p90`, the level's weight w over trained
            tokens before it is capped or masked; with `version`, `mismatch/engine` and
            `staleness/kl` (see `mismatch_metrics`).

        Raises:
            KeyError: naming a missing key.
        """
        self._require_weighted(batch)
        trained, level_log, _, kept = (np.asarray(a) for a in self._jitted_weights(dict(batch)))
        metrics: dict[str, float] = {}
        if trained.any():
            metrics["importance/masked"] = float(1 - kept[trained].mean())
            weights = np.exp(level_log[trained].astype(np.float64))
            for q in QUANTILES:
                metrics[f"importance/p{q}"] = float(np.percentile(weights, q))
        if version is not None:
            metrics |= mismatch_metrics(batch, version=version)
        return metrics

    def loss(
        self, variables, batch: Mapping[str, Any], *, key: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The importance-weighted clipped surrogate, to minimise, and what the step looked like.

        Pure: jit it and differentiate it with respect to `variables`.

        Args:
            variables: the model's variables being trained.
            batch: the packed keys `packed_log_probs` reads, plus `loss_mask`, `advantages`,
                `behavior_logprobs` and (with `proximal="rescore"`) `proximal_logprobs`,
                float32[rows, width]; with a `kl_coef`, `reference_logprobs` too.
            key: for a model whose training forward draws at random (`stochastic`, a LoRA
                adapter's dropout: see `dew.models.Model`), the PRNG key of this forward,
                handed to the model (a chunk of rows its own, folded from it); None: the
                model's deterministic forward, as every forward outside training.

        Returns:
            The loss: per kept token t, l_t = -w_t x min(r_t x A_t, clip(r_t) x A_t) (+ kl_coef
            x k3_t against the reference) (- entropy_coef x H_t, the entropy bonus), with r_t =
            exp(current - proximal) (at the sequence `ratio_level`, the exp of the sequence's
            mean log-ratio), clip to [1 - clip, 1 + upper_clip], the surrogate at least
            clip_dual x A_t where A_t < 0 with a `clip_dual`, and w_t the
            `behavior_importance`, aggregated as `aggregation` says with each token weighted
            by its loss mask; and float32 metrics over trained tokens (each 0 when there are
            none):
            `loss`; `kl/behavior_proximal`, the k3 estimate of KL(behaviour || proximal), the
            trainer-engine mismatch and staleness together (`importance_metrics` splits them);
            `clip_fraction`, the share of tokens whose gradient the clip removes, split into
            `clip_fraction/low` (A < 0, r below 1 - clip) and `/high` (A > 0, r above 1 +
            upper_clip); with a `clip_dual`, `clip_fraction/dual`, the share it holds;
            `importance/mean`, `importance/max`; `ratio/mean`; `entropy`, the mean entropy
            H_t = -sum_v p_v log p_v of the current policy's distribution at each trained
            token (nats; over a filtered sampler's support where the batch carries one),
            computed in the log-prob pass chunk by chunk; `tokens`, the loss mask's total
            weight; with a `kl_coef`, `kl/reference`, the mean `kl_estimator` of KL(current ||
            reference) over the kept tokens; with `proximal="current"`, `importance/masked`,
            the share of trained tokens the correction leaves out (which `importance_metrics`
            reports from the rescoring otherwise; `Trainer` leaves it out of a step with no
            trained token, as the record does).

        Raises:
            KeyError: naming a missing key.
        """
        trained_keys = TRAINED if self.proximal == "rescore" else TRAINED[:-1]
        require(batch, SCORED + trained_keys + ((REFERENCE,) if self.kl_coef > 0 else ()))
        keys = SCORED + (SUPPORT if _support(batch) else ())
        current, entropy = self._scores(
            variables,
            {name: batch[name] for name in keys},
            entropy="trained" if self.entropy_coef > 0 else "metric",
            key=key,
        )
        mask = jnp.asarray(batch["loss_mask"], jnp.float32)
        advantages = jnp.asarray(batch["advantages"], jnp.float32)
        if self.proximal == "rescore":
            proximal = jnp.asarray(batch["proximal_logprobs"], jnp.float32)
        else:
            proximal = jax.lax.stop_gradient(current)
        trained, level_log, importance, kept = self._weights(batch, proximal)

        # Masked before exp, so an untrained token's ratio can't overflow into a NaN gradient.
        log_ratio = jnp.where(trained, current - proximal, jnp.float32(0))
        if self.ratio_level == "sequence":
            log_ratio = sequence_mean(log_ratio, trained, *sequence_index(batch))
        ratio = jnp.exp(log_ratio)
        surrogate = clipped_surrogate(
            ratio,
            advantages,
            clip_low=self.clip,
            clip_high=self.upper_clip,
            clip_dual=self.clip_dual,
        )
        per_token = -importance * surrogate.value
        if self.entropy_coef > 0:
            per_token = per_token - jnp.float32(self.entropy_coef) * entropy

        tokens = mask.sum()
        count = jnp.maximum(trained.sum().astype(jnp.float32), jnp.float32(1))

        def mean(values: jax.Array) -> jax.Array:
            return jnp.where(trained, values, jnp.float32(0)).sum() / count

        metrics = {}
        if self.kl_coef > 0:
            reference = jnp.asarray(batch[REFERENCE], jnp.float32)
            kl = reference_kl(reference, current, kept, self.kl_estimator)
            per_token = per_token + jnp.float32(self.kl_coef) * kl
            kept_count = jnp.maximum(kept.sum().astype(jnp.float32), jnp.float32(1))
            metrics["kl/reference"] = jnp.where(kept, kl, 0.0).sum() / kept_count
        weight = jnp.where(kept, mask, jnp.float32(0))
        loss = aggregate(weight, per_token, batch, self.aggregation)
        # k3 = (r - 1) - log r with r = proximal / behaviour over behaviour's samples: unbiased
        # for KL(behaviour || proximal) and never negative, unlike the plain -log r.
        log_importance = jnp.where(
            trained,
            proximal - jnp.asarray(batch["behavior_logprobs"], jnp.float32),
            jnp.float32(0),
        )
        k3 = jnp.expm1(log_importance) - log_importance
        metrics = {
            "loss": loss,
            "kl/behavior_proximal": mean(k3),
            "clip_fraction": mean((surrogate.low | surrogate.high).astype(jnp.float32)),
            "clip_fraction/low": mean(surrogate.low.astype(jnp.float32)),
            "clip_fraction/high": mean(surrogate.high.astype(jnp.float32)),
            "importance/mean": mean(importance),
            "importance/max": jnp.max(importance),
            "ratio/mean": mean(ratio),
            "entropy": mean(entropy),
            "tokens": tokens,
            **metrics,
        }
        if self.clip_dual is not None:
            metrics["clip_fraction/dual"] = mean(surrogate.dual.astype(jnp.float32))
        if self.proximal == "current":
            # The scheduler reports it from its rescoring, which this mode skips.
            metrics["importance/masked"] = mean((~kept).astype(jnp.float32))
        return loss, metrics

    def update_fn(
        self, optimizer: optax.GradientTransformation, *, donate: bool = False
    ) -> Callable:
        """A jitted training step on this loss with `optimizer`.

        Args:
            optimizer: an optax transformation; its state comes from `optimizer.init(variables)`.
            donate: the step consumes the variables and optimizer state it is given: their
                buffers become the new ones' (XLA's buffer donation), so a step holds one copy
                of the weights and Adam's moments instead of the old and the new side by side
                (for a 135 M-param model in float32, 1.5 GiB less at the step's peak). The
                caller must not read what it handed in afterwards, and no leaf may be handed in
                twice (an optimizer state holding the variables' own arrays).

        Returns:
            `update(variables, opt_state, batch, key=None) -> (variables, opt_state, metrics)`: one
            optimizer update (`key`: the training forward's, as `loss` takes it, for a `stochastic`
            model); metrics are `loss`'s plus `grad_norm`, the gradient's global norm. A step whose
            loss or gradient norm is not finite returns variables and opt_state as they were, so NaN
            never reaches the weights; its metrics show the non-finite value, for the caller to stop
            on. So does a step with no trained token: nothing to learn from, and Adam's momentum
            alone would move the weights. Variables and state placed on devices come back with the
            shardings they came in with (see `layout`), so the step compiles once per batch shape,
            and so do the jitted functions the weights are pushed to. Its `_cache_size()` counts its
            compilations, as jit's does.
        """
        return update_step(self.loss, optimizer, donate=donate)

    def _require_weighted(self, batch: Mapping[str, Any]) -> None:
        level = () if self.importance_level == "token" else ("segment_ids",)
        require(batch, ("loss_mask", "behavior_logprobs", "proximal_logprobs", *level))

    def _weights(
        self, batch: Mapping[str, Any], proximal: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The behaviour importance over a batch under this objective's settings
        (`_importance.importance_weights`): trained tokens, the level's log-weight, the
        `behavior_importance` and the tokens the correction keeps. `proximal` is the batch's
        `proximal_logprobs` unless given."""
        return importance_weights(
            batch,
            proximal,
            level=self.importance_level,
            correction=self.correction,
            cap=self.importance_cap,
            floor=self.importance_floor,
        )

    def _log_probs(self, variables, batch: Mapping[str, Any]) -> jax.Array:
        """`packed_log_probs` before jit."""
        return self._scores(variables, batch)[0]

    def _scores(
        self,
        variables,
        batch: Mapping[str, Any],
        *,
        entropy: str | None = None,
        key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The packed rows' log-probs, float32[rows, width], and (with `entropy`, as
        `target_log_probs` takes it) the entropy of the distribution each is taken under, 0
        where the log-prob is; traced by `packed_log_probs` and by `loss` (with its `key`)."""
        tokens = jnp.asarray(batch["tokens"], jnp.int32)
        segment_ids = jnp.asarray(batch["segment_ids"], jnp.int32)
        positions = jnp.asarray(batch["positions"], jnp.int32)
        rows, width = tokens.shape
        if callable(getattr(self.model, "hidden_states", None)) and callable(
            getattr(self.model, "head", None)
        ):
            hidden = self._by_rows(
                self.model.hidden_states, variables, tokens, positions, segment_ids, key
            )
            states = jax.ShapeDtypeStruct((1, hidden.shape[-1]), hidden.dtype)
            head = summed_in_float32(self.model.head, variables, states)
            chunk = self.logit_chunk or max(1, LOGIT_CELLS // self.model.vocab)
        else:
            hidden = self._by_rows(self.model, variables, tokens, positions, segment_ids, key)
            # The logits are whole already: one chunk of every predicted position.
            head, chunk = (lambda logits: logits), max(1, rows * (width - 1))
        support = None
        if SUPPORT[0] in batch:
            support = tuple(jnp.asarray(batch[key], jnp.int32) for key in SUPPORT)
        # Position p is predicted by the logits at p - 1: drop the last position and first token.
        scored, spread = target_log_probs(
            head,
            hidden[:, :-1],
            tokens[:, 1:],
            temperature=self.temperature,
            chunk=chunk,
            support=support,
            entropy=entropy,
        )
        follows = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)

        def placed(values: jax.Array) -> jax.Array:
            values = jnp.where(follows, values, jnp.float32(0))
            return jnp.concatenate([jnp.zeros((rows, 1), jnp.float32), values], axis=1)

        return placed(scored), None if spread is None else placed(spread)

    def _by_rows(self, run, variables, tokens, positions, segment_ids, key=None) -> jax.Array:
        """`run(variables, tokens, positions, segment_ids)` over the rows `row_chunk` at a time.

        Each chunk runs in a `jax.checkpoint`ed step of a `lax.map`: the forward pass keeps only
        its output, the backward pass runs the chunk again for its gradient, so no pass holds
        more than one chunk's activations (a row's attention is width x width a head). Rows
        are padded to whole chunks with padding segments (id 0), which attend nowhere. One
        chunk of every row is the plain call. A training forward's `key` goes to `run` as
        `key=`: whole to the plain call, folded with the chunk's index to each chunk (the
        recomputation in the backward pass draws the same), so no two chunks share a mask.
        """
        rows, width = tokens.shape
        chunk = self.row_chunk or max(1, ATTENTION_CELLS // width**2)
        if chunk >= rows:
            if key is None:
                return run(variables, tokens, positions, segment_ids)
            return run(variables, tokens, positions, segment_ids, key=key)
        count = -(-rows // chunk)

        def parts(array: jax.Array) -> jax.Array:
            padded = jnp.pad(array, ((0, count * chunk - rows), (0, 0)))
            return padded.reshape(count, chunk, width)

        chunks = (parts(tokens), parts(positions), parts(segment_ids))
        if key is None:

            @jax.checkpoint
            def step(part: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
                return run(variables, *part)

            out = jax.lax.map(step, chunks)
        else:

            @jax.checkpoint
            def step(part: tuple[jax.Array, tuple[jax.Array, ...]]) -> jax.Array:
                index, arrays = part
                return run(variables, *arrays, key=jax.random.fold_in(key, index))

            out = jax.lax.map(step, (jnp.arange(count, dtype=jnp.int32), chunks))
        return out.reshape(count * chunk, *out.shape[2:])[:rows]
