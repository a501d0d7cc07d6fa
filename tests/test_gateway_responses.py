"""The gateway's Responses API (`POST .../v1/responses`) with the official `openai` client: the
API the OpenAI Agents SDK uses by default, served over the chat path (docs/gateway.md)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import openai
import pytest

from _gateway import LOOKUP_TOOL, ScriptedEngine, tiny_server, tool_call
from dew.gateway import RESPONSE_FIELDS, Gateway
from dew.gateway._answers import token_text
from dew.objectives.rl.sessions import Session, Status, chains
from dew.serve import tokenizer

# The Responses API's function tool: flat, without chat's "function" wrapper.
LOOKUP = {"type": "function", **LOOKUP_TOOL["function"]}


def gateway(engine, **kwargs) -> Gateway:
    kwargs.setdefault("max_context", 4096)
    return Gateway(engine, announce=False, **kwargs)


def api(session) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


def one_chain(session) -> bool:
    return len(chains(Session(Status.COMPLETED, session.calls, reward=0.0))) == 1


async def test_a_multi_turn_agent_with_function_calls_merges_into_one_chain():
    engine = ScriptedEngine(
        [
            tool_call("lookup", {"key": "paris"}, content="Let me check."),
            tool_call("lookup", {"key": "rome"}),
            "Paris has 2.1M people.",
        ]
    )
    async with gateway(engine) as gw:
        session = gw.open()
        async with api(session) as client:
            items = [{"role": "user", "content": "How many live in Paris?"}]
            # As an agent SDK does: the instructions, tools and whole conversation every call.
            ask = {"model": "m", "instructions": "Be brief.", "tools": [LOOKUP]}
            first = await client.responses.create(input=items, **ask)
            message, call = first.output
            assert (message.type, message.content[0].text) == ("message", "Let me check.")
            assert (call.type, call.name, json.loads(call.arguments)) == (
                "function_call",
                "lookup",
                {"key": "paris"},
            )
            assert first.status == "completed" and first.output_text == "Let me check."
            # The output items back, then the tool's output.
            items += [item.model_dump() for item in first.output]
            items.append(
                {"type": "function_call_output", "call_id": call.call_id, "output": "2.1M"}
            )
            second = await client.responses.create(input=items, **ask)
            (call2,) = second.output  # a reply of tool calls only has no message item
            items += [item.model_dump() for item in second.output] + [
                {"type": "function_call_output", "call_id": call2.call_id, "output": "2.8M"}
            ]
            third = await client.responses.create(input=items, **ask)
    assert third.output_text == "Paris has 2.1M people."
    assert third.usage.output_tokens == len(session.calls[2].completion)
    assert third.usage.input_tokens == len(session.calls[2].prompt)
    assert len(session.calls) == 3 and one_chain(session)
    for recorded, served in zip(session.calls, engine.served, strict=True):
        np.testing.assert_array_equal(recorded.completion, served.completion)


@pytest.mark.medium
async def test_a_streamed_response_is_the_response_event_by_event():
    engine = ScriptedEngine([tool_call("lookup", {"key": "x"}, content="Looking."), "Done here."])
    async with gateway(engine) as gw:
        session = gw.open()
        async with api(session) as client:
            stream = await client.responses.create(
                model="m", input="Find x.", tools=[LOOKUP], stream=True
            )
            events = [event async for event in stream]
            items = [item.model_dump() for item in events[-1].response.output]
            items.append({"type": "function_call_output", "call_id": "nope", "output": "?"})
            plain_stream = await client.responses.create(
                model="m", input=[{"role": "user", "content": "Find x."}, *items], stream=True
            )
            plain = [event async for event in plain_stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == "Looking."
    arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in arguments] == [{"key": "x"}]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.id for item in done] == [item.id for item in final.output]
    # A plain reply streams one delta per token, which join to its text.
    deltas = [e.delta for e in plain if e.type == "response.output_text.delta"]
    assert len(deltas) == len("Done here.") and "".join(deltas) == "Done here."
    assert plain[-1].response.output_text == "Done here." and len(session.calls) == 2


@pytest.mark.medium
async def test_log_probs_are_the_real_engines_and_a_cut_reply_is_incomplete():
    server = tiny_server()
    async with server, gateway(server, max_tokens=12, max_context=128) as gw:
        session = gw.open()
        async with api(session) as client:
            answer = await client.responses.create(
                model="m",
                input="hello",
                include=["message.output_text.logprobs"],
                top_logprobs=2,
                max_output_tokens=4,
            )
    (call,) = session.calls
    (part,) = answer.output[0].content
    np.testing.assert_array_equal([e.logprob for e in part.logprobs], call.logprobs)
    for entry, (ids, values) in zip(part.logprobs, call.top_logprobs, strict=True):
        assert [t.logprob for t in entry.top_logprobs] == values.tolist()
        assert entry.top_logprobs[0].token == token_text(tokenizer.BYTES.token_bytes(int(ids[0])))
    # Four tokens and no end: the budget ran out.
    assert len(call.completion) == 4 and answer.status == "incomplete"
    assert answer.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not supported"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
            "input_image",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "a string"),
        ({"input": []}, "input", "at least one message"),
        ({"temperature": "hot"}, "temperature", "a number"),
        # Named by the Responses API's own fields, not by chat's they stand for.
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "'yaml' is unknown"),
        (
            {"tools": [LOOKUP], "tool_choice": {"type": "function", "name": "f"}},
            "tool_choice.name",
            "not in tools",
        ),
        ({"tools": [{**LOOKUP, "parameters": 3}]}, "tools[0].parameters", "an object"),
        ({"frobnicate": 1}, "frobnicate", "unrecognized"),
    ],
)
async def test_bad_responses_requests_get_an_error_naming_the_field(fields, param, says):
    engine = ScriptedEngine(["a"])
    async with gateway(engine) as gw:
        session = gw.open()
        async with api(session) as client:
            given = dict(fields)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(
                    model="m", input=given.pop("input", "hi"), extra_body=given
                )
    assert refused.value.status_code == 400 and refused.value.body["param"] == param
    assert says in refused.value.body["message"] and session.calls == ()


def test_the_docs_say_what_every_responses_field_does():
    docs = (pathlib.Path(__file__).parent.parent / "docs" / "gateway.md").read_text()
    for name in RESPONSE_FIELDS:
        assert f"`{name}`" in docs, name
