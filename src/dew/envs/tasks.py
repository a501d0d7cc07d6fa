"""Built-in learnable tasks: small enough for a tiny byte-level transformer on a laptop CPU.

Each task has a dataset of integer task ids (the scheduler's `task_ids` names a task by its
decimal id), a function from a task to its prompt or environment, a verifier and a ready source.
Rewards give partial credit, so a random policy already earns a little and GRPO has a signal from
the start:

- `CopyDigits` (single turn): answer the digit the prompt spells; per-character credit.
- `GuessDigit` (multi-turn): find a secret digit from "higher"/"lower" hints; credit for the
  closest guess and for solving it in few turns.
- `EchoDigits` (multi-turn): repeat each digit the environment says, for as many turns as the
  task sets whatever the agent replies; a workload whose shape no policy changes.

All three use only digits for the agent's side, so a model learns them without a word of English.
"""

from __future__ import annotations

import attrs
import numpy as np

from dew._checks import int_at_least
from dew.data import ArrayDataset, Task
from dew.envs.environment import (
    EnvironmentSource,
    Episode,
    MalformedAction,
    Sampling,
    Score,
)
from dew.envs.prompts import PromptSource
from dew.serve.tokenizer import BYTES, Tokenizer

DIGITS = "0123456789"


def task_dataset(
    rows: int, batch_size: int, *, shuffle_seed: int | None = 0, epochs: int = 1
) -> ArrayDataset:
    """The task ids 0 .. rows-1 as a training dataset of `task_id` batches."""
    return ArrayDataset(
        {"task_id": np.arange(rows, dtype=np.int64)},
        batch_size,
        shuffle_seed=shuffle_seed,
        epochs=epochs,
    )


def task_id(task: Task) -> int:
    """A built-in task's integer id: its name.

    Raises:
        ValueError: naming the task when its name is not a non-negative decimal integer.
    """
    if not task.name.isdecimal():
        raise ValueError(f"task {task.name!r}: a built-in task's name must be its integer id")
    return int(task.name)


def _digit_bound(instance, attribute, value):
    if not (isinstance(value, int) and 1 <= value <= 9):
        raise ValueError(f"{attribute.name} must be an int in [1, 9], got {value!r}")


@attrs.frozen
class CopyDigits:
    """Single turn: answer the `length` digits the prompt spells, each written `repeat` times.

    The prompt for "38" with `repeat` 4 is "33338888"; the answer is "38" and a stop token.
    Writing each digit several times makes a freshly initialised model's near-uniform attention
    already carry it, which is what lets GRPO teach a tiny transformer to copy in minutes (with
    `length` 1; longer answers need positional attention and take much longer).

    Reward (`match`): the share of the n = max(length, len(reply)) positions of the reply that
    hold the answer's digit at that position, so extra characters dilute it and only a reply that
    stops after the digits earns 1. There is no credit for a wrong digit: under GRPO's per-group
    normalisation any credit that does not depend on the prompt (say, for answering with some
    digit) collapses the policy onto one fixed answer before it learns to copy. A uniformly random
    policy earns about 1/(2 x 260) per rollout.

    Args:
        length: digits per answer.
        repeat: how many times the prompt writes each digit.
        seed: the digit strings are a function of it and the task id.
    """

    length: int = attrs.field(default=1, validator=int_at_least(1))
    repeat: int = attrs.field(default=8, validator=int_at_least(1))
    seed: int = attrs.field(default=0, validator=int_at_least(0))

    @property
    def max_tokens(self) -> int:
        """The digits and a stop token."""
        return self.length + 1

    # `rows` task ids in batches of `batch_size`.
    dataset = staticmethod(task_dataset)

    def answer(self, task: Task) -> str:
        """The digit string `task` asks for."""
        rng = np.random.default_rng([self.seed, task_id(task)])
        return "".join(DIGITS[d] for d in rng.integers(0, 10, self.length))

    def prompt(self, task: Task) -> str:
        """The user message of `task`: each digit of its answer, `repeat` times."""
        return "".join(digit * self.repeat for digit in self.answer(task))

    def verify(self, task: Task, reply: str) -> Score:
        """Per-position credit of `reply` against `task`'s answer (see the class)."""
        answer = self.answer(task)
        positions = max(len(answer), len(reply))
        match = sum(a == r for a, r in zip(answer, reply, strict=False)) / positions
        return Score(match, {"match": match})

    def source(
        self,
        engine,
        *,
        sampling: Sampling | None = None,
        tokenizer: Tokenizer = BYTES,
        max_tokens: int | None = None,
    ) -> PromptSource:
        """A `PromptSource` of this task on `engine`, rendering prompts with `tokenizer`, each
        reply up to `max_tokens` (None: `self.max_tokens`, the digits and a stop token as bytes;
        a BPE model's reply takes other counts)."""
        return PromptSource(
            engine,
            self.prompt,
            self.verify,
            max_tokens=self.max_tokens if max_tokens is None else max_tokens,
            sampling=Sampling() if sampling is None else sampling,
            tokenizer=tokenizer,
        )


