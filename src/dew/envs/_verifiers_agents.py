"""How many chains an episode of a verifiers environment makes, known before any episode runs.

Each trace of an episode (an agent's run) is a chain of its own, and a run's packed rows must
hold every chain of a batch's rollouts: sized for one chain a rollout, an environment of two
agents had half of its groups cut every step. TextArena's self-play counts its players; here
the environment's config names its agents (a field per role), and verifiers' best-of-n runs its
one agent `n` times.
"""

from __future__ import annotations

from typing import Any


def traces_per_episode(env: Any) -> int:
    """The traces an episode of `env` (a `verifiers.v1.Env`) makes: one per agent role of its
    config, `n` per role under verifiers' best-of-n. An environment that runs an agent more
    often than that is still trained, its groups cut for room said in a warning line."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.envs.best_of_n import BestOfNEnv

    roles = max(1, len(agent_config_fields(env.config)))
    return roles * env.config.n if isinstance(env, BestOfNEnv) else roles
