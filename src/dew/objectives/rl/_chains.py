"""Cutting a session's calls into chains, the token sequences it trains on.

Public through `dew.objectives.rl.sessions`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import attrs
import numpy as np

from dew.objectives.rl._session import Call, Session


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
    """Cut a session's calls into chains: a call whose prompt extends a chain's tokens so far (its
    last call's prompt plus completion) merges into it, the latest such chain of the call's
    seat; any other call starts a new chain. A session whose calls interleave several
    conversations (the seats of a self-play game, an agent's threads) so keeps a chain per
    conversation; a chain holds one seat's calls (they train on its reward), even where two
    seats' conversations run token for token alike.

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
    """The chains of calls, in the order of their first calls, each as its parts (see `chains`
    for when calls merge)."""
    runs: list[list[tuple[np.ndarray, Call]]] = []
    for call in calls:
        for run in reversed(runs):
            before = run[-1][1]
            if before.seat == call.seat and _extends(call.prompt, before):
                run.append((call.prompt[len(before.prompt) + len(before.completion) :], call))
                break
        else:
            runs.append([(call.prompt, call)])
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
