"""A two-agent verifiers taskset for the tests (taskset id `_vf_duo`): `_vf_copy`'s tasks, each
episode played by two agents of its own `Env` (`first`, then `second`), each attempting the copy
on its own trace, so that every rollout is two chains.
"""

import verifiers.v1 as vf

from _vf_copy import CopyTaskset


class DuoTaskset(CopyTaskset):
    pass


class DuoEnvConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig()
    second: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.first.run(task)
        await agents.second.run(task)


__all__ = ["DuoEnv", "DuoTaskset"]
