"""The recording gateway against a demanding user of the official `openai` client, continued:
log-probs of characters split over tokens, the context error's culprit on each endpoint, a
session that closes while a call of it is answered, and bad inputs.

Real HTTP on loopback, the official client, trio's real clock; ordering comes from events, never
from sleeps.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import trio

from _bpe import train_bpe
from _gateway import LOOKUP_TOOL, ScriptedEngine
from _templates import template_tokenizer
from dew.objectives.rl.sessions import Call, Label
from dew.serve.tokenizer import BYTES, HuggingFaceTokenizer
from test_gateway import gateway
from test_hostile_gateway import HeldTokenizer

# The openai client leaves its stream's event iterator unclosed (see test_gateway.py).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '.*' was garbage collected:ResourceWarning"
)

# Two-, three- and four-byte characters: a byte-level tokenizer trained on ASCII splits each
# over one token a byte.
SPLIT = "café ✓ 😀 ok"
LOGPROBS = "message.output_text.logprobs"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer.from_file(train_bpe(tmp_path_factory.mktemp("bpe") / "tok.json"))


@pytest.fixture(params=["bytes", "bpe", "qwen-template"])
def tokenizer(request, bpe):
    if request.param == "bytes":
        return BYTES
    if request.param == "bpe":
        return bpe
    return template_tokenizer("qwen2.5")


def api(session) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


async def collect(stream) -> list:
    async with stream:
        return [event async for event in stream]


class RankingEngine(ScriptedEngine):
    """A scripted engine that reports, at each position, the sampled token, then `other`, then
    `padded` (an id past the tokenizer's vocabulary, a model's padded row), as most likely."""

    def __init__(self, replies, *, tokenizer, other: int, padded: int):
        super().__init__(replies, tokenizer=tokenizer)
        self.other, self.padded = other, padded

    async def generate(self, prompt, *, max_tokens, top_logprobs=0, **options) -> Call:
        call = await super().generate(prompt, max_tokens=max_tokens, **options)
        if not top_logprobs:
            return call
        top = [
            (np.array([t, self.other, self.padded], np.int32), np.array([lp, lp - 1, lp - 2]))
            for t, lp in zip(call.completion.tolist(), call.logprobs.tolist(), strict=True)
        ]
        return Call(call.prompt, call.completion, call.logprobs, call.version, None, top)


def expected_bytes(tokenizer, token: int) -> bytes:
    """A token's own bytes, read independently of the gateway: the byte tokenizer's ids below
    256 are bytes; a byte-level BPE's vocabulary writes each byte as one character of
    `ByteLevel.alphabet()`, in the order GPT-2's `bytes_to_unicode` gives them."""
    if tokenizer is BYTES:
        return bytes([token])
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    characters = {chr(b): b for b in printable}
    moved = [b for b in range(256) if b not in printable]
    characters |= {chr(256 + n): b for n, b in enumerate(moved)}
    return bytes(characters[c] for c in tokenizer._tokenizer.id_to_token(token))


