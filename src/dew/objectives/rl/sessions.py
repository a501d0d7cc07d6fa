"""Sessions: what a source returns for one rollout, checked, and cut into chains to train on.

A `Session` is one rollout of one task: its status, the model calls it made, and the verifier's
reward. The scheduler stamps it with its task and `Label` (group, sample, attempt). Consecutive
calls whose prompt extends the previous chain's tokens merge into one *chain*, a single token
sequence to train on; only completion tokens are trained, prompt and environment tokens are
context.

Truncation policies (`TRUNCATION`), for a TRUNCATED session:
- `mask`: zero loss weight, and it leaves its group's baseline (agentic context, turn and
  wall-clock limits);
- `score`: trains on its verifier reward (single-turn RLVR); one without a reward is resubmitted
  by the scheduler as `unscored`;
- `zero`: trains with reward 0 (a length penalty).
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs
import numpy as np

from dew.data import Task

ESTIMATORS = ("group", "mean", "rloo")
TRUNCATION = ("mask", "score", "zero")
TRUNCATION_REASONS = ("length", "turns", "context", "wall_clock")


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
    """

    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    version: int
    support: tuple[np.ndarray, ...] | None = None


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
        )

    @property
    def min_version(self) -> int | None:
        """The version of its oldest call: a rollout is as stale as its oldest call."""
        return min([call.version for call in self.calls]) if self.calls else None

    @property
    def tokens(self) -> int:
        """Completion tokens over all its calls: what the engine sampled for it."""
        return sum(len(call.completion) for call in self.calls)


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
_NUMBER = (float, int, np.floating)


# A numpy reduction costs about a microsecond to call, whatever the length; a short array's
# extremes come sooner from its values as a list. Sessions of tiny calls would otherwise spend
# most of their check here.
_SHORT = 32


def _least(array: np.ndarray):
    """The smallest value of a non-empty array."""
    return min(array.tolist()) if len(array) <= _SHORT else array.min()


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


def _tokens_problem(array) -> str | None:
    """What is wrong with an array of token ids, or None."""
    if type(array) is not np.ndarray or array.ndim != 1 or array.dtype != np.int32:
        described = (
            f"{array.dtype}[{','.join(map(str, array.shape))}]"
            if isinstance(array, np.ndarray)
            else type(array).__name__
        )
        return f"must be a 1-D int32 array, got {described}"
    if array.size and (least := _least(array)) < 0:
        return f"holds a negative token id {int(least)}"
    return None


def _call_problem(call: Call) -> tuple[str, str] | None:
    """The field of a call that is wrong and what is wrong with it, or None.

    Field names are built only for a problem: every call of every session passes here.
    """
    if (problem := _tokens_problem(call.prompt)) is not None:
        return "prompt", problem
    if (problem := _tokens_problem(call.completion)) is not None:
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
        if (problem := _tokens_problem(kept)) is not None:
            return f"support[{j}]", problem
        if token not in kept:
            return f"support[{j}]", f"lacks sampled token {token}"
    return None


