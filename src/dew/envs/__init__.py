"""Environments and session sources: in-process, single-turn prompt sets, and simulated."""

from dew.envs.simulated import SimulatedConfig, SimulatedEngine, SimulatedSource

__all__ = ["SimulatedConfig", "SimulatedEngine", "SimulatedSource"]
