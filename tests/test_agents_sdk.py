"""Harnesses written with agent SDKs nobody here wrote, trained through the gateway unchanged:
the OpenAI Agents SDK (`openai-agents`) and Pydantic AI (`pydantic-ai-slim`), each run by
`HarnessSource` as a subprocess given OPENAI_BASE_URL and OPENAI_API_KEY, over the Responses API
and over chat completions, run to its end and streamed. On trio's real clock (real sockets, real
subprocesses)."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from _gateway import ScriptedEngine, tool_call
from dew.data import Task
from dew.envs import HarnessResult, HarnessSource, Score
from dew.gateway import Gateway
from dew.objectives.rl.sessions import Label, Status, chains

# The agent as its SDK's documentation writes one: a function tool, instructions, a runner.
AGENT = textwrap.dedent(
    """
    import asyncio, os, sys
    from agents import (
        Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def population(city: str) -> str:
        \"\"\"Look a city's population up.\"\"\"
        return {"paris": "2.1M"}.get(city, "unknown")

    api, mode = sys.argv[1:]
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="census",
        instructions="Answer briefly.",
        tools=[population],
        model=kind(model="dew", openai_client=AsyncOpenAI()),
    )
    question = "How many people live in " + os.environ["DEW_TASK"] + "?"

    async def streamed():
        result = Runner.run_streamed(agent, question)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(streamed()) if mode == "stream" else Runner.run_sync(agent, question)
    print(result.final_output, end="")
    """
)


# The same agent as Pydantic AI's documentation writes one: a model over the OpenAI provider,
# a plain tool, instructions.
PYDANTIC_AI_AGENT = textwrap.dedent(
    """
    import asyncio, os, sys
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    api, mode = sys.argv[1:]
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatModel
    provider = OpenAIProvider(
        base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]
    )
    agent = Agent(kind("dew", provider=provider), instructions="Answer briefly.")

    @agent.tool_plain
    def population(city: str) -> str:
        \"\"\"Look a city's population up.\"\"\"
        return {"paris": "2.1M"}.get(city, "unknown")

    question = "How many people live in " + os.environ["DEW_TASK"] + "?"

    async def streamed():
        async with agent.run_stream(question) as result:
            return "".join([text async for text in result.stream_text(delta=True)])

    output = asyncio.run(streamed()) if mode == "stream" else agent.run_sync(question).output
    print(output, end="")
    """
)


def says_the_population(result: HarnessResult) -> Score:
    return Score(1.0 if "2.1M" in result.output else 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["run", "stream"])
@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_an_agents_sdk_harness_trains_through_the_gateway_unchanged(api, mode):
    await _trains_through_the_gateway([sys.executable, "-c", AGENT, api, mode])


# Streamed, the tool call comes without text before it: Pydantic AI's run_stream ends at the
# first text the model streams, as its documentation says, before any tool call after it.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("api", "mode", "before_the_call"), [("chat", "run", "Checking."), ("responses", "stream", "")]
)
async def test_a_pydantic_ai_harness_trains_through_the_gateway_unchanged(
    api, mode, before_the_call
):
    harness = [sys.executable, "-c", PYDANTIC_AI_AGENT, api, mode]
    await _trains_through_the_gateway(harness, before_the_call)


async def _trains_through_the_gateway(harness: list[str], before_the_call="Checking.") -> None:
    engine = ScriptedEngine(
        [tool_call("population", {"city": "paris"}, content=before_the_call), "About 2.1M people."]
    )
    async with Gateway(engine, max_context=4096, announce=False) as gateway:
        source = HarnessSource(gateway, harness, says_the_population)
        session = await source.run(Task("paris"), Label(0, 0, 0))
    assert session.status is Status.COMPLETED and session.reward == 1.0, session.error
    # The tool call, then the answer after the tool's output: one chain, the gateway's ids.
    assert len(session.calls) == 2 and len(chains(session)) == 1
    second_prompt = np.asarray(session.calls[1].prompt, np.uint8).tobytes()
    assert b"2.1M" in second_prompt and b"paris" in second_prompt
    for recorded, served in zip(session.calls, engine.served, strict=True):
        np.testing.assert_array_equal(recorded.completion, served.completion)