@attrs.define(eq=False)
class GuessDigitEnv:
    """The world of one `GuessDigit` episode: a secret digit and the guesses made so far.

    Args:
        high: the secret is drawn from 0 .. high.
        seed: the secret is a function of it and the task id.
    """

    high: int
    seed: int
    secret: int | None = None
    guesses: list[int] = attrs.Factory(list)

    def reset(self, task: Task) -> str:
        """Draw `task`'s secret and ask for a guess."""
        rng = np.random.default_rng([self.seed, task_id(task)])
        self.secret = int(rng.integers(0, self.high + 1))
        self.guesses = []
        return f"guess 0-{self.high}"

    def step(self, action: str) -> tuple[str | None, bool]:
        """Take a guess: its first character must be a digit in 0 .. high.

        Raises:
            MalformedAction: for any other action.
        """
        guess = action[:1]
        if not guess or guess not in DIGITS[: self.high + 1]:
            raise MalformedAction(f"a guess must start with a digit in 0-{self.high}: {action!r}")
        self.guesses.append(int(guess))
        if int(guess) == self.secret:
            return None, True
        return ("higher" if self.secret > int(guess) else "lower"), False


@attrs.frozen
class GuessDigit:
    """Multi-turn: find a secret digit in 0 .. `high` from "higher"/"lower" hints.

    The agent replies one token a turn (its guess; `require_stop` is off, so the template closes
    the message), for at most `max_turns` turns; binary search always solves it within
    ceil(log2(high + 2)) turns. A reply that is not a digit in range ends the episode as
    AGENT_ERROR.

    Reward: 0.5 x `closeness` + 0.5 x `speed`, where `closeness` = 1 - (distance of the
    closest guess to the secret) / high (0 without a guess), and `speed` =
    (max_turns - guesses + 1) / max_turns when solved, else 0. `solved` is reported too. A uniformly
    random policy earns about 0.01; always solving it on the first guess earns 1.

    Args:
        high: largest secret, 1 .. 9.
        max_turns: guesses allowed.
        seed: the secrets are a function of it and the task id.
        max_context: the source's context limit, in tokens.
    """

    high: int = attrs.field(default=9, validator=_digit_bound)
    max_turns: int = attrs.field(default=4, validator=int_at_least(1))
    seed: int = attrs.field(default=0, validator=int_at_least(0))
    max_context: int = attrs.field(default=128, validator=int_at_least(2))

    # `rows` task ids in batches of `batch_size`.
    dataset = staticmethod(task_dataset)

    def env(self) -> GuessDigitEnv:
        """A fresh environment (`make_env`)."""
        return GuessDigitEnv(self.high, self.seed)

    def verify(self, env: GuessDigitEnv, episode: Episode) -> Score:
        """Credit for the closest guess and for solving it quickly (see the class)."""
        guesses = env.guesses
        closest = min((abs(g - env.secret) for g in guesses), default=None)
        closeness = 0.0 if closest is None else 1.0 - closest / self.high
        solved = env.secret in guesses
        speed = (self.max_turns - len(guesses) + 1) / self.max_turns if solved else 0.0
        return Score(
            0.5 * closeness + 0.5 * speed,
            {"closeness": closeness, "speed": speed, "solved": float(solved)},
        )

    def source(
        self,
        engine,
        *,
        sampling: Sampling | None = None,
        wall_clock: float | None = None,
        tokenizer: Tokenizer = BYTES,
    ) -> EnvironmentSource:
        """An `EnvironmentSource` of this task on `engine`, rendering the conversation with
        `tokenizer`."""
        return _one_token_turns(self, engine, self.max_context, sampling, wall_clock, tokenizer)


def _one_token_turns(
    task: GuessDigit | EchoDigits,
    engine,
    context: int,
    sampling: Sampling | None,
    wall_clock: float | None,
    tokenizer: Tokenizer,
) -> EnvironmentSource:
    """The `EnvironmentSource` of a task whose agent replies one token a turn (the template
    closes the message) for at most the task's `max_turns`."""
    return EnvironmentSource(
        engine,
        task.env,
        task.verify,
        max_turns=task.max_turns,
        max_tokens=1,
        max_context=context,
        wall_clock=wall_clock,
        require_stop=False,
        sampling=Sampling() if sampling is None else sampling,
        tokenizer=tokenizer,
    )


