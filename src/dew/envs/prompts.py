"""Single-turn prompt sets with a verifier: reinforcement learning from verifiable rewards.

`PromptSource` renders a task's prompt with its tokenizer's chat template (a
`dew.serve.tokenizer.Tokenizer`, the byte tokenizer unless given), makes one engine call and scores
the decoded reply. A reply that ran out of tokens before a stop token is
TRUNCATED with reason `length` and still scored, so the scheduler's `truncation='score'` policy
can train on it (and `'zero'` can penalise it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from dew._checks import int_at_least, is_callable
from dew.data import Task
from dew.envs.environment import (
    Observation,
    Sampling,
    Score,
    _engine,
    _eos,
    _stop_tokens,
    _tokenizer,
    blocking,
    describe,
    messages_of,
    reply_text,
    scored_session,
)
from dew.objectives.rl.sessions import Label, Session, Status
from dew.serve._failure import CallFailed
from dew.serve.tokenizer import BYTES, Tokenizer

PromptVerifier = Callable[[Task, str], Score | None]
"""Scores a task's decoded reply; None where it cannot score it."""


def _prompts(instance, attribute, value):
    if not (isinstance(value, Mapping) or callable(value)):
        raise ValueError(f"{attribute.name} must be a mapping or a callable, got {value!r}")


@attrs.frozen
class PromptSource:
    """Runs one single-turn rollout per task: one engine call, scored by the verifier (a
    `SessionSource`).

    The session is COMPLETED when the reply ends with a stop token, TRUNCATED with `length` when
    it filled `max_tokens` without one, and with `context` when it ended short of both (the
    engine's longest sequence); all carry the verifier's score (a truncated reply the verifier
    cannot score has no reward). It is INFRA_ERROR when the verifier raises, answers
    something other than a `Score`, or cannot score a completed reply. A task without a prompt
    and the engine's own exceptions propagate: they are a broken source, not a rollout's outcome.

    The verifier runs in a worker thread that a cancel abandons; it must bound its own time.

    Args:
        engine: anything with `RolloutServer.generate`'s signature.
        prompts: task name -> prompt, or a function of the task giving it; a prompt is a string
            (one user message) or a sequence of role/content messages.
        verifier: scores a task's decoded reply (without its stop token).
        max_tokens: most completion tokens.
        sampling: temperature, top-k/top-p and seed of the engine's sampling.
        tokenizer: renders the prompt and decodes the reply; the byte tokenizer unless given.
        stop: tokens that end a reply; the tokenizer's `eos_id` unless given.
    """

    engine: Any = attrs.field(validator=_engine)
    prompts: Mapping[str, Observation] | Callable[[Task], Observation] = attrs.field(
        validator=_prompts
    )
    verifier: PromptVerifier = attrs.field(validator=is_callable)
    max_tokens: int = attrs.field(kw_only=True, validator=int_at_least(1))
    sampling: Sampling = attrs.field(
        factory=Sampling, kw_only=True, validator=attrs.validators.instance_of(Sampling)
    )
    tokenizer: Tokenizer = attrs.field(default=BYTES, kw_only=True, validator=_tokenizer)
    stop: tuple[int, ...] = attrs.field(
        default=attrs.Factory(_eos, takes_self=True),
        kw_only=True,
        converter=tuple,
        validator=_stop_tokens,
    )

    def prompt(self, task: Task) -> np.ndarray:
        """The token ids of `task`'s prompt, with the generation prompt.

        Raises:
            KeyError: when `prompts` is a mapping without the task's name.
        """
        if isinstance(self.prompts, Mapping):
            if task.name not in self.prompts:
                raise KeyError(f"PromptSource has no prompt for task {task.name!r}")
            observation = self.prompts[task.name]
        else:
            observation = self.prompts(task)
        messages = messages_of(observation)
        return np.asarray(
            self.tokenizer.encode_chat(messages, add_generation_prompt=True), np.int32
        )

    async def run(self, task: Task, label: Label) -> Session:
        """Sample one reply to `task`'s prompt and score it."""
        try:
            call = await self.engine.generate(
                self.prompt(task),
                max_tokens=self.max_tokens,
                stop=self.stop,
                **self.sampling.options(label, 0),
            )
        except CallFailed as error:
            return Session(Status.INFRA_ERROR, (), error=f"engine: {describe(error)}")
        completion = np.asarray(call.completion)
        if len(completion) and int(completion[-1]) in self.stop:
            status, truncation = Status.COMPLETED, None
        else:
            # Short of max_tokens without a stop, it met the engine's longest sequence.
            short = len(completion) < self.max_tokens
            status, truncation = Status.TRUNCATED, "context" if short else "length"
        reply = reply_text(self.tokenizer, completion, self.stop)
        try:
            score = await blocking(self.verifier, task, reply, what="the verifier")
        except Exception as error:
            return Session(Status.INFRA_ERROR, (call,), error=f"verifier: {describe(error)}")
        return scored_session((call,), status, truncation, None, score)