def spelled(raw: bytes) -> str:
    """OpenAI's text of a token: its UTF-8, or `bytes:` and its bytes escaped."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


# --- 1: the bytes of a token that is part of a character -------------------------------------


async def test_log_probs_report_each_tokens_own_bytes_where_characters_split(tokenizer):
    # The byte-level tokenizers write "é" as two tokens and "😀" as four: each one once
    # reported the bytes of U+FFFD, and the tokens' bytes did not join into the answer.
    ids = tokenizer.encode(SPLIT)
    partial = next(t for t in ids.tolist() if "\ufffd" in tokenizer.decode([t]))
    engine = RankingEngine(
        [SPLIT], tokenizer=tokenizer, other=partial, padded=tokenizer.vocab_size + 3
    )
    async with gateway(engine, tokenizer=tokenizer) as gw:
        session = gw.open()
        async with api(session) as client:
            answer = await client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=2)
            chunks = await collect(
                await client.chat.completions.create(
                    **CHAT,
                    logprobs=True,
                    top_logprobs=2,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = {"model": "m", "prompt": "hi", "logprobs": 2, "max_tokens": 64}
            legacy = await client.completions.create(**text)
            legacy_chunks = await collect(await client.completions.create(**text, stream=True))
            response = await client.responses.create(
                model="m", input="hi", include=[LOGPROBS], top_logprobs=2
            )
            events = await collect(
                await client.responses.create(
                    model="m", input="hi", include=[LOGPROBS], top_logprobs=2, stream=True
                )
            )
    reported = ids.tolist()  # the reply but its stop token
    own = [expected_bytes(tokenizer, t) for t in reported]
    assert b"".join(own) == SPLIT.encode()
    other = expected_bytes(tokenizer, partial)

    def check(entries) -> None:
        assert [bytes(e.bytes) for e in entries] == own
        assert [e.token for e in entries] == [spelled(raw) for raw in own]
        for entry, raw in zip(entries, own, strict=True):
            # The padded id is left out: it is no text.
            assert [bytes(t.bytes) for t in entry.top_logprobs] == [raw, other]
            assert [t.token for t in entry.top_logprobs] == [spelled(raw), spelled(other)]

    content = answer.choices[0].logprobs.content
    check(content)
    assert b"".join(bytes(e.bytes) for e in content) == answer.choices[0].message.content.encode()
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    check(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SPLIT
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    part = response.output[0].content[0]
    check(part.logprobs)
    assert response.output_text == SPLIT
    check([e for event in events if event.type.endswith("text.delta") for e in event.logprobs])
    # The legacy endpoint: each token's text, and where its text starts in the answer (a
    # token inside a character starts where that character does), as its stream says.
    logprobs = legacy.choices[0].logprobs
    assert legacy.choices[0].text == SPLIT
    assert logprobs.tokens == [spelled(raw) for raw in own]
    starts = np.cumsum([0] + [len(raw) for raw in own])[:-1]
    offsets = [len(SPLIT.encode()[:start].decode(errors="ignore")) for start in starts]
    assert logprobs.text_offset == offsets
    assert [list(top) for top in logprobs.top_logprobs] == [
        [spelled(raw), spelled(other)] if raw != other else [spelled(raw)] for raw in own
    ]
    chunked = [c.choices[0].logprobs for c in legacy_chunks if c.choices[0].logprobs]
    assert [t for lp in chunked for t in lp.tokens] == logprobs.tokens
    assert [o for lp in chunked for o in lp.text_offset] == offsets


async def test_log_probs_of_a_reply_cut_at_a_stop_string_cover_the_answer_only(bpe):
    # The tokens from the stop string on were sampled and are recorded, but their log-probs
    # were reported too, beyond the text answered (OpenAI reports none of a stop string's).
    reply = "naïve 😀 done. tail"
    engine = ScriptedEngine([reply], tokenizer=bpe)
    async with gateway(engine, tokenizer=bpe) as gw:
        session = gw.open()
        async with api(session) as client:
            chat = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stop": [". "]}
            answer = await client.chat.completions.create(**chat, logprobs=True)
            chunks = await collect(
                await client.chat.completions.create(**chat, logprobs=True, stream=True)
            )
            legacy = await client.completions.create(
                model="m", prompt="q", stop=". ", logprobs=0, max_tokens=64
            )
            whole = await client.chat.completions.create(**{**chat, "stop": ["😀"]}, logprobs=True)
    answered = "naïve 😀 done"
    assert answer.choices[0].message.content == answered
    entries = answer.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries) == answered.encode()
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.bytes for e in streamed] == [e.bytes for e in entries]
    assert legacy.choices[0].text == answered
    assert legacy.choices[0].logprobs.tokens == [e.token for e in entries]
    assert whole.choices[0].message.content == "naïve "
    assert b"".join(bytes(e.bytes) for e in whole.choices[0].logprobs.content) == b"na\xc3\xafve "
    # What was sampled through the stop string is what is recorded, for each call.
    for call in session.calls[:3]:
        assert bpe.decode(call.completion).startswith("naïve 😀 done.")


async def test_a_top_list_holding_an_id_past_the_vocabulary_is_answered_without_it():
    # A model's vocabulary may be padded past its tokenizer's (the engine checks only that the
    # tokenizer fits): such an id among the most likely once failed the answer's decode, a 500
    # that booked the session as an infrastructure fault.
    engine = RankingEngine(["ok"], tokenizer=BYTES, other=ord("x"), padded=BYTES.vocab_size)
    async with gateway(engine) as gw:
        session = gw.open()
        async with api(session) as client:
            answer = await client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=3)
            legacy = await client.completions.create(model="m", prompt="hi", logprobs=3)
    tops = [[t.token for t in e.top_logprobs] for e in answer.choices[0].logprobs.content]
    assert tops == [["o", "x"], ["k", "x"]]
    assert [list(top) for top in legacy.choices[0].logprobs.top_logprobs] == tops
    assert len(session.calls) == 2 and session.infra_error is None


# --- 2: the context error names each endpoint's own parameter --------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
async def test_the_context_error_names_each_endpoints_own_parameter(endpoint):
    # It named `messages` on all three: /v1/completions' prompt is `prompt`, /v1/responses'
    # is `input`.
    engine = ScriptedEngine()
    long = "x" * 300
    async with gateway(engine, max_context=200) as gw:
        session = gw.open()
        async with api(session) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                if endpoint == "chat":
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": long}]
                    )
                elif endpoint == "completions":
                    await client.completions.create(model="m", prompt=long)
                else:
                    await client.responses.create(model="m", input=long)
    param = {"chat": "messages", "completions": "prompt", "responses": "input"}[endpoint]
    error = raised.value
    assert error.param == param and error.code == "context_length_exceeded"
    assert error.body["type"] == "invalid_request_error"
    assert f"'{param}'" in error.body["message"] and "200 tokens" in error.body["message"]
    assert session.truncation == "context" and session.calls == () and engine.started == 0


async def test_a_responses_input_that_spells_a_special_token_is_named_as_input():
    # Under a checkpoint's template the check named `messages[1]`, a field the Responses
    # request does not have.
    tokenizer = template_tokenizer("qwen2.5")
    engine = ScriptedEngine(tokenizer=tokenizer)
    async with gateway(engine, tokenizer=tokenizer) as gw:
        session = gw.open()
        async with api(session) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                await client.responses.create(
                    model="m", instructions="Be brief.", input="hi<|im_end|>"
                )
    assert raised.value.param == "input"
    assert "'input' (messages[1] of the chat" in raised.value.body["message"]
    assert session.calls == () and engine.started == 0


# --- 3: a session that closes while a call of it is answered ---------------------------------


class AnsweringEngine(ScriptedEngine):
    """A scripted engine that sets `answered` as it returns a call, with no checkpoint after:
    whatever waits on it runs before the gateway's request task goes on."""

    def __init__(self, replies):
        super().__init__(replies)
        self.answered = trio.Event()

    async def generate(self, prompt, **options) -> Call:
        call = await super().generate(prompt, **options)
        self.answered.set()
        return call


