"""A multi-turn verifiers taskset with a tool, for the tests (taskset id `_vf_lookup`).

Each task asks for the value a key holds in a table only the `lookup` tool reads: the agent
calls the tool (an MCP server verifiers starts per rollout, `python -m _vf_lookup`), reads its
answer, then replies with the value. The rubric rewards the value, and a metric counts the tool
calls. `TABLE` is the same for every task, so a test knows every answer.
"""

from collections.abc import Iterator

import verifiers.v1 as vf

TABLE = {"a": "7", "b": "3", "c": "9"}


class LookupToolsetConfig(vf.ToolsetConfig):
    pass


class LookupToolset(vf.Toolset[LookupToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # its tool is `lookup`, not prefixed by the server's name

    @vf.tool
    async def lookup(self, key: str) -> str:
        """The value a key holds."""
        return TABLE.get(key, "unknown key")


class LookupData(vf.TaskData):
    key: str


class LookupTask(vf.Task[LookupData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [LookupToolset(LookupToolsetConfig())]

    @vf.reward
    async def answered(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == TABLE[self.data.key])

    @vf.metric
    async def lookups(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class LookupTaskset(vf.Taskset[LookupTask, vf.TasksetConfig]):
    def load(self) -> Iterator[LookupTask]:
        for key in sorted(TABLE) * 4:
            prompt = f"What is the value of key {key}? Use the lookup tool."
            yield LookupTask(LookupData(prompt=prompt, key=key), self.config.task)


__all__ = ["LookupTaskset"]

if __name__ == "__main__":
    LookupToolset.run()
