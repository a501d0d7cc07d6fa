"""`dew train`'s config: `TrainConfig`, its fields documented, and reading it from a file.

A run folder's `config.json` is a `TrainConfig` as JSON; `--config` reads one from TOML or JSON,
with the command line's options over it. Each field's own check is `_config_fields`'s, how the
fields go together `_config_checks`'s; what a run checks of the config against the files and
the machine before it starts (the tokenizer, the mesh, the task) is `_config_preflight`'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from dew import models
from dew._checks import in_range, int_within, one_of
from dew._documents import read_document
from dew.models.hf.lora import TARGETS, TRANSFORMER_TARGETS, LoRAConfig
from dew.objectives.rl._surrogate import KL_ESTIMATORS, RATIO_LEVELS
from dew.objectives.rl.grpo import AGGREGATIONS, CORRECTIONS, IMPORTANCE_LEVELS, PROXIMALS
from dew.objectives.rl.sessions import ESTIMATORS
from dew.serve.tokenizer import BYTES
from dew.train._config_checks import WASTE_BUDGET, check_together
from dew.train._config_fields import (
    _admit,
    _admit_value,
    _dtype_or_none,
    _flag,
    _lora_targets,
    _mesh_or_none,
    _no_cut,
    _option,
    _optional_tuple,
    _path_or_none,
    _project_or_none,
    _server_urls,
    _task_name,
)
from dew.train._wandb import WANDB_MODES

# Fields that change what a run logs, not what it trains: a resumed run may change them.
_LOGGING = ("steps", "eval_every", "eval_samples", "samples", "tensorboard")
# Where the vLLM servers run, not what they serve: a resumed run may use other servers.
_LOGGING += ("engine_url", "engine_servers", "engine_timeout")
# Where the proximal log-probs come from, not their values (up to float rounding).
_LOGGING += ("proximal",)
# How many checkpoints stay, not what is trained.
_LOGGING += ("keep_checkpoints", "keep_best")
# Where the metrics are tracked besides metrics.jsonl.
_LOGGING += ("wandb", "wandb_mode")


DEFAULT_MAX_TOKENS = 4
"""A reasoning-gym or environment reply's most tokens where `--max-tokens` gives none."""
LR_DECAYS = ("constant", "linear", "cosine")
"""How the learning rate goes after its warmup: it stays, or falls linearly or along a cosine to
0 at the run's last step (`dew.train._run._optimizer`)."""


