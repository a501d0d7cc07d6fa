"""What one verifiers episode comes to in dew's terms: its status, reward, reward components
and, for several traces, each trace's seat (`dew.envs.verifiers` says how each outcome is
decided).

Apart from `verifiers.py`, which loads environments and runs their episodes, because it reads
a finished `Episode` and nothing else: no gateway, no loop, no verifiers import.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

from dew.objectives.rl.sessions import Status

# verifiers' own limits (`Trace.stop_condition`) as dew's truncation reasons.
_LIMITS = {
    "max_turns": "turns",
    "max_output_tokens": "length",
    "max_input_tokens": "context",
    "max_total_tokens": "context",
    "compaction_failed": "context",
}


@attrs.frozen
class Outcome:
    """What one episode came to, in dew's terms (see the module).

    Args:
        status: COMPLETED, TRUNCATED or AGENT_ERROR.
        reward: the sum of the traces' weighted rewards.
        components: each trace's rewards and metrics by name.
        truncation: why a TRUNCATED episode stopped.
        error: the first error's type and message, for AGENT_ERROR.
        seat_of: in an episode of several traces, each trace's seat (its components' prefix:
            its agent's name, numbered where agents share one) by the trace's id, which
            verifiers sends with each of the trace's model calls (`X-Session-ID`).
        seats: in an episode of several traces, the reward of each seat whose trace recorded
            rewards (the session's `seats`); None for a lone trace.
    """

    status: Status
    reward: float
    components: Mapping[str, float]
    truncation: str | None = None
    error: str | None = None
    seat_of: Mapping[str, str] = attrs.field(factory=dict)
    seats: Mapping[str, float] | None = None


# verifiers' text for an exception its task's rubric raised (`Task.score`'s boundary).
SCORING = re.compile(r"TaskError: task \w+ scoring: ")


def _error_text(error: Any) -> str:
    return f"{error.type}: {error.message}"


def _agent(trace: Any) -> str:
    return trace.agent.name if trace.agent and trace.agent.name else "trace"


def _prefixes(names: tuple[str, ...]) -> list[str]:
    """Each trace's components' prefix, from the traces' agents' names: none for a lone trace,
    else its agent's name, numbered where several traces share it (best-of-n's attempts:
    `agent.0/`, `agent.1/`)."""
    if len(names) == 1:
        return [""]
    counts, seen, prefixes = collections.Counter(names), collections.Counter(), []
    for name in names:
        prefixes.append(f"{name}/" if counts[name] == 1 else f"{name}.{seen[name]}/")
        seen[name] += 1
    return prefixes


def outcome(episode: Any) -> Outcome:
    """A verifiers `Episode`'s status, reward, components and, for several traces, seats (see
    the module)."""
    components: dict[str, float] = {}
    prefixes = _prefixes(tuple(map(_agent, episode.traces)))
    scored = [_trace_reward(t, p) for t, p in zip(episode.traces, prefixes, strict=True)]
    rewards = [reward for reward, _ in scored]
    seats = _seats(episode.traces, prefixes, rewards)
    for trace, prefix in zip(episode.traces, prefixes, strict=True):
        for name, reward in trace.rewards.items():
            if reward is not None and math.isfinite(reward.score):
                components[f"{prefix}{name}"] = reward.score
        for name, value in trace.metrics.items():
            if value is not None and math.isfinite(value):
                components[f"{prefix}metric/{name}"] = float(value)
    reward = math.fsum(rewards)
    errors = [_error_text(e) for e in episode.errors]
    errors += [_error_text(e) for trace in episode.traces for e in trace.errors]
    errors += [f"ValueError: {why}" for _, why in scored if why is not None]
    if errors and SCORING.match(errors[0]):
        return Outcome(Status.INFRA_ERROR, 0.0, components, error=errors[0])
    if errors:
        return Outcome(Status.AGENT_ERROR, reward, components, error=errors[0], **seats)
    for trace in episode.traces:
        if trace.stop_condition in _LIMITS:
            limit = _LIMITS[trace.stop_condition]
            return Outcome(Status.TRUNCATED, reward, components, limit, **seats)
        if trace.is_timeout:
            return Outcome(Status.TRUNCATED, reward, components, "wall_clock", **seats)
        if trace.is_truncated:  # the last reply ran out of its token budget
            return Outcome(Status.TRUNCATED, reward, components, "length", **seats)
    if episode.is_timeout:
        return Outcome(Status.TRUNCATED, reward, components, "wall_clock", **seats)
    return Outcome(Status.COMPLETED, reward, components, **seats)


def _trace_reward(trace: Any, prefix: str) -> tuple[float, str | None]:
    """A trace's reward, the weighted sum of its rewards, and None; or, where a reward or
    their sum is not a finite number (a reward function that returned nan or inf), 0 (as
    verifiers scores a trace whose scoring raised) and what was not finite, which makes the
    episode an AGENT_ERROR rather than a reward of 0 that nothing reports."""
    for name, reward in trace.rewards.items():
        if reward is not None and not math.isfinite(reward.value):
            return 0.0, (
                f"reward {prefix + name!r} scored {reward.score!r} at weight "
                f"{reward.weight!r}, not a finite number: the trace is scored 0"
            )
    if not math.isfinite(trace.reward):
        why = f"{prefix}rewards sum to {trace.reward!r}, not a finite number"
        return 0.0, f"{why}: the trace is scored 0"
    return float(trace.reward), None


def _seats(traces: list[Any], prefixes: list[str], rewards: list[float]) -> dict[str, Any]:
    """For an episode of several traces, `Outcome`'s `seat_of` (each trace's seat, its
    components' prefix, by its id) and `seats` (the reward of each seat whose trace recorded
    rewards, `rewards` by trace); nothing for one."""
    if len(traces) < 2:
        return {}
    names = [prefix.removesuffix("/") for prefix in prefixes]
    seat_of = {trace.id: seat for trace, seat in zip(traces, names, strict=True)}
    seats = {
        seat: reward
        for trace, seat, reward in zip(traces, names, rewards, strict=True)
        if trace.rewards
    }
    return {"seat_of": seat_of, "seats": seats}
