"""From tasks, a prompt function or an environment, and a verifier to a trained policy: `fit`.

`fit` is the short path: it measures the sizes the data needs (`measure`), builds the model
(unless given one), a `RolloutServer` serving it inside the scheduler's trio run
(`dew.serve.ServedSource`), a `PromptSource` or `EnvironmentSource`, a `RolloutScheduler` and a
`Trainer`, and trains. Every size a mismatch would break is checked before anything runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import numpy as np
import optax

from dew import models
from dew._checks import check_int, check_number
from dew.data import ArrayDataset, Batch, Task
from dew.envs.environment import EnvironmentSource, Observation, Sampling, messages_of
from dew.envs.prompts import PromptSource
from dew.models.hf import HFModel
from dew.models.hf.lora import LoRAConfig, LoRAModel, frozen
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.serve import ServedSource
from dew.serve._lora import serving
from dew.serve.tokenizer import BYTES, Tokenizer
from dew.train._trainer import Trainer


@attrs.frozen
class Sizes:
    """The shapes a run needs, measured from its data.

    Args:
        prompt: the longest templated first prompt, in tokens.
        chain: the longest chain a rollout makes: prompt + `max_tokens` for a single turn, the
            episode's context limit for an environment.
        context: the model's and the engine's longest sequence; at least `chain`.
        width: the packed rows' width; at least `chain`.
        rows: packed rows per batch: enough for every rollout of a batch at `chain` tokens
            each.
    """

    prompt: int
    chain: int
    context: int
    width: int
    rows: int


def _longest_prompt(
    tasks: Sequence[Task],
    prompt: Callable[[Task], Observation],
    tokenizer: Tokenizer,
    prompt_length: Callable[[Task], int] | None,
) -> tuple[int, Task]:
    for_task = prompt_length or (
        lambda task: len(
            tokenizer.encode_chat(messages_of(prompt(task)), add_generation_prompt=True)
        )
    )
    longest, which = -1, None
    for task in tasks:
        length = for_task(task)
        if length > longest:
            longest, which = length, task
    return longest, which


def measure(
    tasks: Sequence[Task],
    prompt: Callable[[Task], Observation],
    *,
    max_tokens: int,
    rollouts: int,
    tokenizer: Tokenizer = BYTES,
    max_context: int | None = None,
    context: int | None = None,
    width: int | None = None,
    rows: int | None = None,
    prompt_length: Callable[[Task], int] | None = None,
) -> Sizes:
    """The sizes for `tasks`: the longest templated prompt decides the rest, unless given.

    Args:
        tasks: every task the run may see (training and evaluation).
        prompt: a task's first prompt: a string (one user message) or role/content messages.
        max_tokens: the most tokens of one reply.
        rollouts: rollouts per batch (tasks per batch x groups).
        tokenizer: renders the prompts.
        max_context: a multi-turn episode's limit on prompt + reply (its `max_context`); None
            for a single turn, whose chain is the prompt + `max_tokens`.
        context: the model's context; the longest chain unless given.
        width: the packed rows' width; `context` unless given.
        rows: packed rows per batch; enough for `rollouts` chains of the longest length
            unless given.
        prompt_length: a task's first prompt in tokens, where its agents send more than
            `prompt`'s messages (a tool environment's tools: `dew.gateway._budget`); `prompt`
            under `tokenizer`'s template unless given.

    Returns:
        The sizes.

    Raises:
        ValueError: naming the task whose prompt does not fit, when `context` is shorter than
            the longest prompt + `max_tokens` (or than `max_context`), or `width` below the
            longest chain.
    """
    if not tasks:
        raise ValueError("measure needs at least one task")
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    rollouts = check_int("rollouts", rollouts, low=1)
    longest, task = _longest_prompt(tasks, prompt, tokenizer, prompt_length)
    if max_context is None:
        chain = longest + max_tokens
        why = f"the longest prompt ({longest} tokens, task {task.name!r}) + max_tokens {max_tokens}"
    else:
        max_context = check_int("max_context", max_context, low=2)
        if longest >= max_context:
            raise ValueError(
                f"task {task.name!r}'s first prompt has {longest} tokens: it leaves no room "
                f"for a reply within max_context {max_context}"
            )
        chain, why = max_context, f"the episode's max_context {max_context}"
    context = chain if context is None else check_int("context", context, low=2)
    if context < chain:
        raise ValueError(f"context {context} is shorter than {why} = {chain}")
    width = context if width is None else check_int("width", width, low=1)
    if width < chain:
        raise ValueError(f"width {width} is below the longest chain: {why} = {chain}")
    per_row = width // chain
    rows = -(-rollouts // per_row) if rows is None else check_int("rows", rows, low=1)
    return Sizes(prompt=longest, chain=chain, context=context, width=width, rows=rows)


def task_list(tasks: Sequence[Task]) -> Callable[[Batch], list[Task]]:
    """The scheduler's `tasks=` for a list: each `task_id` row names `tasks[task_id]`."""

    def lookup(batch: Batch) -> list[Task]:
        return [tasks[int(index)] for index in np.asarray(batch["task_id"])]

    return lookup