@attrs.frozen
class TrainConfig:
    """One `dew train` run: the task, the model, the scheduler and the optimizer.

    Args:
        task: the built-in task, `copy` (CopyDigits, single turn), `guess` (GuessDigit, multi-turn)
            or `echo` (EchoDigits, multi-turn turns that no policy changes: a workload for timing
            studies), a reasoning-gym dataset, `reasoning-gym:NAME[,key=value...]`
            (`dew.envs.reasoning_gym`), or a built-in agent harness behind the recording gateway,
            `harness:NAME` (`dew.envs.lookup.HARNESSES`; `dew train --harness NAME`), a verifiers
            environment, `verifiers:NAME[,key=value...]` (`dew.envs.verifiers`), or a TextArena
            game, `textarena:GAME[,key=value...]` (`dew.envs.textarena`); the last two as `dew train
            --env SPEC`.
        steps: steps to train for, each one batch (one optimizer update, or `ppo_epochs` x
            `minibatches` of them) and one weight push.
        batch_size: tasks per batch, one group each.
        groups: rollouts per task that train together.
        tasks: distinct task ids; the stream goes over them in a seeded order, epoch after epoch.
        learning_rate: Adam's step size: its peak under a warmup or a decay.
        warmup_steps: optimizer updates over which the learning rate rises linearly from 0 to
            learning_rate (the first update's is 0, as in optax's and Hugging Face's warmups).
        lr_decay: after the warmup, the learning rate stays (`constant`) or falls linearly
            (`linear`) or along a half cosine (`cosine`) to 0 at `steps` (x the optimizer
            updates a step, `ppo_epochs` x `minibatches`); a resumed run that extends `steps`
            stretches the rest of the decay.
        max_grad_norm: the gradient is scaled down to this global norm before Adam sees it
            (`optax.clip_by_global_norm`); None: not clipped. The record's `grad_norm` is the
            norm before the clip.
        temperature: the engine's sampling temperature; the objective's log-probs are of the
            same tempered distribution.
        ahead: task batches submitted before the trainer hands them over (the trainer reads
            that far ahead); 0 is synchronous.
        max_lag: the most updates a rollout's oldest call may be behind at training.
        sync_every: updates between weight pushes to the engine.
        oversample: extra rollouts started per group; the first `groups` to finish train and the
            rest are cancelled (the long tail cut, at the price of favouring short rollouts:
            see `dew tune`'s selection column).
        admit: groups trained per batch, the first to complete; the batch's other groups are
            cancelled. None (or "none") trains every task's group. In a pool each process admits its
            share, so it must split evenly over the processes. "auto" chooses each step's
            from the run's own durations, within `waste_budget` (`RolloutScheduler`).
        waste_budget: under admit "auto", the most of the run's slot-seconds it may throw
            away (measured from the run's own events: cancelled, stale, failed, unneeded hedges,
            each from its start on an engine slot); with carry_over, a step past it cancels the
            carried groups beyond a batch's worth.
        filter_uniform: discard a group whose rollouts all scored alike (it trains nothing)
            and, with `admit`, admit a later group in its place (`RolloutScheduler`).
        carry_over: with `admit`, the groups a batch's cut leaves out keep running and train at
            a later step, within `max_lag` (`RolloutScheduler`'s carry_over); a step's rows
            are sized for the whole batch, and a checkpoint keeps the carried groups' tasks.
        hedge: under carry_over, back up a carried group's stragglers with fresh samples two
            calls before its bound (`RolloutScheduler`'s hedge); False (`--no-hedge`)
            resubmits a group whose straggler goes stale whole.
        estimator: the advantages (`pack`): a rollout's reward less its group's mean, scaled
            by the group's reward std (`group`, GRPO), by the batch's (`batch`) or not at all
            (`mean`, Dr. GRPO), or less the mean of the others (`rloo`).
        kl_coef: the weight of a k3 KL penalty to the initial weights, kept as the reference
            policy; 0 for none. A resumed run derives the reference again from the config (the
            seed's initial weights), so checkpoints need not hold it.
        kl_estimator: the penalty's per-token estimate of the KL (`GRPOObjective`'s).
        ref_sync_every: with a kl_coef, re-sync the reference to the policy's weights after
            every N-th optimizer update (kept in the optimizer's state, so checkpoints hold it and a
            resumed run goes on against it); 0: the initial weights, for the whole run.
        entropy_coef: the weight of an entropy bonus (`GRPOObjective`'s); 0 for none.
        aggregation, importance_level, correction, importance_cap, importance_floor: the
            objective's loss aggregation and behaviour-importance correction (`GRPOObjective`).
        clip, clip_high, clip_dual, ratio_level: the surrogate's clip (clip-higher, the dual
            clip) and the level of its ratio, token or sequence (GSPO) (`GRPOObjective`).
        proximal: `rescore` the proximal log-probs before each update, or take the update's
            own (`current`): the same values, since each batch trains one update, for a
            forward pass less per step (`GRPOObjective`'s proximal). A resumed run may
            switch it. Refused with more than one update a step (its ratio would stay 1).
        ppo_epochs, minibatches: each step's batch, rescored once, is trained by `ppo_epochs`
            passes over its rows, each split into `minibatches` minibatches in a seeded order:
            `ppo_epochs` x `minibatches` optimizer updates, then one weight push (`Trainer`'s).
            1 and 1: one update a step, the clip inert. `minibatches` must divide the packed
            rows of every step. A step, a version, `max_lag`, `checkpoint_every` and
            `eval_every` count batches; `warmup_steps`, the decay and `ref_sync_every` count
            optimizer updates (the decay reaches 0 at `steps` x the updates a step).
        checkpoint_every: updates between checkpoints.
        keep_checkpoints: checkpoints kept in `checkpoints/`, the newest and those before it
            (`dew.train.read_kept` lists the earlier ones; a resumed run reads the newest, and
            may change it). The `checkpoints/model` folder of a `model` run is the newest's.
        keep_best: with `eval_every`, each evaluation whose greedy held-out reward is above
            every earlier one's of the run (a resumed run's included) also checkpoints the
            trainer into `checkpoints/best` (with its evaluation in the record's metadata,
            `eval`; a `model` run's folder in `best/model`, a LoRA run's adapter in
            `best/adapter`); resume still reads the newest. A resumed run may change it.
        seed: seeds the initial weights, the task order and the sampling.
        d_model, layers, heads, d_ff: the transformer's shape (`dew.models.TransformerConfig`).
        max_tokens: a reply's most tokens; None for the task's own: the copy task's digits
            and a stop token (a byte tokenizer's count; a BPE tokenizer's model says more
            before it stops), `DEFAULT_MAX_TOKENS` for reasoning-gym and environments.
            guess, echo and harnesses play turns of their own length and take none.
        eval_every: updates between evaluations on the held-out tasks (and one before the
            first): greedy and sampled (mean@k, pass@k) reward, per-class accuracy, replies
            beside the base model's (`dew.train._evaluation`); 0 for none.
        eval_tasks: held-out tasks, the ids after the training ones.
        eval_samples: sampled replies per held-out task for an evaluation's mean@k and pass@k
            (the share of tasks a sampled reply solved), at `temperature`; 0 for greedy only.
        samples: rollouts per step written, decoded, to `samples.jsonl`; 0 for none.
        tensorboard: also write the metrics as TensorBoard scalars (needs tensorboardX).
        wandb: also log the config and every step's metrics to this Weights & Biases project
            (needs wandb), under `RUN/wandb/`; None for none.
        wandb_mode: `offline` (the default: files only, `wandb sync` uploads them later) or
            `online`.
        max_context: an environment's (`verifiers:` or `textarena:`) most tokens per episode,
            its prompts and replies together (the model's context and the packed rows' width);
            None for a TextArena game's own, or a verifiers environment's longest first prompt
            plus `max_tokens` (one turn).
        tokenizer: a Hugging Face `tokenizer.json` (`dew.serve.tokenizer.HuggingFaceTokenizer`)
            that renders the prompts and decodes the replies; the model's vocabulary is its
            size. None for the byte tokenizer.
        model: a Hugging Face checkpoint folder (`dew.models.hf`) to train instead of dew's
            transformer, with the folder's tokenizer and chat template
            (`HuggingFaceTokenizer.from_folder`), or a Hub repository id ("OWNER/NAME", or
            "OWNER/NAME@REVISION") whose snapshot is fetched into the Hub's cache
            (`dew.models.hf.resolve`); the run's
            checkpoints hold it as such a folder, `checkpoints/model`.
        dtype: the checkpoint's params dtype ("float32" or "bfloat16"); None keeps its own.
        remat: recompute each layer's activations in the update's backward pass instead of
            keeping them (`jax.checkpoint` per layer: `Transformer`'s and `HFModel`'s `remat`),
            for the model dew's transformer or `model` names; the same updates in less memory.
        mesh: the device mesh the checkpoint's params, optimizer state and batch are split
            over, "DATAxFSDPxTENSOR" (`dew.models.hf.sharding`); its sizes' product must be this
            process's device count, or in a pool the pool's, where the data axis must be a
            multiple of the processes. None keeps everything on one device.
    """

    task: str = _option(
        "copy",
        _task_name,
        "copy (repeat digits, one turn), guess (find a digit, turns), "
        "echo (repeat a digit a turn, turns the task sets), "
        "reasoning-gym:NAME[,key=value...] (a reasoning-gym dataset and its config) or "
        "harness:NAME (a built-in agent harness, as --harness NAME)",
    )
    steps: int = _option(
        400,
        int_within(1, 10**6),
        "steps to train for, each one batch: one optimizer update (x --ppo-epochs x "
        "--minibatches) and one weight push",
    )
    batch_size: int = _option(8, int_within(1, 4096), "tasks per batch, one group each")
    groups: int = _option(16, int_within(2, 4096), "rollouts per task that train together")
    tasks: int = _option(
        1000, int_within(1, 10**6), "distinct task ids the stream goes over, epoch after epoch"
    )
    # 3e-4, not Adam's usual 1e-3: at 1e-3 the built-in copy task's policy collapsed onto one
    # answer for every prompt before it learned to read the prompt (seeds 0, 1 and 2), and then
    # every group scored alike and nothing more was learned.
    learning_rate: float = _option(3e-4, in_range(0, 1, low_open=True), "Adam's step size")
    warmup_steps: int = _option(
        0,
        int_within(0, 10**6),
        "updates over which the learning rate rises linearly from 0 to --learning-rate",
    )
    lr_decay: str = _option(
        "constant",
        one_of(LR_DECAYS),
        "after the warmup the learning rate stays (constant), or falls linearly (linear) or "
        "along a cosine (cosine) to 0 at --steps",
    )
    max_grad_norm: float | None = _option(
        None,
        attrs.validators.optional(in_range(0, 10**6, low_open=True)),
        "scale the gradient down to this global norm before Adam (none: no clip; the record's "
        "grad_norm is before it)",
        kind=float,
    )
    temperature: float = _option(
        1.0, in_range(0.01, 100), "the sampling temperature, which the objective scores at too"
    )
    ahead: int = _option(
        1, int_within(0, 64), "task batches submitted before the trainer needs them (0 = sync)"
    )
    max_lag: int = _option(
        1, int_within(0, 10**6), "the most updates a rollout may be behind when it trains"
    )
    sync_every: int = _option(
        1, int_within(1, 10**6), "updates between weight pushes to the engine"
    )
    oversample: int = _option(
        0, int_within(0, 4096), "extra rollouts per group; the first `groups` to finish train"
    )
    admit: int | str | None = _option(
        None,
        attrs.validators.optional(_admit),
        "groups trained per batch, the first to complete; none trains every task's group; "
        "auto chooses each step's from the run's own durations, within --waste-budget",
        kind=_admit_value,
        converter=_no_cut,
    )
    waste_budget: float = _option(
        WASTE_BUDGET,
        in_range(0, 1, high_open=True),
        "with --admit auto, the most of the run's slot-seconds it may throw away (with "
        "--carry-over, a step past it cancels the carried groups beyond a batch's worth)",
    )
    filter_uniform: bool = _option(
        False,
        attrs.validators.instance_of(bool),
        "discard groups whose rollouts all scored alike (they train nothing); with --admit, "
        "later groups of the batch take their places",
    )
    carry_over: bool = _option(
        False,
        attrs.validators.instance_of(bool),
        "with --admit, keep the groups a batch's cut leaves out running and train them at a "
        "later step (within --max-lag) instead of cancelling them",
    )
    hedge: bool = _option(
        True,
        attrs.validators.instance_of(bool),
        "with --carry-over, start a fresh sample beside each straggler of a carried group two "
        "calls before --max-lag would make it stale; it stands in only if the straggler misses",
    )
    estimator: str = _option(
        "group",
        one_of(ESTIMATORS),
        "the advantages: reward less the group's mean, over the group's reward std (group), "
        "the batch's (batch) or none (mean); or less the others' mean (rloo)",
    )
    kl_coef: float = _option(
        0.0, in_range(0, 100), "weight of a KL penalty to the initial weights (0 = none)"
    )
    kl_estimator: str = _option(
        "k3",
        one_of(KL_ESTIMATORS),
        "the KL penalty's per-token estimate, d = log ref - log policy: k3 (e^d - d - 1), "
        "k1 (-d), k2 (d^2 / 2) or abs (|d|)",
    )
    ref_sync_every: int = _option(
        0,
        int_within(0, 10**9),
        "re-sync the KL penalty's reference to the policy every N optimizer updates (0 = "
        "never: the initial weights throughout)",
    )
    entropy_coef: float = _option(
        0.0,
        in_range(0, 100),
        "weight of an entropy bonus: each token's loss less entropy-coef x the policy's entropy "
        "there (0 = none)",
    )
    aggregation: str = _option(
        "token_mean",
        one_of(AGGREGATIONS),
        "how the loss averages: token_mean, sequence_mean, or constant (Dr. GRPO)",
    )
    importance_level: str = _option(
        "token",
        one_of(IMPORTANCE_LEVELS),
        "the behaviour importance weight per token, sequence (product) or geometric (mean)",
    )
    correction: str = _option(
        "truncate",
        one_of(CORRECTIONS),
        "truncate the importance weight at --importance-cap, or mask tokens outside "
        "[--importance-floor, --importance-cap]",
    )
    importance_cap: float = _option(5.0, in_range(1, 10**4), "the importance weight's upper bound")
    clip: float = _option(
        0.2,
        in_range(0, 1, low_open=True, high_open=True),
        "the surrogate clips the ratio current / proximal to [1 - clip, 1 + clip]",
    )
    clip_high: float | None = _option(
        None,
        attrs.validators.optional(in_range(0, 1, low_open=True, high_open=True)),
        "the clip's upper bound apart: [1 - clip, 1 + clip-high] (clip-higher, DAPO: 0.28); "
        "none: --clip",
        kind=float,
    )
    clip_dual: float | None = _option(
        None,
        attrs.validators.optional(in_range(1, 100)),
        "bound a negative-advantage token's loss at clip-dual x |advantage| however far its "
        "ratio grows (dual clip, 3 is usual; above 1 + the upper clip); none: unbounded",
        kind=float,
    )
    ratio_level: str = _option(
        "token",
        one_of(RATIO_LEVELS),
        "the surrogate's ratio per token, or per sequence (GSPO: the geometric mean of its "
        "tokens' ratios, so a sequence clips as one)",
    )
    importance_floor: float = _option(
        0.0, in_range(0, 1), "the importance weight's lower bound under --correction mask"
    )
    proximal: str = _option(
        "rescore",
        one_of(PROXIMALS),
        "rescore the proximal log-probs before each update, or take them from the update's "
        "own forward pass (current: the same values, one forward pass less per step)",
    )
    ppo_epochs: int = _option(
        1,
        int_within(1, 1024),
        "passes over each batch's rows, rescored once before the first: with more than one "
        "update a batch the ratio current / proximal departs from 1 and the clip acts",
    )
    minibatches: int = _option(
        1,
        int_within(1, 4096),
        "minibatches each pass splits the batch's rows into, one optimizer update each (it "
        "must divide the packed rows)",
    )
    checkpoint_every: int = _option(25, int_within(1, 10**6), "updates between checkpoints")
    keep_checkpoints: int = _option(
        1,
        int_within(1, 10**4),
        "checkpoints kept, the newest and those before it (--resume reads the newest)",
    )
    keep_best: bool = _option(
        False,
        attrs.validators.instance_of(bool),
        "with --eval-every, also keep the checkpoint of the best held-out greedy reward so far "
        "in RUN/checkpoints/best (a --model run's folder in best/model; --resume reads the newest)",
    )
    seed: int = _option(
        0, int_within(0, 2**32 - 1), "seeds the weights, the task order and the sampling"
    )
    d_model: int = _option(64, int_within(1, 2**14), "the transformer's width")
    layers: int = _option(2, int_within(1, 256), "the transformer's blocks")
    heads: int = _option(4, int_within(1, 256), "the transformer's attention heads")
    d_ff: int = _option(256, int_within(1, 2**16), "the transformer's MLP width")
    max_tokens: int | None = _option(
        None,
        attrs.validators.optional(int_within(1, 2**16)),
        "a reply's most tokens (none: the task's own, copy's its digits and a stop token, "
        f"{DEFAULT_MAX_TOKENS} for reasoning-gym and environments; guess, echo and harnesses "
        "set their own)",
        kind=int,
    )
    eval_every: int = _option(
        0,
        int_within(0, 10**6),
        "updates between evaluations on held-out tasks, and one before the first: greedy and "
        "mean@k and pass@k reward, per-class accuracy, replies beside the base model's (0 = none)",
    )
    eval_tasks: int = _option(
        16, int_within(1, 10**5), "held-out tasks, the ids after the training ones"
    )
    eval_samples: int = _option(
        4,
        int_within(0, 256),
        "sampled replies per held-out task for an evaluation's mean@k and pass@k (the share of "
        "tasks a sampled reply solved) (0 = greedy only)",
    )
    samples: int = _option(
        4, int_within(0, 10**4), "rollouts per step written, decoded, to samples.jsonl (0 = none)"
    )
    tensorboard: bool = _option(
        False,
        _flag,
        "also write the metrics as TensorBoard scalars to RUN/tensorboard (needs tensorboardX)",
    )
    wandb: str | None = _option(
        None,
        _project_or_none,
        "also log the config and every step's metrics to this Weights & Biases project, under "
        "RUN/wandb (needs wandb)",
        kind=str,
    )
    wandb_mode: str = _option(
        "offline",
        one_of(WANDB_MODES),
        "with --wandb: offline (files only; wandb sync uploads them later) or online",
    )
    max_context: int | None = _option(
        None,
        attrs.validators.optional(int_within(2, 2**20)),
        "an environment's (--env) most tokens per episode, prompts and replies together; none: "
        "a TextArena game's own, or a verifiers environment's longest first prompt + a reply",
        kind=int,
    )
    tokenizer: str | None = _option(
        None,
        _path_or_none,
        "a Hugging Face tokenizer.json for the prompts and replies, with <bos>, <|im_start|> "
        "and <|im_end|> as special tokens; the model's vocabulary is its size (none: bytes)",
        kind=str,
    )
    model: str | None = _option(
        None,
        _path_or_none,
        "a Hugging Face checkpoint folder to train (Llama, Mistral, Qwen2, Qwen3), with its own "
        "tokenizer and chat template, or a Hub repository id (OWNER/NAME[@REVISION]) fetched "
        "into the Hub's cache; its checkpoints are such folders (none: dew's transformer of "
        "--d-model, --layers, --heads, --d-ff)",
        kind=str,
    )
    dtype: str | None = _option(
        None,
        _dtype_or_none,
        "the --model checkpoint's params dtype, float32 or bfloat16 (none: the checkpoint's)",
        kind=str,
    )
    remat: bool = _option(
        False,
        attrs.validators.instance_of(bool),
        "recompute each layer's activations in the update's backward pass instead of keeping "
        "them: the same updates in less memory, for about one more forward pass",
    )
    # The engine that samples the rollouts (docs/vllm.md).
    engine: str = _option(
        "dew",
        attrs.validators.in_(("dew", "vllm")),
        "the engine that samples: dew (its JAX engine) or vllm (vLLM servers of --model)",
    )
    engine_url: tuple[str, ...] | None = attrs.field(
        default=None,
        converter=lambda urls: (urls,) if isinstance(urls, str) else _optional_tuple(urls),
        validator=[
            attrs.validators.optional(
                attrs.validators.deep_iterable(attrs.validators.instance_of(str))
            ),
            _server_urls,
        ],
        metadata={
            "help": "with --engine vllm, the URLs of running vLLM servers to use instead of "
            "starting them, http://HOST:PORT (a trailing / or /v1 is dropped); a server "
            "started with --api-key takes its key from $VLLM_API_KEY (none: start "
            "--engine-servers)",
            "type": str,
            "nargs": "+",
        },
    )
    engine_servers: int = _option(
        1, int_within(1, 64), "with --engine vllm, how many vLLM servers to start"
    )
    engine_timeout: float = _option(
        600.0,  # dew.serve._vllm.READ_TIMEOUT, which test_vllm_timeout.py holds it to
        in_range(0, 86400, low_open=True),
        "with --engine vllm, the seconds a server may send nothing while dew waits on it (a "
        "call's first token, the next token, a push) before it is left out as dead",
    )

    mesh: str | None = _option(
        None,
        _mesh_or_none,
        "split the --model checkpoint's params, optimizer state and batch over this process's "
        "devices (a pool's: its data axis across the processes) as DATAxFSDPxTENSOR, e.g. "
        "1x2x2 (none: one device)",
        kind=str,
    )
    # A LoRA adapter of the --model checkpoint (or of dew's transformer) instead of all its
    # params (docs/checkpoints.md).
    lora: bool = _option(
        False,
        attrs.validators.instance_of(bool),
        "train a LoRA adapter of the --model checkpoint (or of dew's transformer), its params "
        "frozen (no optimizer state for them); checkpoints hold a checkpoint's adapter as PEFT "
        "saves it",
    )
    lora_rank: int = _option(8, int_within(1, 4096), "with --lora, the adapter's rank")
    lora_alpha: float = _option(
        16.0,
        in_range(0, 1e6, low_open=True),
        "with --lora, the adapter's alpha: its delta is alpha / rank x B A",
    )
    lora_targets: str | None = _option(
        None,
        _lora_targets,
        "with --lora, the modules adapted in each block, comma-separated, e.g. q_proj,v_proj "
        "(none: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj; for dew's "
        "transformer, of qkv,out,up,down, all of them)",
        kind=str,
    )
    lora_dropout: float = _option(
        0.0,
        in_range(0, 1, high_open=True),
        "with --lora, the probability that a training step drops each feature of an adapter's "
        "input (PEFT's lora_dropout; never when sampling or rescoring)",
    )

    @property
    def optimizer_updates(self) -> int:
        """The run's optimizer updates: `steps` x `ppo_epochs` x `minibatches`."""
        return self.steps * self.ppo_epochs * self.minibatches

    def lora_config(self) -> LoRAConfig | None:
        """The adapter `lora` trains, or None for a run of every param."""
        if not self.lora:
            return None
        if self.lora_targets is None:
            targets = TARGETS if self.model is not None else TRANSFORMER_TARGETS
        else:
            targets = tuple(name.strip() for name in self.lora_targets.split(","))
        return LoRAConfig(self.lora_rank, self.lora_alpha, targets, self.lora_dropout)

    def __attrs_post_init__(self):
        check_together(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "config.json") -> TrainConfig:
        """The config a run folder's `config.json` (or a `--config` file) holds.

        Raises:
            ValueError: naming a key that is not a field, or a field out of bounds.
        """
        return cls(**_fields_of(data, where))

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> TrainConfig:
        """The config of a TOML or JSON file (a run folder's `config.json` among them), with
        `overrides` (the options given on the command line) over it.

        Raises:
            ValueError: naming the file when it cannot be read or parsed, a key that is not a
                field, or a field out of bounds.
        """
        path = Path(path)
        try:
            data = read_document(path, toml=path.suffix.lower() == ".toml")
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read the config file {str(path)!r}: {error}") from error
        if not isinstance(data, Mapping):
            raise ValueError(f"{str(path)!r} must hold a table of TrainConfig fields")
        return cls(**{**_fields_of(data, str(path)), **overrides})

    def model_config(
        self, max_len: int, *, vocab: int = BYTES.vocab_size
    ) -> models.TransformerConfig:
        """The transformer's config for this run, with positions up to `max_len` and `vocab`
        token ids (the tokenizer's)."""
        return models.TransformerConfig(
            vocab=vocab,
            d_model=self.d_model,
            heads=self.heads,
            layers=self.layers,
            d_ff=self.d_ff,
            max_len=max_len,
        )


def _fields_of(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The fields `data` (the file `where`) gives, each checked by its own validator, so that a
    bad value is refused naming the file it is in.

    Raises:
        ValueError: naming `where` and the key that is not a field or the value out of bounds.
    """
    fields = attrs.fields_dict(TrainConfig)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where} has keys that are not TrainConfig fields: {unknown}")
    for name, value in data.items():
        try:
            fields[name].validator(None, fields[name], value)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    return dict(data)


def _read_json(path: Path) -> Any:
    """A JSON file's value.

    Raises:
        ValueError: naming the file when it is truncated or not JSON.
    """
    try:
        return read_document(path)
    except ValueError as error:
        raise ValueError(f"{path} is damaged (not JSON: {error})") from None
