"""`ChatHarness`: the verifiers harness dew plays every agent of an episode with (id `dew-chat`).

verifiers' own harnesses install a program with `uv` (from the network) into a sandbox; this one
is the same chat loop, in-process: each turn a chat completion through the episode's model
client (dew's gateway, which records it), offering the task's MCP tools and running the calls
the reply makes (`_run_tool`). Built on first use (`_chat_harness_classes`), since its classes
subclass verifiers' own and verifiers is an optional extra; `dew.envs.verifiers` gives them by
name, and the `dew_chat` package registers them with verifiers.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable
from typing import Any

from dew.envs._verifiers_loading import _import_verifiers


@functools.cache
def _chat_harness_classes(harness_id: str) -> tuple[type, type]:
    """`ChatHarness` and its config, whose id is `harness_id` (`dew.envs.verifiers.HARNESS_ID`),
    built once, on first use (verifiers is an optional extra)."""
    vf = _import_verifiers()
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
    from verifiers.v1.runtimes import ProgramResult

    class ChatHarnessConfig(vf.HarnessConfig):
        """`ChatHarness`'s config: verifiers' harness knobs (`tool_timeout` among them)."""

        id: str = harness_id

    class ChatHarness(vf.Harness[ChatHarnessConfig]):
        """An agent's chat loop, in-process: the task's prompt, then one model call after
        another through the rollout's interception endpoint, running each tool call on the
        task's MCP servers, until a reply calls no tool. verifiers' `null` harness does the
        same in a program it installs with uv; this one needs nothing installed."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_MCP = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(
            self,
            ctx,
            trace,
            runtime,
            endpoint: str,
            secret: str,
            mcp_urls: dict[str, str],
            data,
            tool_interception_url: str | None = None,
        ):
            import openai

            system, prompt = self.resolve_prompt(data)
            messages: list[dict[str, Any]] = (
                [{"role": "system", "content": system}] if system else []
            )
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            elif prompt is not None:
                messages += [message_to_wire(message) for message in prompt]
            servers = {
                name: {"url": url, "timeout": self.config.tool_timeout}
                for name, url in mcp_urls.items()
            }
            # No client timeout: on a busy machine a connect to the rollout's interception server
            # can take longer than openai's 5 s, and the rollout's own limits (the source's
            # wall_clock, verifiers' agent timeout) bound it.
            client = openai.AsyncOpenAI(
                base_url=endpoint, api_key=secret, max_retries=0, timeout=None
            )
            async with (
                client,
                contextlib.AsyncExitStack() as stack,
            ):
                tools, dispatch, connections = (
                    await connect_mcp({"mcpServers": servers}, stack) if servers else ([], {}, {})
                )
                while True:
                    options = {"tools": tools} if tools else {}
                    answer = await client.chat.completions.create(
                        model=ctx.model, messages=messages, **options
                    )
                    message = answer.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        return ProgramResult(exit_code=0, stdout="", stderr="")
                    for call in message.tool_calls:
                        content = await _run_tool(call, dispatch, connections, call_mcp)
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "content": content}
                        )

    return ChatHarness, ChatHarnessConfig


async def _run_tool(call, dispatch, connections, call_mcp: Callable) -> str:
    """A tool call's result, as the model sees it: an MCP tool's answer, or what was wrong with
    the call (a model's malformed call is the model's to fix, as verifiers' chat loop says)."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as error:
        return f"error: invalid JSON in tool arguments ({error})"
    if not isinstance(arguments, dict):
        return f"error: tool arguments must be a JSON object, got {type(arguments).__name__}"
    if call.function.name not in dispatch:
        return f"error: unknown tool {call.function.name!r}"
    return await call_mcp(connections, dispatch, call.function.name, arguments)
