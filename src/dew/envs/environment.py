"""In-process multi-turn environments, and the session source that runs an agent in them.

An `Environment` is a small synchronous object: `reset(task)` opens an episode and says what the
agent sees first, `step(action)` takes the agent's reply and says what it sees next and whether
the episode is over. A `Verifier` scores the episode afterwards. `EnvironmentSource` plays one
episode per rollout: it renders the conversation with the chat template of its tokenizer (a
`dew.serve.tokenizer.Tokenizer`, the byte tokenizer unless given), calls the engine once per turn,
and steps the environment with the decoded reply.

Each turn's prompt is the previous call's prompt and completion followed by the template's
tokens for the environment's reply, so the calls of an episode merge into one chain.

An episode of several agents (self-play, a game of two players) says which one acts next by
returning a `Seated` observation: each seat keeps a conversation, and so a chain, of its own,
each call is tagged with its seat (`Call.seat`), and a verifier that scores each seat
(`Score.seats`) has each train on its own reward against the same seat of its group.

Environments are plain blocking code: reset and step (and the verifier) run in trio worker
threads that a cancel abandons. An abandoned thread cannot be stopped: it keeps running, and
keeps its slot in trio's default thread limiter, until the environment returns. Environments
must therefore bound their own step time.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import trio
from attrs.validators import optional

from dew._checks import finite, int_at_least, is_callable, positive
from dew.data import Task
from dew.objectives.rl._session import waiting_on
from dew.objectives.rl.sessions import Call, Label, Session, Status
from dew.serve._failure import CallFailed
from dew.serve._sampling import Sampling
from dew.serve.tokenizer import BYTES, Tokenizer

Message = Mapping[str, str]
"""A chat message: `{"role": ..., "content": ...}`."""

Observation = str | Sequence[Message]
"""What the agent sees: a plain string is one user message."""


def _seat_name(instance, attribute, value):
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty str, got {value!r}")


@attrs.frozen
class Seated:
    """What one agent of an episode of several sees, and that it acts next.

    `Environment.reset` and `step` return one to name the seat whose reply the next `step`
    takes. A seat's first observation opens its conversation; each later one continues it
    after that seat's own last reply. An episode's observations are all seated or none.

    Args:
        seat: the agent's name (e.g. "player0"), as `Score.seats` names its reward.
        observation: what is new to it since its last turn.
    """

    seat: str = attrs.field(validator=_seat_name)
    observation: Observation


class MalformedAction(ValueError):
    """Raised by `Environment.step` when the agent's action cannot be taken: the session ends as
    AGENT_ERROR (the agent's fault, still scored), not INFRA_ERROR."""


@runtime_checkable
class Environment(Protocol):
    """One episode's world, driven by an agent's text actions.

    Both methods are blocking and run in a worker thread; a cancel abandons that thread, so each
    call must return in bounded time on its own.
    """

    def reset(self, task: Task) -> Observation | Seated:
        """Start an episode of `task` and return what the agent (or the seat that acts
        first, `Seated`) sees first."""
        ...

    def step(self, action: str) -> tuple[Observation | Seated | None, bool]:
        """Take the acting agent's action and return `(observation, done)`.

        The observation is ignored when `done`. Raise `MalformedAction` for an action the
        environment cannot take; any other exception is an infrastructure failure.
        """
        ...


def _seat_floats(value: Any) -> Any:
    """Each seat's reward as a float, as `Score.reward` is (numpy's scalars included); a value
    that is no number stays for the validator to name."""
    if not isinstance(value, Mapping):
        return value
    return {
        seat: float(reward) if isinstance(reward, numbers.Real) else reward
        for seat, reward in value.items()
    }


def _seat_rewards(instance, attribute, value):
    if value is None:
        return
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty mapping or None, got {value!r}")
    for seat, reward in value.items():
        if not isinstance(seat, str) or not seat:
            raise ValueError(f"{attribute.name} must be keyed by seat names, got {seat!r}")
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"{attribute.name}[{seat!r}] must be a finite number, got {reward!r}")


@attrs.frozen
class Score:
    """A verifier's verdict: the reward and its named parts (reported, not trained on).

    Args:
        reward: what the episode's unseated calls train on (every call, without `seats`).
        components: the reward's named parts, reported.
        seats: in an episode of several agents (`Seated`), each seat's own reward: a seat's
            calls train on it, with a baseline over the same seat of the group's other
            episodes (seats `NAME.0`, `NAME.1`, ..., several attempts of one agent, share
            one); a seat left out of it is not trained, but seats none of which acted (a
            misspelt name, or an episode without seats) make the rollout an INFRA_ERROR saying
            so. None trains every call on `reward`.
    """

    reward: float = attrs.field(converter=float, validator=finite)
    components: Mapping[str, float] = attrs.field(factory=dict)
    seats: Mapping[str, float] | None = attrs.field(
        default=None, converter=_seat_floats, validator=_seat_rewards
    )


