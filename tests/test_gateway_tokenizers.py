"""The recording gateway under a tokenizer other than the byte one: a byte-level BPE tokenizer
(`HuggingFaceTokenizer`) trained in the test, behind the official `openai` client."""

from __future__ import annotations

import functools

import jax
import numpy as np
import openai
import pytest

from _bpe import train_bpe
from _gateway import LOOKUP_TOOL, ScriptedEngine, tool_call
from dew import models
from dew.gateway import Gateway
from dew.objectives.rl.sessions import Session, Status, chains
from dew.serve import RolloutServer
from dew.serve.tokenizer import BYTES, HuggingFaceTokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer.from_file(train_bpe(tmp_path_factory.mktemp("bpe") / "tok.json"))


@functools.cache
def bpe_server_parts(vocab: int):
    config = models.TransformerConfig(
        vocab=vocab, d_model=32, heads=2, layers=1, d_ff=64, max_len=128
    )
    return config, models.init(jax.random.key(0), config)


async def test_a_tool_using_chat_under_a_bpe_tokenizer_merges_into_one_chain(bpe):
    engine = ScriptedEngine(
        [tool_call("lookup", {"key": "cat"}, content="the cat"), "the answer is 42"],
        tokenizer=bpe,
    )
    async with Gateway(engine, max_context=4096, announce=False) as gateway:
        assert gateway.tokenizer is bpe  # the engine's own
        session = gateway.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            messages = [{"role": "user", "content": "what is 6 x 7?"}]
            first = await api.chat.completions.create(
                model="m", messages=messages, tools=[LOOKUP_TOOL]
            )
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls"
            assert message.content == "the cat" and message.tool_calls[0].function.name == "lookup"
            messages += [
                message,
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"},
            ]
            second = await api.chat.completions.create(
                model="m", messages=messages, tools=[LOOKUP_TOOL]
            )
    assert second.choices[0].message.content == "the answer is 42"
    calls = session.calls
    assert [c.completion.tolist() for c in calls] == [c.completion.tolist() for c in engine.served]
    # The second prompt extends the first prompt and the ids sampled for it: one chain.
    head = np.concatenate([calls[0].prompt, calls[0].completion])
    assert np.array_equal(calls[1].prompt[: len(head)], head)
    assert len(chains(Session(Status.COMPLETED, calls))) == 1
    # The tool's result and the user's question are the BPE tokenizer's encodings.
    tool_turn = bpe.encode_turn({"role": "tool", "content": "42"})
    start = len(head) + len(bpe.turn_suffix())
    assert np.array_equal(calls[1].prompt[start : start + len(tool_turn)], tool_turn)
    assert bpe.decode(calls[0].prompt).endswith(
        "<|im_start|>user\nwhat is 6 x 7?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.medium
async def test_a_real_engine_with_a_bpe_tokenizer_records_what_it_answered(bpe):
    config, params = bpe_server_parts(bpe.vocab_size)
    server = RolloutServer(config, params, slots=2, tokenizer=bpe)
    question = [{"role": "user", "content": "hello world"}]
    async with server, Gateway(server, max_context=128, max_tokens=6, announce=False) as gateway:
        session = gateway.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            first = await api.chat.completions.create(
                model="m", messages=question, logprobs=True, top_logprobs=1
            )
            again = [*question, first.choices[0].message, {"role": "user", "content": "hello"}]
            await api.chat.completions.create(model="m", messages=again)
    calls = session.calls
    assert np.array_equal(calls[0].prompt, bpe.encode_chat(question))
    completion = calls[0].completion
    reported = completion[:-1] if completion[-1] == bpe.eos_id else completion
    assert first.choices[0].message.content == bpe.decode(reported)
    logprobs = [entry.logprob for entry in first.choices[0].logprobs.content]
    np.testing.assert_allclose(logprobs, calls[0].logprobs[: len(reported)], rtol=1e-6)
    assert len(chains(Session(Status.COMPLETED, calls))) == 1


async def test_a_tokenizer_that_disagrees_with_the_engine_is_refused(bpe):
    config, params = bpe_server_parts(bpe.vocab_size)
    server = RolloutServer(config, params, slots=2, tokenizer=bpe)
    with pytest.raises(ValueError, match="engine 0's tokenizer"):
        Gateway(server, max_context=128, tokenizer=BYTES)
    with pytest.raises(ValueError, match="Tokenizer"):
        Gateway(server, max_context=128, tokenizer="bytes")
