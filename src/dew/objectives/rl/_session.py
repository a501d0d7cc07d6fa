"""Session values and their check: what a source returns for one rollout, and its contract.

Public through `dew.objectives.rl.sessions`; the leaf of the sessions modules (`_chains` and
`_packing` import it, it imports neither).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import enum
import math
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
import trio

from dew.data import Task

ESTIMATORS = ("group", "batch", "mean", "rloo")
"""The advantage families `pack` computes over a group (see `pack`): the group's mean as the
baseline, scaled by the group's reward std, by the batch's, or not at all; or leave-one-out."""
TRUNCATION = ("mask", "score", "zero")
"""What a TRUNCATED session can train on (see the module docstring)."""
TRUNCATION_REASONS = ("length", "turns", "context", "wall_clock")
"""Why a TRUNCATED session stopped: its `truncation`."""


class Status(enum.Enum):
    """How a session ended. Only COMPLETED, AGENT_ERROR and TRUNCATED were scored."""

    COMPLETED = "completed"
    AGENT_ERROR = "agent_error"
    TRUNCATED = "truncated"
    INFRA_ERROR = "infra_error"
    CANCELLED = "cancelled"


class SessionError(ValueError):
    """A session that breaks the source contract; the message names task, label and field."""


@attrs.frozen
class Label:
    """Where a rollout belongs: the scheduler's group id, its sample in the group, its attempt."""

    group: int
    sample: int
    attempt: int

    def __str__(self) -> str:
        return f"group {self.group} sample {self.sample} attempt {self.attempt}"


@attrs.frozen(eq=False)
class Call:
    """One model call as the engine served it.

    Args:
        prompt: int32[P] token ids the engine saw.
        completion: int32[C] sampled token ids.
        logprobs: float32[C] behaviour log-prob of each completion token, under the distribution
            it was really drawn from.
        version: the weights version the engine served at the call's start.
        support: where a filtered sampler (top-k/top-p) drew the token, the token ids it kept at
            each completion position: C int32 arrays.
        top_logprobs: where the caller asked the engine for them, each completion position's
            most likely token ids and their log-probs under the distribution the token was
            drawn from, most likely first: C pairs of int32[n] and float32[n]. Reported to the
            caller (the gateway's `top_logprobs`); neither checked, trained on nor traced.
        seat: in an episode of several agents whose session gives each its own reward
            (`Session.seats`), the agent that made the call; None otherwise.
    """

    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    version: int
    support: tuple[np.ndarray, ...] | None = None
    top_logprobs: tuple[tuple[np.ndarray, np.ndarray], ...] | None = None
    seat: str | None = None


@attrs.frozen(eq=False)
class Session:
    """One rollout of one task, as a source returns it and the scheduler stamps it.

    Args:
        status: how it ended.
        calls: the model calls it made, in order.
        reward: the verifier's reward; required for COMPLETED and AGENT_ERROR.
        components: named parts of the reward.
        truncation: why a TRUNCATED session stopped (one of TRUNCATION_REASONS).
        error: what went wrong, for the error statuses.
        task, label: stamped by the scheduler.
        submitted, finished: the scheduler's clock at submission and at finish, stamped by it.
        seats: in an episode of several agents, each agent's own reward by its seat (the
            calls' `seat`): a call of a seat named here trains on that reward, with a baseline
            over the same seat of its group's other sessions; a call of a seat not named here
            (an agent with no reward of its own, such as a judge) trains on nothing; a call
            of no seat trains on `reward`, as every call does where seats is None. A seat
            named here that made no call (a player whose game ended before its turn) trains
            nothing, but its reward counts in its seat's baseline. Seats named `NAME.0`,
            `NAME.1`, ... (several traces of one agent, such as best-of-n's attempts) share
            one baseline, over all of them in the group (a seat named `NAME` keeps its own).
            `check_session` refuses, as misspelt, the seats of a session that can train
            (COMPLETED, AGENT_ERROR, TRUNCATED) that both name a seat that made no call and
            leave out a seat that made calls (`{"player.0": 1.0, "player1": 0.0}` where
            `player.0` and `player.1` played), or that name seats where calls were made but
            none has a seat.
    """

    status: Status
    calls: tuple[Call, ...] = attrs.field(default=(), converter=tuple)
    reward: float | None = None
    components: Mapping[str, float] = attrs.field(factory=dict)
    truncation: str | None = None
    error: str | None = None
    task: Task | None = None
    label: Label | None = None
    submitted: float | None = None
    finished: float | None = None
    seats: Mapping[str, float] | None = None

    def stamped(self, task: Task, label: Label, submitted: float, finished: float) -> Session:
        """This session labelled by the scheduler (attrs.evolve without its reflection: the
        scheduler stamps every session)."""
        return Session(
            self.status,
            self.calls,
            self.reward,
            self.components,
            self.truncation,
            self.error,
            task,
            label,
            submitted,
            finished,
            self.seats,
        )

    @property
    def min_version(self) -> int | None:
        """The version of its oldest call: a rollout is as stale as its oldest call."""
        return min([call.version for call in self.calls]) if self.calls else None

    @property
    def tokens(self) -> int:
        """Completion tokens over all its calls: what the engine sampled for it."""
        return sum(len(call.completion) for call in self.calls)


