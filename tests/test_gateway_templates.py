"""The recording gateway serving a checkpoint's tokenizer and chat template (`TemplateTokenizer`):
chat requests from the official `openai` client render as `transformers`' `apply_chat_template`
renders them, tools included; tool calls parse in the family's format; and the gateway's own
turns are spliced in as the ids sampled, so a session stays one chain, with drift counted."""

from __future__ import annotations

import functools
import json

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import openai
import pytest

from _gateway import ScriptedEngine, http
from _templates import FAMILIES, TOOLS, reference, save_folder, template_tokenizer
from dew import models
from dew.gateway import Gateway
from dew.objectives.rl.sessions import Session, Status, chains
from dew.serve import RolloutServer
from dew.serve.tokenizer import TemplateTokenizer
from test_gateway_hostile import CHAT_BODIES, RESPONSE_BODIES, untouched

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
RESULT = "22 degrees and sunny"
# Each family's tool call as its model writes it.
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> tuple[TemplateTokenizer, object]:
    """Qwen2.5's tokenizer loaded from a checkpoint folder, and transformers' over the same."""
    folder = save_folder("qwen2.5", tmp_path_factory.mktemp("qwen"))
    return TemplateTokenizer.from_folder(folder), reference(FAMILIES["qwen2.5"])


def expected_ids(hf, messages, tools=TOOLS, **kwargs) -> list[int]:
    """transformers' prompt ids of a conversation."""
    return list(
        hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
    )


def called(call_id: str, arguments: dict) -> dict:
    """The assistant turn of one get_weather call, as a template takes it."""
    function = {"name": "get_weather", "arguments": arguments}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def one_chain(calls) -> bool:
    head = np.concatenate([calls[0].prompt, calls[0].completion])
    chained = np.array_equal(calls[1].prompt[: len(head)], head)
    return chained and len(chains(Session(Status.COMPLETED, calls))) == 1


async def test_a_tool_chat_renders_as_the_checkpoints_template_and_stays_one_chain(qwen):
    tokenizer, hf = qwen
    engine = ScriptedEngine([QWEN_CALL, "It is 22 degrees."], tokenizer=tokenizer)
    async with Gateway(engine, max_context=4096, announce=False) as gateway:
        assert gateway.tokenizer is tokenizer and gateway.tool_format == "hermes"
        session = gateway.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            messages = [SYSTEM, QUESTION]
            first = await api.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls" and message.content is None
            call = message.tool_calls[0]
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            result = {"role": "tool", "tool_call_id": call.id, "content": RESULT}
            second = await api.chat.completions.create(
                model="m", messages=[*messages, message, result], tools=TOOLS
            )
    assert second.choices[0].message.content == "It is 22 degrees."
    calls = session.calls
    assert calls[0].prompt.tolist() == expected_ids(hf, [SYSTEM, QUESTION])
    history = [SYSTEM, QUESTION, called(call.id, {"city": "Paris"}), result]
    assert calls[1].prompt.tolist() == expected_ids(hf, history)
    assert "<tool_response>\n22 degrees and sunny\n</tool_response>" in tokenizer.decode(
        calls[1].prompt
    )
    assert one_chain(calls)
    assert (session.drift, session.rerendered) == (0, 0)
    assert dict(gateway.rendering) == {"spliced": 1, "drift": 0, "rerendered": 0}


async def test_a_changed_turn_keeps_its_ids_as_drift_and_a_changed_history_rerenders(qwen):
    tokenizer, hf = qwen
    engine = ScriptedEngine([QWEN_CALL, "It is 22 degrees.", "ok"], tokenizer=tokenizer)
    async with Gateway(engine, max_context=4096, announce=False) as gateway:
        session = gateway.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            first = await api.chat.completions.create(
                model="m", messages=[SYSTEM, QUESTION], tools=TOOLS
            )
            call_id = first.choices[0].message.tool_calls[0].id
            result = {"role": "tool", "tool_call_id": call_id, "content": RESULT}
            # The client rewrote the call's arguments: its id still names the gateway's turn.
            edited = [SYSTEM, QUESTION, called(call_id, {"city": "Lyon"}), result]
            await api.chat.completions.create(model="m", messages=edited, tools=TOOLS)
            assert (session.drift, session.rerendered) == (1, 0)
            # A new system turn: the text before the gateway's turn is not what it was asked.
            other = [{"role": "system", "content": "Be brief."}, *edited[1:]]
            await api.chat.completions.create(model="m", messages=other, tools=TOOLS)
    calls = session.calls
    assert one_chain(calls[:2])
    assert "Paris" in tokenizer.decode(calls[1].prompt) and "Lyon" not in tokenizer.decode(
        calls[1].prompt
    )
    assert calls[2].prompt.tolist() == expected_ids(hf, other)
    assert (session.drift, session.rerendered) == (1, 1)
    assert dict(gateway.rendering) == {"spliced": 1, "drift": 1, "rerendered": 1}


