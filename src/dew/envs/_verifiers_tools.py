"""The tools a verifiers environment's agents offer the model, known before any episode runs.

`ChatHarness` offers the model the tools of the task's MCP servers (`connect_mcp` lists them once
verifiers has started each server in a subprocess). Their schemas are part of every request the
agent sends, its first included, so a run's context must be sized with them (a tool environment
sized without them had every rollout cut before its first call). The servers are not started to
learn them: each toolset registers its tools on an in-process MCP server, which lists them as
the started server would, named as `connect_mcp` names them.
"""

from __future__ import annotations

import asyncio
from typing import Any


def offered_tools(env: Any) -> list[dict[str, Any]]:
    """The chat tools (OpenAI's `{"type": "function", "function": ...}`) an agent of `env` (a
    `verifiers.v1.Env`) offers on each call: its tasks' toolsets' tools, the same for every
    task (verifiers builds a task's toolsets from the taskset's task config alone).

    Raises:
        ValueError: naming the environment and the toolset whose tools cannot be listed.
    """
    from mcp.server.mcpserver import MCPServer

    taskset = env.taskset
    tools = []
    for toolset in type(taskset).task_type().toolsets(taskset.config.task):
        server = MCPServer(toolset.server_name or "tools")
        try:
            toolset.register(server)
            # A fresh loop of its own: this runs before (or beside) the run's asyncio thread.
            listed = asyncio.run(server.list_tools())
        except Exception as error:
            raise ValueError(
                f"verifiers environment {env.config.env_id!r}: the tools of "
                f"{type(toolset).__name__} cannot be listed: {type(error).__name__}: {error}"
            ) from error
        prefix = toolset.server_name
        for tool in listed:
            function = {
                "name": f"{prefix}_{tool.name}" if prefix else tool.name,
                "description": tool.description or "",
                "parameters": tool.input_schema,
            }
            tools.append({"type": "function", "function": function})
    return tools