@attrs.define(eq=False)
class Progress:
    """How far a rollout got: tokens sampled by its finished calls, calls begun, the tokens of
    the call being sampled (a list the engine grows), None between calls, what it waits on now
    (`waiting_on`), and its oldest call's version with the time that call started, once an
    engine has said so (`note_progress(version=...)`): the version its lag counts from while it
    still runs."""

    tokens: int = 0
    calls: int = 0
    sampling: Sized | None = None
    waiting: str | None = None
    oldest: tuple[float, int] | None = None  # (time, version) of its oldest call's start
    # When the scheduler let it start, where it held it queued for a slot (align_starts): its
    # source runs from then, not from its submission. None: it started at its submission.
    released: float | None = None

    def length(self) -> tuple[int, int]:
        """Its tokens and calls so far: a cancelled rollout's lower bounds."""
        live = 0 if self.sampling is None else len(self.sampling)
        return self.tokens + live, self.calls

    def doing(self) -> str:
        """What the rollout waits on now, as a long wait names it: the engine while a call of
        it samples, what `waiting_on` says, or its source's own code."""
        if self.waiting is not None:
            return self.waiting
        return "the engine" if self.sampling is not None else "its source's own code"


# The rollout running in a trio task. The scheduler gives each rollout's task its own; an
# engine adds to it as it samples.
_PROGRESS: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "dew_rollout_progress", default=None
)


def note_progress(
    tokens: int = 0,
    *,
    calls: int = 0,
    sampling: Sized | None = None,
    version: int | None = None,
) -> None:
    """Count, for the rollout running in this trio task, tokens its finished calls sampled and
    calls begun, and say which call samples now (`sampling`, its growing tokens; None once no
    call does).

    An engine calls it as it samples (dew's RolloutServer and SimulatedSource do), so that a
    rollout the scheduler cancels still says how far it got: the lower bounds of its length
    that the record's selection-bias figures take. An engine that also passes `version`, the
    weights version a call starts under, as the call starts (the simulated engine does, once
    the call has its slot), lets the scheduler count a running rollout's lag from its oldest
    call, as it counts a finished one's, rather than from its submission: a rollout queued
    through a push is not cancelled as stale before its calls are. It sets nothing else
    (`sampling` stays as it was). Outside a scheduler's rollout it does nothing.
    """
    progress = _PROGRESS.get()
    if progress is None:
        return
    if version is not None:
        if progress.oldest is None or version < progress.oldest[1]:
            progress.oldest = (trio.current_time(), version)
        return
    progress.tokens += tokens
    progress.calls += calls
    progress.sampling = sampling


def oldest_call() -> tuple[float, int] | None:
    """The rollout running in this trio task: when its oldest call started and its version,
    as its engine said (note_progress), or None (no call yet, an engine that does not say, or
    outside a scheduler's rollout). A trace records it, so that its replay says it alike."""
    progress = _PROGRESS.get()
    return None if progress is None else progress.oldest


def released_at() -> float | None:
    """The rollout running in this trio task: when the scheduler let it start, where it held
    it queued for a slot (align_starts), or None. A trace records it, so that its replay starts
    the rollout's recorded run then."""
    progress = _PROGRESS.get()
    return None if progress is None else progress.released


@contextlib.contextmanager
def waiting_on(what: str) -> Iterator[None]:
    """Say, for the rollout running in this trio task, that it waits on `what` in the block
    ("the engine", "the environment's step"), so that a trainer's long wait names where its
    rollouts are rather than guessing. Outside a scheduler's rollout it does nothing."""
    progress = _PROGRESS.get()
    if progress is None:
        yield
        return
    before, progress.waiting = progress.waiting, what
    try:
        yield
    finally:
        progress.waiting = before