async def ask(client, endpoint: str) -> None:
    if endpoint == "chat":
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    elif endpoint == "completions":
        await client.completions.create(model="m", prompt="q")
    else:
        await client.responses.create(model="m", input="q")


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
async def test_a_call_answered_as_its_session_closes_is_refused_not_recorded_after_it(endpoint):
    # The engine answered, then the session closed (its rollout cancelled) and its record was
    # handed over, before the gateway recorded the call: the call went into the closed
    # session's record after the handover, lost to it, and its client was answered 200.
    engine = AnsweringEngine(["ok"])
    async with gateway(engine) as gw:
        session = gw.open(Label(4, 1, 0))
        handed_over = {}
        async with api(session) as client, trio.open_nursery() as nursery:
            refused = {}

            async def call() -> None:
                with pytest.raises(openai.APIStatusError) as raised:
                    await ask(client, endpoint)
                refused["error"] = raised.value

            nursery.start_soon(call)
            await engine.answered.wait()
            session.close("cancelled")
            handed_over["calls"] = session.calls
    error = refused["error"]
    assert error.status_code == 410 and error.code == "session_closed"
    assert "group 4 sample 1 attempt 0" in error.body["message"]
    assert "not recorded" in error.body["message"]
    assert len(engine.served) == 1
    assert handed_over["calls"] == () and session.calls == ()


class InstantEngine(ScriptedEngine):
    """A scripted engine that answers without a checkpoint (a cached answer): a cancel of its
    call that comes before it starts does not stop it."""

    async def generate(self, prompt, *, max_tokens, stop=(), key=None, **sampling) -> Call:
        self.started += 1
        ids = np.concatenate([self.tokenizer.encode("ok"), [self.tokenizer.eos_id]])
        call = Call(np.asarray(prompt, np.int32), ids.astype(np.int32), np.zeros(3), 0)
        self.served.append(call)
        return call


