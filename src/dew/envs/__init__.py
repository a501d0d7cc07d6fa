"""Environments and session sources: in-process, single-turn prompt sets, reasoning-gym
datasets, verifiers environments, TextArena games, and simulated."""

from dew.envs.environment import (
    Environment,
    EnvironmentSource,
    Episode,
    MalformedAction,
    Sampling,
    Score,
    Seated,
    Verifier,
)
from dew.envs.harness import HarnessResult, HarnessSource
from dew.envs.prompts import PromptSource
from dew.envs.reasoning_gym import ReasoningGym
from dew.envs.simulated import SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.envs.tasks import (
    CopyDigits,
    EchoDigits,
    EchoDigitsEnv,
    GuessDigit,
    GuessDigitEnv,
    task_dataset,
)
from dew.envs.textarena import TextArena
from dew.envs.verifiers import Verifiers, VerifiersSource

__all__ = [
    "CopyDigits",
    "EchoDigits",
    "EchoDigitsEnv",
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
    "Seated",
    "SimulatedConfig",
    "SimulatedEngine",
    "SimulatedSource",
    "TextArena",
    "Verifier",
    "Verifiers",
    "VerifiersSource",
    "task_dataset",
]