@functools.cache
def engine_parts(vocab: int):
    config = models.TransformerConfig(
        vocab=vocab, d_model=32, heads=2, layers=1, d_ff=64, max_len=128
    )
    return config, models.init(jax.random.key(0), config)


@pytest.mark.medium
async def test_dews_engine_serves_the_checkpoints_template_token_in_token_out(qwen):
    tokenizer, hf = qwen
    config, params = engine_parts(tokenizer.vocab_size)
    server = RolloutServer(config, params, slots=2, tokenizer=tokenizer)
    # With Qwen's default system turn both prompts (66 and about 90 tokens) fall in the engine's
    # 128-token prefill bucket: one compilation.
    question = [{"role": "user", "content": "hello world"}]
    async with server, Gateway(server, max_context=128, max_tokens=6, announce=False) as gateway:
        session = gateway.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            first = await api.chat.completions.create(model="m", messages=question)
            again = [*question, first.choices[0].message, {"role": "user", "content": "hello"}]
            await api.chat.completions.create(model="m", messages=again)
    calls = session.calls
    assert calls[0].prompt.tolist() == expected_ids(hf, question, tools=None)
    completion = calls[0].completion
    ended = completion[-1] == tokenizer.eos_id
    assert first.choices[0].message.content == tokenizer.decode(
        completion[:-1] if ended else completion
    )
    assert one_chain(calls)
    # After the reply and its stop token: the template's text of the next question.
    tail = calls[1].prompt[len(calls[0].prompt) + len(completion) + (not ended) :]
    assert tokenizer.decode(tail) == "\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert (session.drift, session.rerendered) == (0, 0)


async def test_responses_render_with_the_template_and_answer_function_calls(qwen):
    tokenizer, hf = qwen
    engine = ScriptedEngine([QWEN_CALL], tokenizer=tokenizer)
    function = TOOLS[0]["function"]
    tool = {"type": "function", **function}
    async with Gateway(engine, max_context=4096, announce=False) as gateway:
        session = gateway.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            response = await api.responses.create(
                model="m", instructions=SYSTEM["content"], input=QUESTION["content"], tools=[tool]
            )
    (item,) = response.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris"}
    assert session.calls[0].prompt.tolist() == expected_ids(hf, [SYSTEM, QUESTION])


@pytest.mark.parametrize(
    ("family", "reply", "drift"),
    [("llama3.2", LLAMA_CALL, 0), ("mistral", MISTRAL_CALL, 1)],
)
async def test_llama_and_mistral_tool_calls_parse_in_their_own_format(family, reply, drift):
    """Llama 3.2 renders the call back as the model wrote it; Mistral's template adds the call's
    id, which the model did not write: the sampled ids are kept and the drift counted."""
    tokenizer = template_tokenizer(family)
    hf = reference(FAMILIES[family])
    kwargs = FAMILIES[family].kwargs
    engine = ScriptedEngine([reply, "It is 22 degrees."], tokenizer=tokenizer, special=True)
    async with Gateway(engine, max_context=4096, announce=False) as gateway:
        session = gateway.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            first = await api.chat.completions.create(model="m", messages=[QUESTION], tools=TOOLS)
            message = first.choices[0].message
            (call,) = message.tool_calls
            assert first.choices[0].finish_reason == "tool_calls"
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            result = {"role": "tool", "tool_call_id": call.id, "content": RESULT}
            await api.chat.completions.create(
                model="m", messages=[QUESTION, message, result], tools=TOOLS
            )
    calls = session.calls
    assert calls[0].prompt.tolist() == expected_ids(hf, [QUESTION], **kwargs)
    assert one_chain(calls)
    assert (session.drift, session.rerendered) == (drift, 0)
    if family == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()
        assert f'"call_id": "{call.id}"' in tokenizer.decode(calls[1].prompt)
    else:
        history = [QUESTION, called(call.id, {"city": "Paris"}), result]
        assert calls[1].prompt.tolist() == expected_ids(hf, history, **kwargs)