@attrs.frozen(eq=False)
class Episode:
    """What the verifier of an environment sees of one episode.

    Args:
        task: the task played.
        messages: the conversation as the template rendered it, the agent's replies included
            (in an episode of several seats, every seat's messages in the order they came).
        actions: the agent's decoded actions, in order (every seat's).
        status: how the episode ended (COMPLETED, AGENT_ERROR or TRUNCATED).
        truncation: why a TRUNCATED episode stopped.
    """

    task: Task
    messages: tuple[Message, ...]
    actions: tuple[str, ...]
    status: Status
    truncation: str | None = None


Verifier = Callable[[Environment, Episode], Score | None]
"""Scores an episode from the environment's final state and the episode; None where it cannot
score it (e.g. a truncated episode it has no verdict for)."""


def _engine(instance, attribute, value):
    if not callable(getattr(value, "generate", None)):
        raise ValueError(f"{attribute.name} must have an async generate(), got {value!r}")


def _stop_tokens(instance, attribute, value):
    vocab_size = instance.tokenizer.vocab_size
    if not value or any(not 0 <= token < vocab_size for token in value):
        raise ValueError(
            f"{attribute.name} must hold at least one token id in [0, {vocab_size}) (the "
            f"tokenizer's vocabulary), got {value!r}"
        )


def _tokenizer(instance, attribute, value):
    if not isinstance(value, Tokenizer):
        raise ValueError(
            f"{attribute.name} must implement dew.serve.tokenizer.Tokenizer, got {value!r}"
        )


def _eos(source) -> tuple[int, ...]:
    """A source's default stop tokens: its tokenizer's end of an assistant reply."""
    # Defaults are made before validators run: check the tokenizer before reading it.
    _tokenizer(source, attrs.fields(type(source)).tokenizer, source.tokenizer)
    return (source.tokenizer.eos_id,)


def messages_of(observation: Observation) -> list[Message]:
    """The chat messages an observation stands for: a string is one user message.

    Raises:
        TypeError: when it is neither a string nor a sequence (the chat template checks the
            messages themselves).
    """
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not isinstance(observation, Sequence):
        raise TypeError(
            f"an observation must be a string or a sequence of messages, got {observation!r}"
        )
    return list(observation)


def reply_text(tokenizer: Tokenizer, completion: np.ndarray, stop: Sequence[int]) -> str:
    """The text of a completion, without the stop token that ended it."""
    if len(completion) and int(completion[-1]) in stop:
        completion = completion[:-1]
    return tokenizer.decode(completion)


def describe(error: BaseException) -> str:
    """An exception as a session's `error` text: its type and message."""
    return f"{type(error).__name__}: {error}"


async def blocking(function: Callable[..., Any], *args: Any, what: str) -> Any:
    """Run blocking code in a worker thread that a cancel abandons.

    The abandoned thread runs on to its end and holds its thread-limiter slot until then.

    Args:
        what: the code, as a trainer's long wait on this rollout names it ("the verifier",
            "the environment's step"): a step that blocks is then not blamed on the engine.
    """
    with waiting_on(what):
        return await trio.to_thread.run_sync(function, *args, abandon_on_cancel=True)


def _continuation(tokenizer: Tokenizer, completion: np.ndarray, new: list[Message]) -> np.ndarray:
    """The tokens that follow an assistant's completion when the environment replies `new`.

    The template closes the assistant's message with `eos_id` (unless the completion already
    ends with it) and the turn suffix, then writes the new messages and the next generation
    prompt. The agent's completion itself stays as sampled, so the next prompt extends this
    call's prompt and completion exactly.
    """
    ended = len(completion) and int(completion[-1]) == tokenizer.eos_id
    close = [tokenizer.turn_suffix()] if ended else [[tokenizer.eos_id], tokenizer.turn_suffix()]
    turns = [tokenizer.encode_turn(message) for message in new]
    pieces = [*close, *turns, tokenizer.generation_prompt()]
    return np.concatenate([np.asarray(piece, np.int32) for piece in pieces])


