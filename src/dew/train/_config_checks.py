"""How `TrainConfig`'s fields go together: the checks of one field against another, and the
bounds on their products, which each field's own check (`_config_fields`) cannot see."""

from __future__ import annotations

from typing import Any

from dew import models
from dew.models.hf.lora import LoRAModel
from dew.objectives.rl._surrogate import check_clip_dual
from dew.train._config_fields import ENVIRONMENTS, HARNESS

MAX_IN_FLIGHT = 2**16
"""The most rollouts a run has in flight, batch_size x (groups + oversample) x (ahead + 1): the
engine holds a slot, and its cache, for each."""
MAX_WEIGHTS = 2**31
"""The most weights of a run's transformer blocks (8 GiB of float32, before Adam's two more)."""
WASTE_BUDGET = 0.2
"""`--waste-budget`'s default, which a run without `--admit auto` keeps."""


def check_together(config: Any) -> None:
    """Refuse fields of `config`, the `TrainConfig` being made (its `__attrs_post_init__` calls
    this; `Any` because `_config` imports this module), that do not go together, naming them and
    what to give or leave out.

    Raises:
        ValueError: naming the fields.
    """
    check_clip_dual(config.clip, config.clip_high, config.clip_dual)
    if config.mesh is not None and config.model is None:
        raise ValueError("mesh splits a --model checkpoint over devices: give model too")
    if config.model is not None and config.tokenizer is not None:
        raise ValueError("model brings its folder's tokenizer: leave out tokenizer")
    if config.dtype is not None and config.model is None:
        raise ValueError("dtype is the dtype of a --model checkpoint: give model too")
    if config.engine == "vllm" and config.model is None:
        raise ValueError("engine vllm serves a --model checkpoint folder: give model too")
    if config.lora and config.mesh is not None:
        raise ValueError("lora keeps the adapter and its checkpoint on one device: leave out mesh")
    lora_fields = (
        ("lora_rank", 8),
        ("lora_alpha", 16.0),
        ("lora_targets", None),
        ("lora_dropout", 0.0),
    )
    if config.lora and config.model is None:
        try:  # the adapter of dew's transformer of any shape: its modules are the same
            LoRAModel(models.Transformer(models.TransformerConfig()), config.lora_config())
        except ValueError as error:
            raise ValueError(str(error).replace("lora targets", "lora_targets", 1)) from None
    for name, default in lora_fields:
        if not config.lora and getattr(config, name) != default:
            raise ValueError(f"{name} shapes a LoRA adapter: give lora too")
    if config.ref_sync_every and config.kl_coef == 0:
        raise ValueError(
            f"ref_sync_every re-syncs the KL penalty's reference: give kl_coef above 0 "
            f"too, got ref_sync_every {config.ref_sync_every} with kl_coef 0"
        )
    if config.lr_decay != "constant" and config.warmup_steps >= config.optimizer_updates:
        raise ValueError(
            f"warmup_steps must be below steps x ppo_epochs x minibatches "
            f"({config.optimizer_updates}, the run's optimizer updates) for lr_decay "
            f"{config.lr_decay}: the decay follows the warmup, got {config.warmup_steps}"
        )
    if config.proximal == "current" and config.ppo_epochs * config.minibatches > 1:
        raise ValueError(
            f"proximal current takes the ratio's proximal log-probs from each update's own "
            f"pass, so with ppo_epochs {config.ppo_epochs} x minibatches {config.minibatches} "
            "updates a batch the ratio would stay 1 and the clip never act: give proximal "
            "rescore"
        )
    if config.admit != "auto" and config.waste_budget != WASTE_BUDGET:
        raise ValueError("waste_budget bounds the cuts of admit auto: give admit auto too")
    if config.engine_url is not None and config.engine != "vllm":
        raise ValueError("engine_url names vLLM servers: give engine vllm too")
    if config.d_model % config.heads:
        raise ValueError(
            f"d_model must be a multiple of heads {config.heads}, got {config.d_model}"
        )
    # What the engine and the model allocate grows with products of the fields: each field
    # within its bound can still multiply up to terabytes.
    in_flight = config.batch_size * (config.groups + config.oversample) * (config.ahead + 1)
    if in_flight > MAX_IN_FLIGHT:
        raise ValueError(
            f"batch_size x (groups + oversample) x (ahead + 1) is the rollouts in flight, "
            f"which must be <= {MAX_IN_FLIGHT}, got {in_flight}"
        )
    weights = config.layers * (4 * config.d_model**2 + 2 * config.d_model * config.d_ff)
    if weights > MAX_WEIGHTS:
        raise ValueError(
            f"layers x (4 d_model^2 + 2 d_model d_ff) is the transformer's weights, which "
            f"must be <= {MAX_WEIGHTS}, got {weights}"
        )
    if config.correction == "truncate" and config.importance_floor != 0:
        raise ValueError(
            "importance_floor bounds masking only: give correction mask, or leave it 0"
        )
    if config.max_context is not None and not config.task.startswith(tuple(ENVIRONMENTS)):
        raise ValueError(
            f"max_context sizes an environment's episodes (--env); task {config.task!r} sets "
            "its own"
        )
    own_turns = config.task in ("guess", "echo") or config.task.startswith(HARNESS)
    if config.max_tokens is not None and own_turns:
        raise ValueError(
            f"max_tokens sizes a reply; task {config.task!r} sets its turns' own, got "
            f"{config.max_tokens}"
        )
    if config.tasks < config.batch_size:
        raise ValueError(f"tasks must be >= batch_size {config.batch_size}, got {config.tasks}")
    if isinstance(config.admit, int) and config.admit > config.batch_size:
        raise ValueError(f"admit must be <= batch_size {config.batch_size}, got {config.admit}")
    if config.keep_best and not config.eval_every:
        raise ValueError("keep_best keeps the best evaluation's checkpoint: give eval_every too")
    if config.carry_over and config.admit is None:
        raise ValueError("carry_over needs admit: it carries the groups admit leaves out")
    if not config.hedge and not config.carry_over:
        raise ValueError("hedge backs up carried groups' stragglers: give carry_over too")
    if config.max_lag < config.ahead + config.sync_every - 1:
        raise ValueError(
            f"max_lag must be >= ahead + sync_every - 1 = {config.ahead + config.sync_every - 1}, "
            f"got {config.max_lag}"
        )
