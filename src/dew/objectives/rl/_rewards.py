"""What a complete group trains on: its rollouts' training rewards and their advantages.

A group's advantages are relative to each other (GRPO's baseline is the group's own mean), so
they are computed a group at a time: over the rollouts whose status carries loss weight under
the truncation policy, with the reward that policy gives each, and, for an episode that rewards
its agents apart (`Session.seats`), over each seat's pool across the group. `uniform_group`
says when a group carries no signal at all (the scheduler's `filter_uniform`).

`_packing` lays the advantages into rows; the scheduler's admission asks `uniform_group`. Built
on `_session` alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from dew.objectives.rl._session import Session, Status, _fail

# A seat named NAME.K: one of several traces of agent NAME in one episode (see `_pool_of`).
_NUMBERED = re.compile(r"(.+)\.\d+")
_EPSILON = 1e-6  # keeps GRPO's division finite for a group with a tiny reward spread


def _training_statuses(truncation: str) -> frozenset[Status]:
    """The statuses that carry loss weight under a truncation policy."""
    if truncation == "mask":
        return frozenset((Status.COMPLETED, Status.AGENT_ERROR))
    return frozenset((Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED))


def _training_reward(session: Session, truncation: str) -> float:
    """The reward a training session trains on under a truncation policy.

    Raises:
        SessionError: a TRUNCATED session without a reward under `score`.
    """
    if session.status is Status.TRUNCATED and truncation == "zero":
        return 0.0
    if session.reward is None:
        raise _fail(
            session,
            "reward",
            f"is missing on a {session.status.name} session under truncation={truncation!r} "
            "(the scheduler resubmits those as unscored before packing)",
        )
    return float(session.reward)


def uniform_group(group: Sequence[Session], truncation: str) -> bool:
    """Whether a complete group carries no signal: its training rollouts' rewards (as
    `truncation` makes them) are all equal, or fewer than two of them train. Every advantage
    `pack` gives such a group is 0, under every estimator.

    Args:
        group: finished sessions of statuses `pack` takes; a TRUNCATED one under `score` has a
            reward (the scheduler resubmits those without as unscored).
        truncation: the truncation policy.
    """
    trains = _training_statuses(truncation)
    training = [s for s in group if s.status in trains]
    rewards = {_training_reward(s, truncation) for s in training}
    on_rewards = any(_trains_on_reward(s) for s in training)
    pools = _seat_pools(training, truncation)
    return (len(rewards) <= 1 or not on_rewards) and all(
        len(set(pool.values())) <= 1 for pool in pools.values()
    )


def _trains_on_reward(session: Session) -> bool:
    """Whether some chain of a training session trains on the session's reward: it has no
    seats, or a call of no seat (a chain's calls share their seat)."""
    return session.seats is None or any(call.seat is None for call in session.calls)


def _seat_reward(session: Session, seat: str, truncation: str) -> float:
    """A seat's reward as a training session trains on it under a truncation policy."""
    if session.status is Status.TRUNCATED and truncation == "zero":
        return 0.0
    return float(session.seats[seat])


def _pool_of(seat: str) -> tuple[str, bool]:
    """The pool a seat's baseline is taken over: the seat's own, or for a seat numbered
    `NAME.K` (one of several traces one agent made in an episode, such as best-of-n's
    attempts), NAME's, shared by all of them and apart from a seat named NAME itself."""
    numbered = _NUMBERED.fullmatch(seat)
    return (seat, False) if numbered is None else (numbered[1], True)


def _seat_pools(
    training: Sequence[Session], truncation: str
) -> dict[tuple[str, bool], dict[tuple[int, str], float]]:
    """Each pool's rewards over a group's training sessions, by (the session's index among
    them, the seat): what a seat's baseline is taken over (see `_pool_of`)."""
    pools: dict[tuple[str, bool], dict[tuple[int, str], float]] = {}
    for i, session in enumerate(training):
        for seat in session.seats or ():
            pools.setdefault(_pool_of(seat), {})[i, seat] = _seat_reward(session, seat, truncation)
    return pools


def _seat_advantages(
    training: Sequence[Session], truncation: str, estimator: str
) -> list[dict[str, float] | None]:
    """Per training session, each of its seats' advantage within the seat's pool over the
    group (`Session.seats`), or None for a session without seats."""
    seated: list[dict[str, float] | None] = [None if s.seats is None else {} for s in training]
    for pool in _seat_pools(training, truncation).values():
        advantages = _advantages(list(pool.values()), [len(pool)], estimator)
        for (i, seat), advantage in zip(pool, advantages.tolist(), strict=True):
            seated[i][seat] = advantage
    return seated


def _advantages(rewards: list[float], sizes: list[int], estimator: str) -> np.ndarray:
    """Per-rollout advantages of every group's training rewards at once.

    Groups of one size are the rows of one `[groups, size]` array: a row's reductions run over
    it exactly as over a lone group's array, so each advantage is bit for bit what the group's
    own formula gives, for a handful of numpy calls per step rather than per group.

    Args:
        rewards: float[n] the groups' training rewards, group after group.
        sizes: how many of them each group has.

    Returns:
        float64[n] the advantages, in the order of `rewards`.
    """
    flat = np.array(rewards, np.float64)
    if estimator == "batch":
        # Centred in each group, scaled by the spread of the whole batch (TRL's scale_rewards
        # "batch"): a group whose rewards barely differ keeps small advantages, where its own
        # std would blow them up to the size of a decisive group's.
        spread = flat.std() if flat.size else 0.0  # no training reward: nothing to scale
        return _advantages(rewards, sizes, "mean") / (spread + _EPSILON)
    if len(set(sizes)) == 1 and sizes[0] >= 2:
        # The common case, every group of one size: one array of them, no indexing.
        return _group_advantages(flat.reshape(len(sizes), sizes[0]), estimator).reshape(-1)
    advantages = np.zeros_like(flat)
    counts = np.array(sizes, np.intp)
    starts = np.cumsum(counts) - counts
    # A lone training rollout has no baseline: it keeps advantage 0.
    for size in np.unique(counts[counts >= 2]):
        at = starts[counts == size][:, None] + np.arange(size)
        advantages[at] = _group_advantages(flat[at], estimator)
    return advantages


def _group_advantages(rewards: np.ndarray, estimator: str) -> np.ndarray:
    """Advantages within groups of one size >= 2: float64[groups, size] -> float64[groups, size]."""
    size = rewards.shape[1]
    if estimator == "rloo":
        advantages = rewards - (rewards.sum(axis=1, keepdims=True) - rewards) / (size - 1)
    else:
        advantages = rewards - rewards.mean(axis=1, keepdims=True)
        if estimator == "group":
            advantages = advantages / (rewards.std(axis=1, keepdims=True) + _EPSILON)
    # A group whose rollouts all scored alike says nothing about which did better; exact zeros
    # keep rounding in the mean from turning into a spurious signal.
    alike = np.ptp(rewards, axis=1, keepdims=True) == 0
    return np.where(alike, 0.0, advantages)