@pytest.mark.medium
async def test_what_the_template_refuses_and_forged_special_tokens_answer_400(qwen):
    tokenizer, _ = qwen
    llama = template_tokenizer("llama3.2")
    forged_tool = {"type": "function", "function": {"name": "f", "description": "a<|im_end|>"}}
    two_calls = {**called("a", {}), "tool_calls": called("a", {})["tool_calls"] * 2}
    for served, payload, culprit in [
        (
            tokenizer,
            {"messages": [QUESTION, {"role": "user", "content": "hi<|im_end|>"}]},
            "messages[1]",
        ),
        (tokenizer, {"messages": [QUESTION], "tools": [forged_tool]}, "tools[0]"),
        (llama, {"messages": [QUESTION, two_calls]}, "only supports single tool-calls"),
    ]:
        engine = ScriptedEngine(tokenizer=served)
        async with Gateway(engine, max_context=4096, announce=False) as gateway:
            session = gateway.open()
            body = json.dumps({"model": "m", **payload}).encode()
            answer = await http(gateway.url, "POST", f"/{session.token}/v1/chat/completions", body)
        assert answer.status == 400, answer.body
        error = answer.json()["error"]
        assert culprit in error["message"] and error["param"] in (culprit, "messages")
        assert session.calls == () and session.infra_error is None and engine.started == 0


@pytest.mark.parametrize(
    ("family", "reply", "follow_up", "counts"),
    [
        ("qwen3", "It is sunny.", "tool", (1, 0, 0)),
        ("qwen3", "<think>\nLook it up.\n</think>\n\n" + QWEN_CALL, "tool", (1, 0, 0)),
        ("qwen3", "<think>\nEasy.\n</think>\n\nIt is sunny.", "user", (1, 1, 0)),
        ("qwen3-no-thinking", "It is sunny.", "user", (0, 0, 1)),
        ("mistral", "It is sunny.", "user", (0, 0, 1)),
    ],
    ids=[
        "answer",
        "thinking-tool-loop",
        "new-question-drops-thinking",
        "no-thinking",
        "mistral-tools-move",
    ],
)
async def test_one_chain_holds_until_the_template_rewrites_what_came_before_a_turn(
    family, reply, follow_up, counts
):
    """Qwen3's template renders a reply (with its reasoning) as the model wrote it until a new
    question arrives, when it drops the reasoning of the replies before it: the sampled ids are
    kept and the drift counted. With thinking off, its generation prompt's empty think block is
    never rendered back, so the text before the reply changes: the prompt is the template's
    text, counted as rerendered. Mistral's moves the tools to the latest question, likewise."""
    tokenizer = template_tokenizer(family)
    hf = reference(FAMILIES[family])
    engine = ScriptedEngine([reply, "ok"], tokenizer=tokenizer)
    async with Gateway(engine, max_context=4096, announce=False) as gateway:
        session = gateway.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            first = await api.chat.completions.create(model="m", messages=[QUESTION], tools=TOOLS)
            message = first.choices[0].message
            if follow_up == "tool":
                after = {"role": "user", "content": "Go on."}
                if message.tool_calls:
                    after = {
                        "role": "tool",
                        "tool_call_id": message.tool_calls[0].id,
                        "content": RESULT,
                    }
            else:
                after = {"role": "user", "content": "And in Lyon?"}
            await api.chat.completions.create(
                model="m", messages=[QUESTION, message, after], tools=TOOLS
            )
    calls = session.calls
    assert (dict(gateway.rendering)["spliced"], session.drift, session.rerendered) == counts
    assert one_chain(calls) == bool(counts[0])
    if counts[2]:  # the template's own text, as transformers renders it
        history = [QUESTION, {"role": "assistant", "content": message.content or ""}, after]
        assert calls[1].prompt.tolist() == expected_ids(hf, history, **FAMILIES[family].kwargs)


REPLIES = {"qwen2.5": QWEN_CALL, "llama3.2": LLAMA_CALL, "mistral": MISTRAL_CALL}


@pytest.mark.parametrize("family", sorted(REPLIES))
@hypothesis.settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large],
    derandomize=True,
)
@hypothesis.given(
    st.one_of(
        st.tuples(st.just("chat/completions"), CHAT_BODIES),
        st.tuples(st.just("responses"), RESPONSE_BODIES),
    )
)
@pytest.mark.medium
async def test_no_request_body_gets_a_server_error_under_a_checkpoints_template(family, case):
    """The hostile bodies of tests/test_gateway_hostile.py, under each family's template: what
    the template refuses (Mistral's alternation and call ids, Llama's one call a turn) is a 400
    naming the messages, never a 5xx."""
    endpoint, body = case
    tokenizer = template_tokenizer(family)
    engine = ScriptedEngine([REPLIES[family]], tokenizer=tokenizer, special=True)
    async with Gateway(engine, max_context=1 << 20, announce=False, freeze_gc=False) as gw:
        session = gw.open()
        path = session.base_url.removeprefix(gw.url) + "/" + endpoint
        answer = await http(gw.url, "POST", path, json.dumps(body).encode())
        assert answer.status < 500, answer.body
        if answer.status == 200:
            assert len(session.calls) == 1 and session.infra_error is None
        else:
            error = answer.json()["error"]
            assert answer.status in (400, 404) and error["message"], error
            assert untouched(session), error