def check_session(session: Session) -> Session:
    """Check that a stamped session keeps the source contract, and return it.

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
        if (found := _call_problem(call)) is not None:
            field, problem = found
            raise _fail(session, f"calls[{i}].{field}", problem)
    if session.reward is not None and not (
        isinstance(session.reward, _NUMBER) and math.isfinite(session.reward)
    ):
        raise _fail(session, "reward", f"must be a finite number, got {session.reward!r}")
    scored = session.status in (Status.COMPLETED, Status.AGENT_ERROR)
    if scored and session.reward is None:
        raise _fail(session, "reward", f"is missing on a {session.status.name} session")
    for name, value in session.components.items():
        if not isinstance(value, _NUMBER) or not math.isfinite(value):
            raise _fail(session, f"components[{name!r}]", f"must be a finite number, got {value!r}")
    if session.status is Status.TRUNCATED and session.truncation not in TRUNCATION_REASONS:
        raise _fail(
            session,
            "truncation",
            f"must be one of {TRUNCATION_REASONS} on a TRUNCATED session, "
            f"got {session.truncation!r}",
        )
    return session


@attrs.frozen(eq=False)
class Chain:
    """One token sequence to train on: merged calls of a session.

    Args:
        tokens: int32[L] context and completion tokens in order.
        trained: bool[L], True at completion tokens.
        logprobs: float32[L] behaviour log-probs, 0 where not trained.
        versions: int32[L] the served version of each completion token's call, -1 elsewhere.
        support: per position, the kept token ids where the call carried support, else None.
        calls: how many calls merged into it.
    """

    tokens: np.ndarray
    trained: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    support: tuple[np.ndarray | None, ...] | None
    calls: int

    def __len__(self) -> int:
        return len(self.tokens)


# One chain as its parts: per merged call, the context it adds to the chain and the call.
_Run = tuple[tuple[np.ndarray, Call], ...]

_RUNS: weakref.WeakKeyDictionary[Session, tuple[_Run, ...]] = weakref.WeakKeyDictionary()
_CHAINS: weakref.WeakKeyDictionary[Session, tuple[Chain, ...]] = weakref.WeakKeyDictionary()


def chains(session: Session) -> tuple[Chain, ...]:
    """Cut a session's calls into chains: a call whose prompt extends the previous chain's tokens
    (its prompt plus completion) merges into it; any other call starts a new chain.

    Sessions are frozen, so each one's chains are cut once and shared: treat them as read-only.
    """
    built = _CHAINS.get(session)
    if built is None:
        built = _CHAINS[session] = tuple(map(_chain, _runs(session)))
    return built


def _runs(session: Session) -> tuple[_Run, ...]:
    """A session's chains as their parts, cut once per session and shared (read-only).

    The cut without the chains' token arrays: `pack` and `merge_ratio` need only which calls
    merge and where each call's tokens fall, and building arrays per chain would cost them more
    than everything else they do with a small chain.
    """
    calls = session.calls
    if len(calls) == 1:
        # Most sessions are one call, one chain: describing it again costs less than the cache.
        return (((calls[0].prompt, calls[0]),),)
    runs = _RUNS.get(session)
    if runs is None:
        runs = _RUNS[session] = _cut(calls)
    return runs


def _cut(calls: Sequence[Call]) -> tuple[_Run, ...]:
    """The chains of calls in order, each as its parts (see `chains` for when calls merge)."""
    runs: list[list[tuple[np.ndarray, Call]]] = []
    before = None
    for call in calls:
        if before is not None and _extends(call.prompt, before):
            runs[-1].append((call.prompt[len(before.prompt) + len(before.completion) :], call))
        else:
            runs.append([(call.prompt, call)])
        before = call
    return tuple(map(tuple, runs))


def _extends(prompt: np.ndarray, before: Call) -> bool:
    """Whether a prompt starts with the call before's prompt and completion: the chain so far,
    compared in place rather than concatenated."""
    p, c = len(before.prompt), len(before.completion)
    return (
        len(prompt) >= p + c
        and bool((prompt[:p] == before.prompt).all())
        and bool((prompt[p : p + c] == before.completion).all())
    )


def _chain(run: _Run) -> Chain:
    length = sum(len(context) + len(call.completion) for context, call in run)
    tokens = np.empty(length, np.int32)
    trained = np.zeros(length, bool)
    logprobs = np.zeros(length, np.float32)
    versions = np.full(length, -1, np.int32)
    support: list[np.ndarray | None] | None = None
    if any(call.support is not None for _, call in run):
        support = [None] * length
    at = 0
    for context, call in run:
        start, at = at + len(context), at + len(context) + len(call.completion)
        tokens[start - len(context) : start] = context
        tokens[start:at] = call.completion
        trained[start:at] = True
        logprobs[start:at] = call.logprobs
        versions[start:at] = call.version
        if support is not None and call.support is not None:
            support[start:at] = call.support
    return Chain(
        tokens=tokens,
        trained=trained,
        logprobs=logprobs,
        versions=versions,
        support=None if support is None else tuple(support),
        calls=len(run),
    )


def merge_ratio(sessions: Sequence[Session]) -> float:
    """Merged calls / calls over the sessions: 1 - chains / calls (0 when there are no calls)."""
    calls = sum(len(s.calls) for s in sessions)
    if calls == 0:
        return 0.0
    return 1.0 - sum(len(_runs(s)) for s in sessions) / calls


from dew.objectives.rl._packing import Cut, Packed, pack, session_metrics  # noqa: E402, F401