def _source_factory(
    prompt,
    environment,
    verifier,
    *,
    max_tokens,
    max_turns,
    max_context,
    require_stop,
    sampling,
    tokenizer,
) -> Callable[[Any], Any]:
    """How to build the session source on an engine, from a prompt function or an environment."""
    if (prompt is None) == (environment is None):
        raise ValueError("fit needs exactly one of prompt= (single turn) and environment=")
    if prompt is not None:
        if max_turns is not None or max_context is not None or not require_stop:
            raise ValueError(
                "max_turns, max_context and require_stop are an environment's; prompt= has one turn"
            )
        return lambda engine: PromptSource(
            engine, prompt, verifier, max_tokens=max_tokens, sampling=sampling, tokenizer=tokenizer
        )
    if max_turns is None or max_context is None:
        raise ValueError("environment= needs max_turns and max_context")
    return lambda engine: EnvironmentSource(
        engine,
        environment,
        verifier,
        max_turns=max_turns,
        max_tokens=max_tokens,
        max_context=max_context,
        require_stop=require_stop,
        sampling=sampling,
        tokenizer=tokenizer,
    )


def fit(
    tasks: Sequence[Task],
    verifier: Callable[..., Any],
    *,
    prompt: Callable[[Task], Observation] | Mapping[str, Observation] | None = None,
    environment: Callable[[], Any] | None = None,
    first_prompt: Callable[[Task], Observation] | None = None,
    max_tokens: int,
    max_turns: int | None = None,
    max_context: int | None = None,
    require_stop: bool = True,
    steps: int = 100,
    batch_size: int = 8,
    groups: int = 4,
    model: models.Model | None = None,
    params: Any = None,
    tokenizer: Tokenizer = BYTES,
    optimizer: optax.GradientTransformation | None = None,
    sampling: Sampling | None = None,
    context: int | None = None,
    width: int | None = None,
    rows: int | None = None,
    ahead: int = 1,
    max_lag: int = 1,
    estimator: str = "group",
    ppo_epochs: int = 1,
    minibatches: int = 1,
    run: str | os.PathLike | None = None,
    on_step: Callable[[Mapping[str, Any]], None] | None = None,
    seed: int = 0,
    wall_clock: float | None = None,
    lora: LoRAConfig | None = None,
) -> Trainer:
    """Train a policy on `tasks` with GRPO: one call from data and a verifier to a trainer.

    Single turn: give `prompt` (task -> what the user says) and a `verifier(task, reply) ->
    Score`; truncated replies train on their score. Multi-turn: give `environment` (a factory of
    `dew.envs.Environment`), `max_turns`, `max_context` and a `verifier(env, episode) -> Score`;
    `first_prompt` (task -> the first observation, usually what `reset` says) lets the sizes be
    checked before the run, and truncated episodes are masked.

    The sizes come from the data (see `measure`); the model, unless given, is a
    `dew.models.Transformer` as wide as the tokenizer's vocabulary and as long as `context`.

    Args:
        tasks: the tasks; each batch draws `batch_size` of them (shuffled, epoch after epoch).
        verifier: scores a rollout (see above).
        prompt, environment, first_prompt, max_turns, max_context: the source (see above).
        require_stop: an environment's: whether a reply must end with a stop token to be an
            action; False makes a reply that fills `max_tokens` the action (a one-token move).
        max_tokens: the most tokens of one reply.
        steps: steps, each one batch and one weight push (`ppo_epochs` x `minibatches`
            optimizer updates).
        batch_size: tasks per batch; each runs as a group of `groups` rollouts.
        groups: rollouts per task.
        model: the `dew.models.Model` to train; with `params` (its `init` of `seed` unless
            given).
        params: the model's initial params.
        tokenizer: renders prompts and decodes replies; its vocabulary must fit the model's.
        optimizer: an optax transformation; Adam at 1e-3 unless given.
        sampling: the engine's sampling (temperature 1, seeded by `seed`, unless given).
        context, width, rows: override the measured sizes (checked all the same).
        ahead, max_lag: the scheduler's (see `RolloutScheduler`).
        estimator: the advantages, each rollout's reward less its group's mean, scaled by
            the group's reward std (`group`), the batch's (`batch`) or not at all (`mean`),
            or less the mean of the others (`rloo`) (`pack`).
        ppo_epochs, minibatches: each step's batch, rescored once, trains by `ppo_epochs`
            passes over its rows, each split into `minibatches` minibatches (ordered by
            `seed`): that many optimizer updates a step, then one weight push (`Trainer`'s).
            With more than one update the clip acts. `minibatches` must divide the rows.
        run: a folder for `metrics.jsonl` and checkpoints; None keeps neither.
        on_step: called with each step's metrics line.
        seed: the model's initialisation, the sampling and the task order.
        wall_clock: seconds the run may take: once they have passed, it stops after the step
            in progress, saying so (a warning of the `dew.train` logger), and returns the
            trainer as that step left it. None: no bound.
            A step that never ends (an environment whose `step` blocks) is bounded by the
            environment's own `wall_clock` instead (`EnvironmentSource`).
        lora: train a LoRA adapter of `model` (a `dew.models.hf.HFModel`, or dew's
            transformer with targets among `lora.TRANSFORMER_TARGETS`) and its `params`
            instead of every param (`dew.models.hf.lora`): the params stay frozen, with no
            optimizer state, and the engine serves them with the adapter. The trainer's
            variables are then `{"adapter": ..., "base": params}`; an adapter's dropout draws
            from `seed` and the update count.

    Returns:
        The trainer after its last step: `trainer.variables` is the trained policy.

    Raises:
        ValueError: naming the mismatch, before anything runs: a tokenizer vocabulary larger
            than the model's, a context shorter than the longest prompt + `max_tokens`, a
            `width` below the longest chain, a model shorter than the context, or a source
            given twice or not at all.
        NothingTrained: at the end of a run none of whose steps had a rollout to train on
            (a verifier that raises, answers NaN or a bare float rather than a `Score`, fails
            every rollout), naming the errors its rollouts failed with.
    """
    tasks = list(tasks)
    if wall_clock is not None:
        check_number("wall_clock", wall_clock, low=0, low_open=True)
    batch_size = check_int("batch_size", batch_size, low=1)
    groups = check_int("groups", groups, low=1)
    check_int("ppo_epochs", ppo_epochs, low=1)
    check_int("minibatches", minibatches, low=1)
    if len(tasks) < batch_size:
        raise ValueError(f"batch_size {batch_size} exceeds the {len(tasks)} tasks")
    sampling = Sampling(seed=seed) if sampling is None else sampling
    build = _source_factory(
        prompt,
        environment,
        verifier,
        max_tokens=max_tokens,
        max_turns=max_turns,
        max_context=max_context,
        require_stop=require_stop,
        sampling=sampling,
        tokenizer=tokenizer,
    )
    measured_prompt = prompt if environment is None else first_prompt
    if isinstance(measured_prompt, Mapping):
        measured_prompt = _by_name(measured_prompt)
    if measured_prompt is None:
        raise ValueError("environment= needs first_prompt= so that the sizes can be measured")
    sizes = measure(
        tasks,
        measured_prompt,
        max_tokens=max_tokens,
        rollouts=batch_size * groups,
        tokenizer=tokenizer,
        max_context=max_context,
        context=context,
        width=width,
        rows=rows,
    )
    if model is None:
        if params is not None:
            raise ValueError("params without a model: give the model they belong to")
        config = models.TransformerConfig(vocab=tokenizer.vocab_size, max_len=sizes.context)
        model = models.Transformer(config)
    if model.max_len < sizes.context:
        raise ValueError(
            f"the model's max_len {model.max_len} is shorter than the context {sizes.context}"
        )
    if params is None:
        params = model.init(jax.random.key(seed))
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    if lora is not None:
        if not isinstance(model, HFModel | models.Transformer) or not isinstance(lora, LoRAConfig):
            raise ValueError(
                "lora adapts a Hugging Face checkpoint or dew's transformer: give model= a "
                "dew.models.hf.HFModel or dew.models.Transformer and lora= a "
                "dew.models.hf.lora.LoRAConfig"
            )
        model = LoRAModel(model, lora)
        params = model.variables(params, jax.random.key(seed))
        optimizer = frozen(optimizer)
    objective = GRPOObjective(model, temperature=sampling.temperature)
    trainer = Trainer(
        objective,
        optimizer,
        params,
        directory=run,
        on_step=on_step,
        ppo_epochs=ppo_epochs,
        minibatches=minibatches,
        shuffle_seed=seed,
        dropout_seed=seed,
    )
    server = serving(model)(
        model,
        trainer.variables,
        slots=batch_size * groups * (ahead + 1),
        max_len=sizes.context,
        tokenizer=tokenizer,
        seed=seed,
    )
    scheduler = RolloutScheduler(
        objective,
        ServedSource(build(server), server),
        server,
        width=sizes.width,
        rows=sizes.rows,
        tasks=task_list(tasks),
        groups=groups,
        ahead=ahead,
        max_lag=max_lag,
        estimator=estimator,
        truncation="score" if environment is None else "mask",
    )
    per_epoch = len(tasks) // batch_size * batch_size
    dataset = ArrayDataset(
        {"task_id": np.arange(len(tasks))},
        batch_size,
        shuffle_seed=seed,
        epochs=max(1, -(-steps * batch_size // per_epoch)),
    )
    with scheduler:
        trainer.run(
            scheduler, scheduler.tasks(dataset), steps=steps, ahead=ahead, wall_clock=wall_clock
        )
    return trainer


def _by_name(prompts: Mapping[str, Observation]) -> Callable[[Task], Observation]:
    def lookup(task: Task) -> Observation:
        if task.name not in prompts:
            raise KeyError(f"prompt has no entry for task {task.name!r}")
        return prompts[task.name]

    return lookup