def waits(progress: Iterable[Progress]) -> str:
    """What rollouts in flight wait on, most first: `3 on the engine, 1 on the environment's
    step`, or `none` for no rollout."""
    counts = collections.Counter(rollout.doing() for rollout in progress)
    return ", ".join(f"{n} on {what}" for what, n in counts.most_common()) or "none"


def track_progress() -> Progress:
    """A fresh Progress for the rollout this trio task runs (see note_progress)."""
    progress = Progress()
    _PROGRESS.set(progress)
    return progress


@runtime_checkable
class SessionSource(Protocol):
    """Runs one rollout of a task. It returns a Session for every outcome it can classify;
    raising means the source is broken."""

    async def run(self, task: Task, label: Label) -> Session:
        """Run one rollout of `task`, labelled `label`, and return how it went."""
        ...


def _fail(session: Session, field: str, problem: str) -> SessionError:
    task = session.task.name if session.task is not None else "?"
    return SessionError(f"task {task!r} {session.label or 'unlabelled'}: {field} {problem}")


# Checked on every session a source returns: the tuples are built once.
_INTEGER = (int, np.integer)
_NUMBER = (float, int, np.floating, np.integer, np.bool_)
# The statuses a session can train under (some truncation policy trains TRUNCATED).
_TRAINABLE = (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)


def _finite(value) -> bool:
    """Whether a reward (the session's, a component or a seat's) is a finite number: a float,
    an int (a bool is one) or numpy's scalar of any of these, that a float holds."""
    if not isinstance(value, _NUMBER):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range
        return False


def _seats_problem(calls: tuple[Call, ...], seats: Mapping[str, float]) -> str | None:
    """What makes a session's `seats` read as misspelt, or None.

    A seat named in `seats` that made no call is a player whose game ended before its turn,
    and a seat that made calls without a reward is an agent with none of its own (a judge):
    either alone is meant. Both at once are a misspelling (`{"player.0": 1, "player1": 0}`
    for the seats `player.0` and `player.1`): the misspelt seat's calls would train on
    nothing, and the reward meant for them on no call. So are seats where calls were made but
    none has a seat: every call would train on the session's reward, no seat on its own.

    Args:
        calls: the session's calls, each `seat` a str or None.
        seats: the session's seats, keyed by str.

    Returns:
        the problem, naming the keys of `seats` no call has for its seat, the seats of calls
        that have no reward, and every seat a call has; None where there is none.
    """
    acted = sorted({call.seat for call in calls if call.seat is not None})
    stray = sorted(seats.keys() - acted)
    if stray and calls and not acted:
        return f"name {stray}, but no call has a seat: every call would train on the reward"
    unrewarded = [seat for seat in acted if seat not in seats]
    if stray and unrewarded:
        return (
            f"name {stray}, which made no call, while {unrewarded} made calls without a reward "
            f"(the seats that acted are {acted}): a misspelt seat would train on nothing"
        )
    return None


# A numpy reduction costs about a microsecond to call, whatever the length; a short array's
# extremes come sooner from its values as a list. Sessions of tiny calls would otherwise spend
# most of their check here.
_SHORT = 32


def _least(array: np.ndarray):
    """The smallest value of a non-empty array."""
    return min(array.tolist()) if len(array) <= _SHORT else array.min()


def _greatest(array: np.ndarray):
    """The largest value of a non-empty array."""
    return max(array.tolist()) if len(array) <= _SHORT else array.max()


def _logprobs_problem(logprobs: np.ndarray) -> str | None:
    """What is wrong with a non-empty array of log-probs, or None."""
    if len(logprobs) <= _SHORT:
        values = logprobs.tolist()
        total, greatest = sum(values), max(values)
    else:
        total, greatest = logprobs.sum(), logprobs.max()
    # A sum is finite exactly when every term is (log-probs are far from overflow).
    if not math.isfinite(total):
        return "holds a non-finite log-prob"
    if greatest > 0:
        return f"holds a positive log-prob {greatest}"
    return None


def _tokens_problem(array, vocab: int | None) -> str | None:
    """What is wrong with an array of token ids (outside [0, vocab) when vocab is given), or
    None."""
    if type(array) is not np.ndarray or array.ndim != 1 or array.dtype != np.int32:
        described = (
            f"{array.dtype}[{','.join(map(str, array.shape))}]"
            if isinstance(array, np.ndarray)
            else type(array).__name__
        )
        return f"must be a 1-D int32 array, got {described}"
    if array.size and (least := _least(array)) < 0:
        return f"holds a negative token id {int(least)}"
    if vocab is not None and array.size and (greatest := _greatest(array)) >= vocab:
        return f"holds a token id {int(greatest)} outside the vocabulary of {vocab}"
    return None


