"""What `dew train` trains on: each task's source, dataset and shape (model context, packed
row width), the objective of a run's model, and the sampling settings per step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import jax
import numpy as np

from dew import models
from dew.data import Batch, Dataset, Task
from dew.envs.environment import Sampling, Seated
from dew.envs.lookup import HARNESSES
from dew.envs.reasoning_gym import ReasoningGym
from dew.envs.tasks import CopyDigits, EchoDigits, GuessDigit
from dew.envs.textarena import PREFIX as TEXTARENA
from dew.envs.verifiers import PREFIX as VERIFIERS
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import task_ids
from dew.objectives.rl.sessions import SessionSource
from dew.serve import RolloutServer, ServedSource
from dew.serve.chat_template import ChatTemplateError
from dew.serve.tokenizer import Tokenizer
from dew.train._config import DEFAULT_MAX_TOKENS, TrainConfig
from dew.train._config_fields import HARNESS
from dew.train._fit import measure


@attrs.frozen
class _Shape:
    """How a built-in task's rollouts are served and packed."""

    max_len: int  # the engine's longest prompt + completion
    width: int  # packed row width
    chains_per_row: int  # chains that surely fit a row
    chains_per_rollout: int = 1  # a game's players each make one (self-play)

    def rows(self, rollouts: int) -> int:
        """Rows enough to pack `rollouts` whatever their chains' lengths."""
        return -(-rollouts * self.chains_per_rollout // self.chains_per_row)


@attrs.frozen
class _RunTask:
    """What a run needs of its task: a source on an engine, task batches and their tasks, and
    how the source's engine is served in the rollouts' trio run (`serve(source, server)`)."""

    source: Callable[[Any, Sampling], SessionSource]
    dataset: Callable[..., Dataset]
    tasks: Callable[[Batch], Sequence[Task]]
    shape: _Shape
    serve: Callable[[SessionSource, RolloutServer], SessionSource] = ServedSource
    # A task's right answer, where it has one (held-out per-class accuracy), else None.
    answer: Callable[[Task], str] | None = None


def _task(config: TrainConfig, tokenizer: Tokenizer) -> _RunTask:
    if config.task.startswith(HARNESS):
        return _harness_task(config)
    if config.task.startswith(VERIFIERS):
        return _verifiers_task(config, tokenizer)
    if config.task.startswith(TEXTARENA):
        return _textarena_task(config, tokenizer)
    if config.task == "copy":
        copy = CopyDigits(seed=config.seed)
        # Every prompt has the same length in bytes; another tokenizer's may differ.
        prompts = {copy.prompt(Task(str(i))) for i in range(config.tasks + config.eval_tasks)}
        longest = max(
            len(tokenizer.encode_chat([{"role": "user", "content": prompt}])) for prompt in prompts
        )
        # A byte tokenizer's reply is its digits and a stop token; another model's says more
        # before it stops, which only --max-tokens makes room for.
        reply = copy.max_tokens if config.max_tokens is None else config.max_tokens
        chain = longest + reply
        shape = _Shape(max_len=chain, width=2 * chain, chains_per_row=2)
        return _RunTask(
            lambda engine, sampling: copy.source(
                engine, sampling=sampling, tokenizer=tokenizer, max_tokens=reply
            ),
            copy.dataset,
            task_ids,
            shape,
            answer=copy.answer,
        )
    if config.task == "guess":
        guess = GuessDigit(seed=config.seed)
        context = guess.max_context
        return _RunTask(
            lambda engine, sampling: guess.source(engine, sampling=sampling, tokenizer=tokenizer),
            guess.dataset,
            task_ids,
            _Shape(max_len=context, width=context, chains_per_row=1),
        )
    if config.task == "echo":
        echo = EchoDigits(seed=config.seed)
        context = echo.max_context(tokenizer)
        return _RunTask(
            lambda engine, sampling: echo.source(engine, sampling=sampling, tokenizer=tokenizer),
            echo.dataset,
            task_ids,
            _Shape(max_len=context, width=context, chains_per_row=1),
        )
    gym = ReasoningGym.parse(config.task, size=config.tasks + config.eval_tasks, seed=config.seed)
    sizes = measure(
        [gym.task(index) for index in range(gym.size)],
        gym.prompt,
        max_tokens=_reply_tokens(config),
        rollouts=config.batch_size * config.groups,
        tokenizer=tokenizer,
        width=None,
    )
    return _RunTask(
        lambda engine, sampling: gym.source(
            engine, max_tokens=_reply_tokens(config), sampling=sampling, tokenizer=tokenizer
        ),
        gym.dataset,
        gym.tasks,
        _Shape(max_len=sizes.context, width=sizes.width, chains_per_row=1),
        answer=lambda task: str(task.payload["answer"]),
    )


def _reply_tokens(config: TrainConfig) -> int:
    """A reasoning-gym or environment reply's most tokens: `--max-tokens`, or the default."""
    return DEFAULT_MAX_TOKENS if config.max_tokens is None else config.max_tokens


def _check_checkpoint_task(config: TrainConfig, tokenizer: Tokenizer) -> None:
    """Refuse a run whose task cannot fit, before anything starts or is written (the run found
    it at its start, with a traceback, a run folder left with only its config): an environment
    whose first prompt leaves no room for a reply within `--max-context`; for a `--model` run,
    its checkpoint's chat template failing on the task's prompts, or the task's sequences longer
    than its `max_position_embeddings`.

    Raises:
        ValueError: naming the environment, the task, its first prompt's length and
            --max-context; or --model, and the template's file and its error, or the field,
            its value and the length the task needs.
    """
    if config.model is None:
        if config.task.startswith((VERIFIERS, TEXTARENA)):
            _task(config, tokenizer)  # sizes the environment's first prompts
        return
    from dew.models import hf  # safetensors and the family on demand

    try:
        needed = _task(config, tokenizer).shape.max_len
    except ChatTemplateError as error:
        origin = getattr(tokenizer, "origin", None) or "its chat template"
        raise ValueError(f"--model {config.model}: {origin}: {error}") from None
    longest = hf.model_of(config.model).max_len
    if needed > longest:
        raise ValueError(
            f"--model {config.model}: its max_position_embeddings is {longest}, but the task's "
            f"sequences (prompt and --max-tokens) need {needed} positions"
        )


@functools.lru_cache(maxsize=4)
def _objective(model: models.Model, temperature: float, **levers: Any) -> GRPOObjective:
    """The objective of a run's model at `temperature`, one per process: the trainer's compiled
    step and the scheduler's rescoring are the objective's, so a second run in the process (a
    resumed run, a notebook's next cell) reuses them rather than compiling again. `levers` are
    the objective's other settings (its correction, aggregation and KL weight)."""
    return GRPOObjective(model, temperature=temperature, **levers)


def _harness_task(config: TrainConfig) -> _RunTask:
    """A built-in agent harness as a run's task: its source is a `ServedGateway`, which serves
    the engine and a recording gateway in the rollouts' trio run and runs the harness against
    the gateway; the engine's and a packed row's length is the harness's `max_len`, one chain
    (a session's merged calls) a row."""
    from dew.gateway import ServedGateway  # the gateway extra, checked with the config

    harness = HARNESSES[config.task.removeprefix(HARNESS)]

    def source(engine, sampling: Sampling) -> SessionSource:
        options = {
            "max_context": harness.max_len,
            "max_tokens": harness.max_tokens,
            "sampling": sampling,
            "announce": False,
        }
        return ServedGateway(
            engine, lambda gateway: harness.source(gateway, seed=config.seed), options
        )

    shape = _Shape(max_len=harness.max_len, width=harness.max_len, chains_per_row=1)
    return _RunTask(source, harness.dataset, task_ids, shape, serve=_served_by_gateway)


def _verifiers_task(config: TrainConfig, tokenizer: Tokenizer) -> _RunTask:
    """A verifiers environment as a run's task (`dew.envs.verifiers`): its taskset's first
    `tasks` tasks train and the next `eval_tasks` are held out; its source is a `ServedGateway`
    serving the engine and a recording gateway, each episode's agents calling the gateway. The
    context is the longest first prompt plus a reply, or `max_context` for a multi-turn one."""
    from dew.envs.verifiers import Verifiers
    from dew.gateway import ServedGateway

    env = Verifiers.parse(config.task, size=config.tasks + config.eval_tasks)
    try:
        sizes = measure(
            [env.task(index) for index in range(env.size)],
            env.prompt,
            max_tokens=_reply_tokens(config),
            rollouts=config.batch_size * config.groups,
            tokenizer=tokenizer,
            max_context=config.max_context,
            width=None,
            prompt_length=_verifiers_prompt_length(env, tokenizer),
        )
    except ValueError as error:
        raise ValueError(
            f"--env {config.task}, --max-context {config.max_context}: {error}"
        ) from None

    def source(engine, sampling: Sampling) -> SessionSource:
        options = {
            "max_context": sizes.context,
            "max_tokens": _reply_tokens(config),
            "sampling": sampling,
            "announce": False,
        }
        return ServedGateway(engine, env.source, options)

    from dew.envs._verifiers_agents import traces_per_episode

    # Each agent's trace is a chain of its own, each up to the context (as self-play's players).
    shape = _Shape(
        max_len=sizes.context,
        width=sizes.width,
        chains_per_row=1,
        chains_per_rollout=traces_per_episode(env.env),
    )
    return _RunTask(source, env.dataset, env.tasks, shape, serve=_served_by_gateway)


def _verifiers_prompt_length(env, tokenizer: Tokenizer) -> Callable[[Task], int]:
    """A verifiers task's first prompt in tokens: the gateway's prompt of the first request its
    agent sends, the environment's tools included (`offered_tools`), not only its messages."""
    from dew.envs._verifiers_tools import offered_tools
    from dew.gateway._budget import first_prompt_length

    tools = offered_tools(env.env)
    return lambda task: first_prompt_length(tokenizer, env.prompt(task), tools)


def _textarena_task(config: TrainConfig, tokenizer: Tokenizer) -> _RunTask:
    """A TextArena game as a run's task (`dew.envs.textarena`): task ids draw its games, those
    after `tasks` held out; an episode's context is the game's own unless `max_context`."""
    from dew.envs.textarena import TextArena

    game = TextArena.parse(config.task, seed=config.seed)
    context = config.max_context or game.game.max_context
    try:
        # A game's first message (its opening) must leave room for a move. Openings differ in
        # what a task draws (a word, a first move), not in their form: the first tasks tell,
        # without building each of a thousand games at start.
        measure(
            [Task(str(index)) for index in range(min(16, config.tasks + config.eval_tasks))],
            lambda task: _unseated(game.environment().reset(task)),
            max_tokens=_reply_tokens(config),
            rollouts=config.batch_size * config.groups,
            tokenizer=tokenizer,
            max_context=context,
        )
    except ValueError as error:
        raise ValueError(f"--env {config.task}, --max-context {context}: {error}") from None

    def source(engine, sampling: Sampling) -> SessionSource:
        return game.source(
            engine,
            max_tokens=_reply_tokens(config),
            max_context=context,
            sampling=sampling,
            tokenizer=tokenizer,
        )

    # In self-play each player's conversation is a chain of its own, each up to the context.
    players = game.game.players if game.self_play else 1
    shape = _Shape(max_len=context, width=context, chains_per_row=1, chains_per_rollout=players)
    return _RunTask(source, game.dataset, game.tasks, shape)


def _unseated(observation):
    """A self-play game's observation without the seat it is for (`Seated`)."""
    return observation.observation if isinstance(observation, Seated) else observation


def _served_by_gateway(source: SessionSource, server: RolloutServer) -> SessionSource:
    """A `ServedGateway` serves its engine itself."""
    return source


def _sampling(config: TrainConfig) -> Sampling:
    """Each call's sampling key a function of the seed and its rollout's label: reproducible
    whatever order trio runs the rollouts in, and in a resumed process the keys the
    uninterrupted run would have drawn (its scheduler numbers its groups on from the
    checkpoint's `next_group`). In a pool, each process draws its own keys: its index is part
    of the seed."""
    entropy = [config.seed, 0]  # the 0 keeps the keys runs drew when it was the start's updates
    if jax.process_count() > 1:
        entropy.append(jax.process_index())
    seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
    return Sampling(config.temperature, seed=seed)
