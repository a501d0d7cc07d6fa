"""The recording gateway against agent frameworks nobody here wrote, used the way their
documentation uses them, beyond what `test_agents_sdk.py` runs: Pydantic AI's structured output
(an output tool whose arguments fail validation and are retried) with a tool that asks for a
retry (`ModelRetry`), usage limits and model settings; the OpenAI Agents SDK's handoff between
two agents to one with a structured `output_type`, `tool_choice="required"`, `ModelSettings` and
two tool calls in one reply, run and streamed, over chat completions and the Responses API; and
the official client's structured outputs (`parse`) under a checkpoint's own chat template, where
the answer's format must reach the model.

Agents run as `HarnessSource` commands on trio's real clock (real sockets, real subprocesses),
against a scripted engine: what the model "writes" is scripted, so the tests are about the
protocol and the record.
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import openai
import pytest
from pydantic import BaseModel

from _gateway import ScriptedEngine, tool_call
from _templates import template_tokenizer
from dew.data import Task
from dew.envs import HarnessResult, HarnessSource, Score
from dew.gateway import Gateway
from dew.objectives.rl.sessions import Label, Status, chains

# The openai client leaves its stream's event iterator unclosed (see test_gateway.py).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '.*' was garbage collected:ResourceWarning"
)


class City(BaseModel):
    name: str
    population: int


CITY = '{"name": "Paris", "population": 2100000}'


def _says_paris(result: HarnessResult) -> Score:
    return Score(1.0 if "2100000" in result.output else 0.0)


async def _run(harness: list[str], replies: list[str], **gateway) -> tuple:
    engine = ScriptedEngine(replies)
    async with Gateway(engine, max_context=8192, announce=False, **gateway) as gw:
        source = HarnessSource(gw, harness, _says_paris, wall_clock=60)
        session = await source.run(Task("paris"), Label(0, 0, 0))
    assert session.status is Status.COMPLETED, session.error
    # Every call the engine answered is recorded, as it answered it, with its log-probs.
    assert len(session.calls) == len(engine.served)
    for recorded, served in zip(session.calls, engine.served, strict=True):
        np.testing.assert_array_equal(recorded.completion, served.completion)
        assert len(recorded.logprobs) == len(recorded.completion)
    return session, engine


def _prompt(call) -> bytes:
    return np.asarray(call.prompt, np.uint8).tobytes()


# --- 1: the answer's format under a checkpoint's own chat template ----------------------------


@pytest.mark.medium
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_structured_output_reaches_the_model_under_a_checkpoints_template(api):
    """FAILED before the fix: under a checkpoint's own chat template (Qwen2.5's here), a
    `response_format` json_schema (`chat.completions.parse`, Pydantic AI's `NativeOutput`, the
    Agents SDK's `output_type`) and `tool_choice="required"` were dropped without a word: the
    model never saw the schema it had to answer in, nor that it had to call a tool. Now they are
    added to the system message (or put ahead as one), as under ChatML."""
    tokenizer = template_tokenizer("qwen2.5")
    engine = ScriptedEngine([CITY], tokenizer=tokenizer)
    async with Gateway(engine, max_context=8192, announce=False) as gw:
        session = gw.open()
        client = openai.AsyncOpenAI(
            base_url=session.base_url, api_key=session.api_key, max_retries=0
        )
        async with client:
            question = [{"role": "user", "content": "How many people live in Paris?"}]
            if api == "chat":
                answer = await client.chat.completions.parse(
                    model="m", messages=question, response_format=City
                )
                parsed = answer.choices[0].message.parsed
                await client.chat.completions.create(
                    model="m",
                    messages=question,
                    tools=[{"type": "function", "function": {"name": "census"}}],
                    tool_choice="required",
                )
            else:
                answer = await client.responses.parse(
                    model="m", input=question, instructions="Be brief.", text_format=City
                )
                parsed = answer.output_parsed
                await client.responses.create(
                    model="m",
                    input=question,
                    tools=[{"type": "function", "name": "census", "parameters": None}],
                    tool_choice="required",
                )
    assert parsed == City(name="Paris", population=2100000)
    formatted, required = (tokenizer.decode(call.prompt) for call in engine.served)
    assert '"population"' in formatted and "Answer with one JSON value" in formatted
    assert "You must call at least one tool." in required
    if api == "responses":  # added to the instructions' system turn, not a second one
        assert "system\nBe brief.\n\nAnswer with one JSON value" in formatted
    assert [c.prompt.tolist() for c in session.calls] == [c.prompt.tolist() for c in engine.served]


# --- 2: Pydantic AI's structured output and retries ------------------------------------------

# An agent as Pydantic AI's documentation writes one with structured output: its answer is a
# call of the output tool `final_result`, validated against the model; a tool that raises
# `ModelRetry` on its first call; usage limits; model settings a user tunes.
PYDANTIC_AI_AGENT = textwrap.dedent(
    """
    import asyncio, os, sys
    from pydantic import BaseModel
    from pydantic_ai import Agent, ModelRetry, UsageLimits
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        name: str
        population: int

    api, mode = sys.argv[1:]
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatModel
    provider = OpenAIProvider(
        base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]
    )
    settings = {"temperature": 0.3, "max_tokens": 200, "top_p": 0.9, "parallel_tool_calls": False}
    if api == "chat":
        settings |= {"seed": 3, "stop_sequences": ["STOP"]}
    agent = Agent(
        kind("dew", provider=provider), output_type=City, instructions="Answer.", retries=2,
        model_settings=settings,
    )
    asked = []

    @agent.tool_plain
    def population(city: str) -> str:
        \"\"\"Look a city's population up.\"\"\"
        asked.append(city)
        if city != city.lower():
            raise ModelRetry("write the city in lower case")
        return "2100000"

    async def main():
        limits = UsageLimits(request_limit=6)
        if mode == "iter":
            async with agent.iter("Paris?", usage_limits=limits) as run:
                async for _ in run:
                    pass
            return run.result.output
        return (await agent.run("Paris?", usage_limits=limits)).output

    print(asyncio.run(main()).population, end="")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(("api", "mode"), [("chat", "run"), ("responses", "iter")])