def _call_problem(call: Call, vocab: int | None) -> tuple[str, str] | None:
    """The field of a call that is wrong and what is wrong with it, or None.

    Field names are built only for a problem: every call of every session passes here.
    """
    if (problem := _tokens_problem(call.prompt, vocab)) is not None:
        return "prompt", problem
    if (problem := _tokens_problem(call.completion, vocab)) is not None:
        return "completion", problem
    lp = call.logprobs
    if type(lp) is not np.ndarray or lp.ndim != 1 or lp.dtype != np.float32:
        return "logprobs", "must be a 1-D float32 array"
    if len(lp) != len(call.completion):
        return "logprobs", f"has {len(lp)} entries for {len(call.completion)} completion tokens"
    if lp.size and (problem := _logprobs_problem(lp)) is not None:
        return "logprobs", problem
    if isinstance(call.version, bool) or not isinstance(call.version, _INTEGER):
        return "version", f"must be an int, got {call.version!r}"
    if call.version < 0:
        return "version", f"must be >= 0, got {call.version}"
    if call.support is None:
        return None
    if len(call.support) != len(call.completion):
        return "support", f"has {len(call.support)} positions for {len(call.completion)} tokens"
    for j, (kept, token) in enumerate(zip(call.support, call.completion, strict=True)):
        if (problem := _tokens_problem(kept, vocab)) is not None:
            return f"support[{j}]", problem
        if token not in kept:
            return f"support[{j}]", f"lacks sampled token {token}"
    return None


def check_session(session: Session, *, vocab: int | None = None) -> Session:
    """Check that a stamped session keeps the source contract, and return it.

    Args:
        session: what a source returned, stamped with its task and label.
        vocab: the model's vocabulary size: every token id must be below it, since the
            rescoring would turn a larger one into a NaN log-prob. None checks only that ids
            are not negative.

    Raises:
        SessionError: naming the session's task, label and the field that is wrong.
    """
    if not isinstance(session, Session):
        raise SessionError(f"a source returned {type(session).__name__}, not a Session")
    if not isinstance(session.status, Status):
        raise _fail(session, "status", f"is unknown: {session.status!r}")
    for i, call in enumerate(session.calls):
        if not isinstance(call, Call):
            raise _fail(session, f"calls[{i}]", f"is a {type(call).__name__}, not a Call")
        if (found := _call_problem(call, vocab)) is not None:
            field, problem = found
            raise _fail(session, f"calls[{i}].{field}", problem)
    if session.reward is not None and not _finite(session.reward):
        raise _fail(session, "reward", f"must be a finite number, got {session.reward!r}")
    scored = session.status in (Status.COMPLETED, Status.AGENT_ERROR)
    if scored and session.reward is None:
        raise _fail(session, "reward", f"is missing on a {session.status.name} session")
    for name, value in session.components.items():
        if not _finite(value):
            raise _fail(session, f"components[{name!r}]", f"must be a finite number, got {value!r}")
    for i, call in enumerate(session.calls):
        if call.seat is not None and not isinstance(call.seat, str):
            raise _fail(session, f"calls[{i}].seat", f"must be a str or None, got {call.seat!r}")
    if session.seats is not None:
        if not isinstance(session.seats, Mapping):
            raise _fail(session, "seats", f"must be a mapping or None, got {session.seats!r}")
        for name, value in session.seats.items():
            if not isinstance(name, str) or not isinstance(value, _NUMBER):
                raise _fail(session, "seats", f"must map str to a number, got {name!r}: {value!r}")
            if not _finite(value):
                raise _fail(session, f"seats[{name!r}]", f"must be a finite number, got {value!r}")
        if session.status in _TRAINABLE:
            if (problem := _seats_problem(session.calls, session.seats)) is not None:
                raise _fail(session, "seats", problem)
    if session.error is not None and not isinstance(session.error, str):
        raise _fail(session, "error", f"must be a str or None, got {type(session.error).__name__}")
    if session.status is Status.TRUNCATED and session.truncation not in TRUNCATION_REASONS:
        raise _fail(
            session,
            "truncation",
            f"must be one of {TRUNCATION_REASONS} on a TRUNCATED session, "
            f"got {session.truncation!r}",
        )
    return session
