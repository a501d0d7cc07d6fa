"""Environments and session sources: in-process, single-turn prompt sets, reasoning-gym
datasets, and simulated."""

from dew.envs.environment import (
    Environment,
    EnvironmentSource,
    Episode,
    MalformedAction,
    Sampling,
    Score,
    Verifier,
)
from dew.envs.harness import HarnessResult, HarnessSource
from dew.envs.prompts import PromptSource
from dew.envs.reasoning_gym import ReasoningGym
from dew.envs.simulated import SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.envs.tasks import CopyDigits, GuessDigit, GuessDigitEnv, task_dataset

__all__ = [
    "CopyDigits",
    "Environment",
    "EnvironmentSource",
    "Episode",
    "GuessDigit",
    "GuessDigitEnv",
    "HarnessResult",
    "HarnessSource",
    "MalformedAction",
    "PromptSource",
    "ReasoningGym",
    "Sampling",
    "Score",
    "SimulatedConfig",
    "SimulatedEngine",
    "SimulatedSource",
    "Verifier",
    "task_dataset",
]