async def test_pydantic_ai_structured_output_and_its_retries_are_one_recorded_chain(api, mode):
    """Pins what no test did: Pydantic AI's tool-call structured output with both its retries
    (a tool's `ModelRetry`, then output that fails validation) under usage limits and model
    settings, run and iterated, over both APIs. Each retry goes back to the model as a tool
    result in the same conversation: four calls, one chain, each retry's reason in the next
    call's prompt; the request's sampling settings do not reach the engine."""
    replies = [
        tool_call("population", {"city": "Paris"}),
        tool_call("population", {"city": "paris"}),
        tool_call("final_result", {"name": "Paris", "population": "lots"}),
        tool_call("final_result", {"name": "Paris", "population": 2100000}),
    ]
    harness = [sys.executable, "-c", PYDANTIC_AI_AGENT, api, mode]
    session, engine = await _run(harness, replies)
    assert session.reward == 1.0
    assert len(session.calls) == 4 and len(chains(session)) == 1
    prompts = [_prompt(call) for call in session.calls]
    assert b"write the city in lower case" in prompts[1]
    assert b"2100000" in prompts[2] and b"population" in prompts[3]
    assert b"lots" in prompts[3] and b"int" in prompts[3]  # the validation error, sent back
    assert all(sampling == engine.sampling[0] for sampling in engine.sampling)


# --- 3: the Agents SDK's handoff to a structured agent ---------------------------------------

# Two agents as the SDK's documentation writes them: a triage agent that hands off to an
# expert, whose answer is a structured `output_type`, with `ModelSettings` a user tunes.
HANDOFF_AGENT = textwrap.dedent(
    """
    import asyncio, sys
    from pydantic import BaseModel
    from agents import (
        Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
        function_tool, set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    class City(BaseModel):
        name: str
        population: int

    @function_tool
    def population(city: str) -> str:
        \"\"\"Look a city's population up.\"\"\"
        return {"paris": "2100000"}.get(city, "unknown")

    api, mode = sys.argv[1:]
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    model = kind(model="dew", openai_client=AsyncOpenAI())
    settings = ModelSettings(
        temperature=0.2, top_p=0.9, max_tokens=300, parallel_tool_calls=True, truncation="auto",
        include_usage=True,
    )
    expert = Agent(
        name="expert", instructions="You know cities.", tools=[population], model=model,
        output_type=City, model_settings=settings,
    )
    triage = Agent(
        name="triage", instructions="Hand the question on.", handoffs=[expert], model=model,
        model_settings=ModelSettings(tool_choice="required"),
    )

    async def run():
        if mode == "stream":
            result = Runner.run_streamed(triage, "Paris?")
            async for _ in result.stream_events():
                pass
            return result
        return await Runner.run(triage, "Paris?")

    result = asyncio.run(run())
    print(result.last_agent.name, result.final_output.population, end="")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["run", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_an_agents_sdk_handoff_to_a_structured_agent_is_recorded_whole(api, mode):
    """Pins what no test did: the Agents SDK's handoff (`tool_choice="required"` on the triage
    agent) to an agent with a structured `output_type` and `ModelSettings`, whose reply calls
    its tool twice at once, run and streamed, over both APIs. The expert's instructions and
    tools start a new chain; its second call extends its first, both tool outputs in it."""
    replies = [
        tool_call("transfer_to_expert", {}),
        tool_call("population", {"city": "paris"}) + tool_call("population", {"city": "rome"}),
        CITY,
    ]
    harness = [sys.executable, "-c", HANDOFF_AGENT, api, mode]
    session, _ = await _run(harness, replies)
    assert session.reward == 1.0 and session.calls and len(session.calls) == 3
    assert len(chains(session)) == 2
    first, second, third = (_prompt(call) for call in session.calls)
    assert b"Hand the question on." in first and b"transfer_to_expert" in first
    assert b"You know cities." in second and b'"population"' in second
    assert third.count(b"2100000") == 1 and b"unknown" in third