@attrs.define(eq=False)
class _Play:
    """An episode in progress: what the session and the verifier are built from."""

    task: Task
    env: Environment | None = None
    messages: list[Message] = attrs.Factory(list)
    actions: list[str] = attrs.Factory(list)
    calls: list[Call] = attrs.Factory(list)
    # Whether the episode's observations are `Seated` (None before the first), and each seat's
    # last call, as (prompt, completion): what its next observation continues.
    seated: bool | None = None
    last: dict[str | None, tuple[np.ndarray, np.ndarray]] = attrs.Factory(dict)
    # True while a worker thread may be inside the environment: a deadline that abandons that
    # thread leaves the environment mid-step, where nothing else may touch it.
    busy: bool = False

    async def enter(self, function: Callable[..., Any], *args: Any, what: str) -> Any:
        """Call into the environment in a worker thread, `busy` until the thread is done: a
        cancel (not an `Exception`) is the one way out that leaves the thread running.
        `what` names the call for a long wait (`blocking`)."""
        self.busy = True
        try:
            result = await blocking(function, *args, what=f"the environment's {what}")
        except Exception:
            self.busy = False
            raise
        self.busy = False
        return result

    def seat_of(self, observation: Observation | Seated) -> tuple[str | None, Observation]:
        """The seat that acts next (None in an episode of one agent) and what it sees.

        Raises:
            TypeError: when the episode mixes seated observations with plain ones.
        """
        seated = isinstance(observation, Seated)
        if self.seated is None:
            self.seated = seated
        elif seated != self.seated:
            kinds = ("plain", "Seated") if seated else ("Seated", "plain")
            raise TypeError(
                f"an episode's observations must all be Seated or none: a {kinds[1]} "
                f"observation came after {kinds[0]} ones ({observation!r})"
            )
        return (observation.seat, observation.observation) if seated else (None, observation)


@attrs.frozen
class _End:
    status: Status
    truncation: str | None = None
    error: str | None = None