async def test_a_large_request_whose_session_closes_while_it_renders_is_refused():
    # A large body is rendered in a worker thread after its session admitted it; the session
    # closed meanwhile, and an engine that answers without a checkpoint answered through the
    # cancel: the call was recorded into the closed session.
    held = HeldTokenizer("FIRST")
    engine = InstantEngine()
    async with gateway(engine, tokenizer=held, max_context=200_000) as gw:
        session = gw.open(Label(2, 0, 1))
        async with api(session) as client, trio.open_nursery() as nursery:
            refused = {}

            async def call() -> None:
                content = "FIRST " + "x" * (70 << 10)
                with pytest.raises(openai.APIStatusError) as raised:
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": content}]
                    )
                refused["status"] = raised.value.status_code

            nursery.start_soon(call)
            await trio.to_thread.run_sync(held.entered.wait, 10)
            session.close("cancelled")
            held.release.set()
    assert refused == {"status": 410}
    assert session.calls == ()


# --- bad inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "fields", "param", "says"),
    [
        # Out of OpenAI's bounds: once ignored and answered 200.
        ("chat", {"temperature": 5}, "temperature", "[0, 2]"),
        ("chat", {"temperature": -0.5}, "temperature", "[0, 2]"),
        ("chat", {"top_p": 1.5}, "top_p", "[0, 1]"),
        ("chat", {"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
        ("chat", {"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
        ("completions", {"temperature": 2.5}, "temperature", "[0, 2]"),
        ("responses", {"temperature": 9}, "temperature", "[0, 2]"),
        ("responses", {"top_p": -1}, "top_p", "[0, 1]"),
        # No choice is not an unsupported number of choices.
        ("chat", {"n": 0}, "n", ">= 1"),
        # A tool must be called, and there is none: once answered with plain text.
        ("chat", {"tool_choice": "required"}, "tool_choice", "'tools' is empty"),
        ("responses", {"tool_choice": "required"}, "tool_choice", "'tools' is empty"),
        # A function choice without its function: once "tool_choice of type 'function' is not
        # supported", which it is.
        (
            "chat",
            {"tools": [LOOKUP_TOOL], "tool_choice": {"type": "function"}},
            "tool_choice.function",
            "naming the tool",
        ),
        # Lists asked for that would not be reported: once answered 200 without them.
        ("chat", {"top_logprobs": 3}, "top_logprobs", "needs 'logprobs'"),
        # Checked only with the include that asks for log-probs: once answered 200 without it.
        ("responses", {"top_logprobs": 50}, "top_logprobs", "[0, 20]"),
        ("responses", {"include": [3]}, "include[0]", "a string"),
        ("responses", {"max_tool_calls": 0}, "max_tool_calls", ">= 1"),
        # Held already; here so that the review's list of bad inputs is checked in one place.
        ("chat", {"n": 2}, "n", "must be 1"),
        ("chat", {"max_tokens": -1}, "max_tokens", ">= 1"),
        ("completions", {"max_tokens": -1}, "max_tokens", ">= 1"),
        ("responses", {"max_output_tokens": -1}, "max_output_tokens", ">= 1"),
        ("chat", {"messages": []}, "messages", "at least one message"),
        ("chat", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string"),
    ],
)
@pytest.mark.medium
async def test_bad_inputs_are_400_naming_the_field_and_leave_the_session_alone(
    endpoint, fields, param, says
):
    engine = ScriptedEngine()
    async with gateway(engine) as gw:
        session = gw.open()
        async with api(session) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                if endpoint == "chat":
                    await client.chat.completions.create(**{**CHAT, **fields})
                elif endpoint == "completions":
                    await client.completions.create(model="m", prompt="hi", **fields)
                else:
                    await client.responses.create(model="m", input="hi", **fields)
            assert raised.value.param == param and says in raised.value.body["message"]
            assert raised.value.body["type"] == "invalid_request_error"
            # The session goes on as if the request had not come.
            await client.chat.completions.create(**CHAT, temperature=2, top_p=0)
    assert len(session.calls) == 1 and session.truncation is None and engine.started == 1
