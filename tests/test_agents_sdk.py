"""A harness written with the OpenAI Agents SDK (`openai-agents`), a library nobody here wrote,
trained through the gateway unchanged: run by `HarnessSource` as a subprocess given
OPENAI_BASE_URL and OPENAI_API_KEY, over the Responses API (the SDK's default) and over chat
completions, each run to its end and streamed. On trio's real clock (real sockets, real
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


def says_the_population(result: HarnessResult) -> Score:
    return Score(1.0 if "2.1M" in result.output else 0.0)


@pytest.mark.parametrize("mode", ["run", "stream"])
@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_an_agents_sdk_harness_trains_through_the_gateway_unchanged(api, mode):
    engine = ScriptedEngine(
        [tool_call("population", {"city": "paris"}, content="Checking."), "About 2.1M people."]
    )
    async with Gateway(engine, max_context=4096, announce=False) as gateway:
        harness = [sys.executable, "-c", AGENT, api, mode]
        source = HarnessSource(gateway, harness, says_the_population)
        session = await source.run(Task("paris"), Label(0, 0, 0))
    assert session.status is Status.COMPLETED and session.reward == 1.0, session.error
    # The tool call, then the answer after the tool's output: one chain, the gateway's ids.
    assert len(session.calls) == 2 and len(chains(session)) == 1
    second_prompt = np.asarray(session.calls[1].prompt, np.uint8).tobytes()
    assert b"2.1M" in second_prompt and b"paris" in second_prompt
    for recorded, served in zip(session.calls, engine.served, strict=True):
        np.testing.assert_array_equal(recorded.completion, served.completion)