@attrs.frozen
class EnvironmentSource:
    """Runs one episode of an in-process environment per rollout (a `SessionSource`).

    Each turn renders the conversation with the chat template, calls the engine, decodes the
    reply and steps the environment with it. The episode ends:

    - COMPLETED when the environment says done;
    - AGENT_ERROR when the environment raises `MalformedAction`, with its message in `error`;
    - TRUNCATED with `turns` after `max_turns` steps without done; `context` when the next
      prompt leaves no room below `max_context` (each call's budget is clipped so that prompt and
      completion fit it), or a reply ends short of `max_tokens` without a stop token (it ran out
      of a clipped budget, or of the engine's longest sequence);
      `length` when a completion hits `max_tokens` without a stop token and `require_stop` holds
      (an unfinished message is not an action); `wall_clock` when `wall_clock` seconds of trio's
      clock have passed since the rollout began;
    - INFRA_ERROR when creating, resetting or stepping the environment raises (other than
      `MalformedAction`), or the verifier raises or fails to score a COMPLETED or AGENT_ERROR
      episode; `error` holds the exception's type and text.

    COMPLETED, AGENT_ERROR and TRUNCATED episodes are scored by the verifier once the episode is
    over (outside the wall-clock deadline), except an episode whose deadline struck inside a
    reset or step: its environment is still held by the abandoned thread, so it is not scored.
    The engine's own exceptions propagate: a broken engine is a broken source.

    Args:
        engine: anything with `RolloutServer.generate`'s signature.
        make_env: builds a fresh environment for each rollout (in a worker thread).
        verifier: scores a finished episode from its environment and `Episode`.
        max_turns: most engine calls (and steps) per episode.
        max_tokens: most completion tokens per call.
        max_context: most tokens of a prompt plus its completion; at most the engine's longest
            sequence, whose prompt-length error would otherwise propagate.
        wall_clock: seconds of trio's clock an episode may take; None for no limit.
        require_stop: whether a reply must end with a stop token to count as an action; when
            False, a reply that fills `max_tokens` is the action, and the template closes it.
        sampling: temperature, top-k/top-p and seed of the engine's sampling.
        tokenizer: renders the conversation and decodes the replies; the byte tokenizer unless
            given.
        stop: tokens that end a reply; the tokenizer's `eos_id` unless given.
    """

    engine: Any = attrs.field(validator=_engine)
    make_env: Callable[[], Environment] = attrs.field(validator=is_callable)
    verifier: Verifier = attrs.field(validator=is_callable)
    max_turns: int = attrs.field(kw_only=True, validator=int_at_least(1))
    max_tokens: int = attrs.field(kw_only=True, validator=int_at_least(1))
    max_context: int = attrs.field(kw_only=True, validator=int_at_least(2))
    wall_clock: float | None = attrs.field(default=None, kw_only=True, validator=optional(positive))
    require_stop: bool = attrs.field(default=True, kw_only=True)
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

    async def run(self, task: Task, label: Label) -> Session:
        """Play one episode of `task` and return its session (never raises for the episode's
        own failures; see the class)."""
        play = _Play(task)
        with trio.move_on_after(math.inf if self.wall_clock is None else self.wall_clock) as limit:
            end = await self._play(play, label)
        if limit.cancelled_caught:
            end = _End(Status.TRUNCATED, "wall_clock")
        return await self._score(play, end)

    async def _play(self, play: _Play, label: Label) -> _End:
        try:
            play.env = await play.enter(self.make_env, what="construction")
            reset = await play.enter(play.env.reset, play.task, what="reset")
            seat, observation = play.seat_of(reset)
            prompt = self._prompt(play, seat, observation)
        except Exception as error:
            return _End(Status.INFRA_ERROR, error=describe(error))
        for turn in range(self.max_turns):
            budget = min(self.max_tokens, self.max_context - len(prompt))
            if budget < 1:
                return _End(Status.TRUNCATED, "context")
            try:
                call = await self.engine.generate(
                    prompt, max_tokens=budget, stop=self.stop, **self.sampling.options(label, turn)
                )
            except CallFailed as error:
                return _End(Status.INFRA_ERROR, error=f"engine: {describe(error)}")
            if seat is not None:
                call = attrs.evolve(call, seat=seat)
            play.calls.append(call)
            completion = np.asarray(call.completion)
            if not (len(completion) and int(completion[-1]) in self.stop):
                # Short of max_tokens without a stop, the reply ran out of room: a clipped budget,
                # or the engine's own longest sequence.
                if len(completion) < self.max_tokens:
                    return _End(Status.TRUNCATED, "context")
                if self.require_stop:
                    return _End(Status.TRUNCATED, "length")
            text = reply_text(self.tokenizer, completion, self.stop)
            play.actions.append(text)
            play.messages.append({"role": "assistant", "content": text})
            play.last[seat] = (np.asarray(call.prompt, np.int32), completion)
            try:
                observation, done = await play.enter(play.env.step, text, what="step")
                if done:
                    return _End(Status.COMPLETED)
                seat, observation = play.seat_of(observation)
                prompt = self._prompt(play, seat, observation)
            except MalformedAction as error:
                return _End(Status.AGENT_ERROR, error=str(error))
            except Exception as error:
                return _End(Status.INFRA_ERROR, error=describe(error))
        return _End(Status.TRUNCATED, "turns")

    def _prompt(self, play: _Play, seat: str | None, observation: Observation) -> np.ndarray:
        """The prompt of `seat`'s next call: its last call's prompt and completion continued by
        `observation`, or a conversation that `observation` opens where it has not called yet."""
        new = messages_of(observation)
        play.messages += new
        if seat not in play.last:
            encoded = self.tokenizer.encode_chat(new, add_generation_prompt=True)
            return np.asarray(encoded, np.int32)
        prompt, completion = play.last[seat]
        following = _continuation(self.tokenizer, completion, new)
        return np.concatenate([prompt, completion, following]).astype(np.int32)

    async def _score(self, play: _Play, end: _End) -> Session:
        calls = tuple(play.calls)
        if end.status is Status.INFRA_ERROR or play.busy or play.env is None:
            return Session(end.status, calls, truncation=end.truncation, error=end.error)
        episode = Episode(
            play.task, tuple(play.messages), tuple(play.actions), end.status, end.truncation
        )
        try:
            score = await blocking(self.verifier, play.env, episode, what="the verifier")
        except Exception as error:
            return Session(Status.INFRA_ERROR, calls, error=f"verifier: {describe(error)}")
        return scored_session(calls, end.status, end.truncation, end.error, score)


def scored_session(
    calls: tuple[Call, ...],
    status: Status,
    truncation: str | None,
    error: str | None,
    score: Score | None,
) -> Session:
    """The session of a scored outcome: a verifier that cannot score a COMPLETED or AGENT_ERROR
    outcome, or answers something other than a `Score`, makes it an INFRA_ERROR."""
    if score is not None and not isinstance(score, Score):
        return Session(
            Status.INFRA_ERROR,
            calls,
            error=f"verifier returned {type(score).__name__}, not a Score or None",
        )
    if score is None:
        if status is Status.TRUNCATED:
            return Session(status, calls, truncation=truncation, error=error)
        return Session(
            Status.INFRA_ERROR, calls, error=f"verifier could not score a {status.name} rollout"
        )
    if score.seats is not None:
        acted = sorted({call.seat for call in calls if call.seat is not None})
        if not set(acted) & score.seats.keys():
            # A misspelt seat: every call would be left out of training, without a word.
            where = f"the seats that acted are {acted}" if acted else "no call has a seat"
            return Session(
                Status.INFRA_ERROR,
                calls,
                error=f"verifier scored seats {sorted(score.seats)}, but {where}: "
                "nothing of the episode would train",
            )
    return Session(
        status,
        calls,
        reward=score.reward,
        components=dict(score.components),
        truncation=truncation,
        error=error,
        seats=None if score.seats is None else dict(score.seats),
    )