@attrs.define(eq=False)
class EchoDigitsEnv:
    """The world of one `EchoDigits` episode: the digits the task says, one a turn, and the
    replies so far.

    Args:
        max_turns: an episode lasts 1 .. max_turns turns.
        repeat: how many times a turn writes its digit.
        seed: the turns and digits are a function of it and the task id.
    """

    max_turns: int
    repeat: int
    seed: int
    digits: list[int] = attrs.Factory(list)
    replies: list[str] = attrs.Factory(list)

    def reset(self, task: Task) -> str:
        """Draw `task`'s turns and digits and say the first digit."""
        rng = np.random.default_rng([self.seed, task_id(task)])
        turns = int(rng.integers(1, self.max_turns + 1))
        self.digits = [int(digit) for digit in rng.integers(0, 10, turns)]
        self.replies = []
        return self._say(0)

    def step(self, action: str) -> tuple[str | None, bool]:
        """Take any reply (the score reads it); done once every digit was said."""
        self.replies.append(action)
        if len(self.replies) == len(self.digits):
            return None, True
        return self._say(len(self.replies)), False

    def _say(self, turn: int) -> str:
        return DIGITS[self.digits[turn]] * self.repeat


@attrs.frozen
class EchoDigits:
    """Multi-turn: repeat the digit the environment says, turn after turn.

    A task sets how many turns its episode lasts, 1 .. `max_turns` (uniformly, from the seed and
    the task id), and every reply is taken, so an episode's calls, and its tokens but one a turn
    (a reply that is the stop token spares the template's), are the task's whatever the policy
    does. That is what it is for: a multi-turn workload that stays the same while the policy
    learns, so a run's timing can be set against another setting's (`dew tune`'s predictions,
    `benchmarks/tune_accuracy.py --task echo`). A turn says its digit `repeat` times, which lets
    a tiny transformer learn to repeat it, as in `CopyDigits`.

    Reward (`match`): the share of turns whose reply starts with the digit said. A uniformly
    random policy earns about 1/260.

    Args:
        max_turns: most turns of an episode.
        repeat: how many times a turn writes its digit.
        seed: the turns and digits are a function of it and the task id.
    """

    max_turns: int = attrs.field(default=6, validator=int_at_least(1))
    repeat: int = attrs.field(default=4, validator=int_at_least(1))
    seed: int = attrs.field(default=0, validator=int_at_least(0))

    # `rows` task ids in batches of `batch_size`.
    dataset = staticmethod(task_dataset)

    def env(self) -> EchoDigitsEnv:
        """A fresh environment (`make_env`)."""
        return EchoDigitsEnv(self.max_turns, self.repeat, self.seed)

    def turns(self, task: Task) -> int:
        """How many turns (engine calls) `task`'s episode lasts."""
        env = self.env()
        env.reset(task)
        return len(env.digits)

    def verify(self, env: EchoDigitsEnv, episode: Episode) -> Score:
        """The share of turns answered with their digit (see the class)."""
        said = sum(
            reply[:1] == DIGITS[digit]
            for digit, reply in zip(env.digits, env.replies, strict=False)
        )
        match = said / len(env.digits)
        return Score(match, {"match": match})

    def max_context(self, tokenizer: Tokenizer = BYTES) -> int:
        """The most tokens an episode of `max_turns` turns takes with `tokenizer`: its last
        prompt and a one-token reply."""
        longest = 0
        for digit in DIGITS:
            said = {"role": "user", "content": digit * self.repeat}
            conversation = [said]
            for _ in range(self.max_turns - 1):
                conversation += [{"role": "assistant", "content": digit}, said]
            prompt = tokenizer.encode_chat(conversation, add_generation_prompt=True)
            longest = max(longest, len(prompt) + 1)
        return longest

    def source(
        self,
        engine,
        *,
        sampling: Sampling | None = None,
        wall_clock: float | None = None,
        tokenizer: Tokenizer = BYTES,
    ) -> EnvironmentSource:
        """An `EnvironmentSource` of this task on `engine`, one token a reply, rendering the
        conversation with `tokenizer`."""
        context = self.max_context(tokenizer)
        return _one_token_turns(self, engine, context, sampling, wall_clock, tokenizer)
