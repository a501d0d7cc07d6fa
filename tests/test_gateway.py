"""The recording gateway over real HTTP on loopback, driven by the official `openai` client.

Tests run on trio's real clock: the server's sockets and the engine's worker threads are real,
and the autojump clock would jump past them. Ordering comes from events and
`wait_all_tasks_blocked`, never from sleeps.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import openai
import pytest
import trio
import trio.testing

from _gateway import GREETING, LOOKUP_TOOL, KeepAlive, ScriptedEngine, http, tiny_server, tool_call
from dew.envs import Sampling
from dew.gateway import CHAT_FIELDS, COMPLETION_FIELDS, Gateway
from dew.gateway._answers import token_text
from dew.objectives.rl.sessions import Label, Session, Status, chains
from dew.serve import tokenizer

# The openai client leaves its stream's event iterator unclosed after [DONE] (it breaks out of
# the loop), and trio's finalizer warns about it when it is collected: the client's leak, not
# the gateway's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '.*' was garbage collected:ResourceWarning"
)


def gateway(engine, **kwargs) -> Gateway:
    kwargs.setdefault("max_context", 4096)
    kwargs.setdefault("max_tokens", 256)
    return Gateway(engine, announce=False, **kwargs)


@pytest.fixture
async def client():
    """Makes AsyncOpenAI clients of sessions, and closes them after the test."""
    made = []

    def make(session, **kwargs) -> openai.AsyncOpenAI:
        made.append(
            openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, **kwargs)
        )
        return made[-1]

    yield make
    for api in made:
        await api.close()


async def collect(stream) -> list:
    """A stream's chunks, the stream closed after."""
    async with stream:
        return [chunk async for chunk in stream]


def one_chain(session) -> bool:
    return len(chains(Session(Status.COMPLETED, session.calls, reward=0.0))) == 1


# --- token in / token out ------------------------------------------------------------------------


async def test_a_multi_turn_chat_with_tool_calls_merges_into_one_chain(client):
    engine = ScriptedEngine(
        [
            tool_call("lookup", {"key": "paris"}, content="Let me check."),
            tool_call("lookup", {"key": "rome", "deep": [1, 2]}),
            "Paris has 2.1M people.",
        ]
    )
    async with gateway(engine) as gw:
        session = gw.open()
        api = client(session)
        messages = [{"role": "user", "content": "How many live in Paris?"}]
        first = await api.chat.completions.create(
            model="m", messages=messages, tools=[LOOKUP_TOOL], tool_choice="auto"
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        (call,) = choice.message.tool_calls
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {
            "key": "paris"
        }
        # The client sends the assistant turn back as its SDK object, content and all.
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "2.1M"}]
        second = await api.chat.completions.create(
            model="m", messages=messages, tools=[LOOKUP_TOOL], parallel_tool_calls=False
        )
        (call2,) = second.choices[0].message.tool_calls
        # A client that re-serialises the arguments compactly and sends content null.
        compact = json.dumps(json.loads(call2.function.arguments), separators=(",", ":"))
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call2.id,
                        "type": "function",
                        "function": {"name": "lookup", "arguments": compact},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call2.id, "content": "2.8M"},
        ]
        third = await api.chat.completions.create(model="m", messages=messages, tools=[LOOKUP_TOOL])
        assert third.choices[0].message.content == "Paris has 2.1M people."
        assert third.choices[0].finish_reason == "stop"
    assert len(session.calls) == 3 and one_chain(session)
    for recorded, served in zip(session.calls, engine.served, strict=True):
        np.testing.assert_array_equal(recorded.prompt, served.prompt)
        np.testing.assert_array_equal(recorded.completion, served.completion)
        np.testing.assert_array_equal(recorded.logprobs, served.logprobs)


async def test_edited_histories_real_clients_send_still_match_the_gateways_turns(client):
    engine = ScriptedEngine(["", "first answer", "second answer", tool_call("lookup", {"k": 1})])
    async with gateway(engine) as gw:
        session = gw.open()
        api = client(session)
        messages = [{"role": "user", "content": "hi"}]
        empty = await api.chat.completions.create(model="m", messages=messages)
        assert empty.choices[0].message.content in ("", None)
        # The client drops the empty assistant turn and adds a user turn.
        messages.append({"role": "user", "content": "say something"})
        first = await api.chat.completions.create(model="m", messages=messages)
        # Stripped text, a mid-conversation system message, content as parts.
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": " first answer "}]},
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "again"},
        ]
        assert first.choices[0].message.content == "first answer"
        await api.chat.completions.create(model="m", messages=messages)
        messages += [
            {"role": "assistant", "content": "second answer"},
            {"role": "developer", "content": "Use the tool."},
        ]
        last = await api.chat.completions.create(
            model="m", messages=messages, tools=[LOOKUP_TOOL], tool_choice="required"
        )
        (call,) = last.choices[0].message.tool_calls
        # A client wrapping the arguments it could not parse: matched by the call id anyway.
        messages += [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"wrapped": "{k: 1}"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "v"},
        ]
        await api.chat.completions.create(
            model="m", messages=messages, tools=[LOOKUP_TOOL], tool_choice="required"
        )
    # The tools turn appears from the fourth call on, so calls 1-3 and 4-5 are two chains.
    calls = session.calls
    assert len(calls) == 5
    cut = chains(Session(Status.COMPLETED, calls, reward=0.0))
    assert [chain.calls for chain in cut] == [3, 2]


@pytest.mark.medium
async def test_recorded_tokens_and_logprobs_are_what_the_real_engine_sampled(client):
    server = tiny_server()
    async with server, gateway(server, max_tokens=12, max_context=128) as gw:
        session = gw.open()
        api = client(session)
        messages = [{"role": "user", "content": GREETING}]
        answers = []
        for turn in range(2):
            answer = await api.chat.completions.create(
                model="m", messages=messages, logprobs=True, top_logprobs=2, max_tokens=4
            )
            answers.append(answer)
            # Random bytes: the text the client sends back is not valid UTF-8's round trip,
            # so only the gateway's ids keep the chain.
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": str(turn)},
            ]
    assert len(session.calls) == 2 and one_chain(session)
    for call, answer in zip(session.calls, answers, strict=True):
        completion = call.completion
        reported = completion[:-1] if completion[-1] == tokenizer.IM_END else completion
        entries = answer.choices[0].logprobs.content
        assert len(entries) == len(reported)
        np.testing.assert_array_equal([e.logprob for e in entries], call.logprobs[: len(reported)])
        # Two were asked for: the engine's two most likely tokens at each position.
        for entry, (ids, values) in zip(entries, call.top_logprobs, strict=False):
            assert [t.token for t in entry.top_logprobs] == [
                token_text(tokenizer.BYTES.token_bytes(int(i))) for i in ids[:2]
            ]
            np.testing.assert_array_equal([t.logprob for t in entry.top_logprobs], values)
            assert entry.logprob <= values[0]
        assert answer.choices[0].message.content == tokenizer.decode(reported)
        assert answer.usage.completion_tokens == len(completion)
        assert answer.usage.prompt_tokens == len(call.prompt)
    assert session.calls[1].prompt[: len(session.calls[0].prompt)].tolist() == (
        session.calls[0].prompt.tolist()
    )


@pytest.mark.medium
async def test_streaming_and_non_streaming_agree_token_for_token(client):
    server = tiny_server()
    sampling = Sampling(seed=7)
    messages = [{"role": "user", "content": GREETING}]
    async with server, gateway(server, max_tokens=16, sampling=sampling, max_context=128) as gw:
        # One label, one call index: one key, so the engine draws the same tokens alone.
        plain_session, stream_session = gw.open(Label(1, 0, 0)), gw.open(Label(1, 0, 0))
        plain = await client(plain_session).chat.completions.create(
            model="m", messages=messages, logprobs=True, top_logprobs=3
        )
        stream = await client(stream_session).chat.completions.create(
            model="m",
            messages=messages,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = await collect(stream)
        # The legacy endpoint's top lists (logprobs=3) are the engine's too.
        legacy_session = gw.open()
        legacy = await client(legacy_session).completions.create(
            model="m", prompt="hi", logprobs=3, max_tokens=5
        )
    np.testing.assert_array_equal(
        plain_session.calls[0].completion, stream_session.calls[0].completion
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert text == plain.choices[0].message.content
    assert [e.logprob for e in streamed] == [e.logprob for e in plain.choices[0].logprobs.content]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in streamed] == [
        [(t.token, t.logprob) for t in e.top_logprobs] for e in plain.choices[0].logprobs.content
    ]
    assert all(len(e.top_logprobs) == 3 for e in streamed)
    # Keyed by the tokens' text, where ids whose bytes are no text alone share one key.
    top = legacy.choices[0].logprobs.top_logprobs
    reported = legacy_session.calls[0].top_logprobs
    assert len(top) == 5
    for alternatives, (ids, values) in zip(top, reported, strict=True):
        assert len(ids) == 3 and set(alternatives.values()) <= set(values.tolist())
        assert max(alternatives.values()) == values[0]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        plain.choices[0].finish_reason
    )


async def test_streamed_tool_calls_equal_the_non_streamed_answer(client):
    reply = tool_call("lookup", {"key": "x"}, content="Checking.")
    async with gateway(ScriptedEngine([reply])) as gw:
        api = client(gw.open())
        body = dict(model="m", messages=[{"role": "user", "content": "q"}], tools=[LOOKUP_TOOL])
        plain = (await api.chat.completions.create(**body)).choices[0]
        stream = await api.chat.completions.create(**body, stream=True)
        chunks = await collect(stream)
    deltas = [c.choices[0].delta for c in chunks]
    (streamed_call,) = [call for d in deltas for call in d.tool_calls or ()]
    assert "".join(d.content or "" for d in deltas) == plain.message.content
    assert streamed_call.function.name == plain.message.tool_calls[0].function.name
    assert streamed_call.function.arguments == plain.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "reply",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "lookup"',
        '<tool_call>{"name": "lookup"}</tool_call> and <tool_call>',
    ],
)
async def test_an_unparseable_tool_call_is_answered_as_content(reply, client):
    async with gateway(ScriptedEngine([reply])) as gw:
        api = client(gw.open())
        answer = await api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}], tools=[LOOKUP_TOOL]
        )
    assert answer.choices[0].message.content == reply
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "stop"


async def test_stop_strings_cut_the_answer_and_the_record_after_the_stop(client):
    engine = ScriptedEngine(["alpha STOP beta"])
    async with gateway(engine) as gw:
        session = gw.open()
        answer = await client(session).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}], stop=["STOP", "zzz"]
        )
    assert answer.choices[0].message.content == "alpha "
    assert answer.choices[0].finish_reason == "stop"
    assert tokenizer.decode(session.calls[0].completion) == "alpha STOP"


async def test_completions_and_models_endpoints(client):
    engine = ScriptedEngine(["world", "again", "done"])
    async with gateway(engine, model="policy") as gw:
        session = gw.open()
        api = client(session)
        models = await api.models.list()
        assert [m.id for m in models.data] == ["policy"]
        first = await api.completions.create(model="m", prompt="hello ", logprobs=1, max_tokens=5)
        assert (first.choices[0].text, first.choices[0].finish_reason) == ("world", "length")
        assert first.choices[0].logprobs.token_logprobs == session.calls[0].logprobs.tolist()
        # A prompt extending the prompt and completion text reuses their exact ids.
        stream = await api.completions.create(model="m", prompt="hello world, and", stream=True)
        chunks = await collect(stream)
        # The second answer ended at its stop token, which its text does not hold: a prompt
        # extending that text is a new chain.
        await api.completions.create(model="m", prompt="hello world, andagain.")
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == "again"
    assert chunks[-1].choices[0].finish_reason == "stop"
    cut = chains(Session(Status.COMPLETED, session.calls, reward=0.0))
    assert [chain.calls for chain in cut] == [2, 1]


async def test_each_call_records_the_thread_its_client_names(client):
    """A request's X-Session-ID header (verifiers sends each agent trace's id so) is recorded
    with its call, on both endpoints; a call without one records None."""
    engine = ScriptedEngine(["a", "b", "c"])
    async with gateway(engine) as gw:
        session = gw.open()
        api = client(session)
        user = [{"role": "user", "content": "hi"}]
        await api.chat.completions.create(
            model="m", messages=user, extra_headers={"X-Session-ID": "trace-1"}
        )
        await api.completions.create(
            model="m", prompt="hello", extra_headers={"X-Session-ID": "trace-2"}
        )
        await api.chat.completions.create(model="m", messages=user)
    assert session.threads == ("trace-1", "trace-2", None)


async def test_every_standard_field_real_clients_send_is_accepted(client):
    engine = ScriptedEngine(['{"city": "Paris"}'])
    schema = {
        "name": "place",
        "strict": True,
        "schema": {
            "type": "object",
            "title": "Place",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    async with gateway(engine, sampling=Sampling(temperature=0.7, top_k=40)) as gw:
        api = client(gw.open())
        answer = await api.chat.completions.create(
            model="m",
            messages=[
                {"role": "developer", "content": "Answer in JSON."},
                {"role": "user", "content": [{"type": "text", "text": "Where?"}], "name": "u"},
            ],
            tools=[LOOKUP_TOOL],
            tool_choice={"type": "function", "function": {"name": "lookup"}},
            parallel_tool_calls=False,
            response_format={"type": "json_schema", "json_schema": schema},
            max_completion_tokens=50,
            max_tokens=60,
            temperature=0.0,
            top_p=0.1,
            seed=123,
            stop="\n\n",
            presence_penalty=1.0,
            frequency_penalty=1.0,
            logit_bias={"50": 10},
            user="someone",
            metadata={"run": "x"},
            store=False,
            service_tier="auto",
            reasoning_effort="low",
            modalities=["text"],
            n=1,
            logprobs=False,
        )
        stream = await api.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Where?"}],
            stream=False,
            extra_headers={"accept": "text/event-stream"},
        )
        streamed = await api.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Where?"}],
            stream=True,
            extra_headers={"accept": "application/json"},
        )
        chunks = await collect(streamed)
    assert answer.choices[0].message.content == '{"city": "Paris"}'
    # The request's temperature and top_p changed nothing: the gateway's sampling is the policy.
    assert engine.sampling[0] == {"temperature": 0.7, "top_k": 40, "top_p": None}
    # Streaming is the body's choice, whatever the Accept header says.
    assert stream.choices[0].message.content == '{"city": "Paris"}'
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == '{"city": "Paris"}'


# --- errors --------------------------------------------------------------------------------------


def _chat(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


BAD = [
    ("POST", "chat/completions", b"{not json", 400, None),
    ("POST", "chat/completions", b"[1, 2]", 400, None),
    ("POST", "chat/completions", json.dumps({"model": "m"}).encode(), 400, "messages"),
    ("POST", "chat/completions", _chat(messages="hi"), 400, "messages"),
    ("POST", "chat/completions", _chat(messages=[]), 400, "messages"),
    ("POST", "chat/completions", _chat(max_tokens="ten"), 400, "max_tokens"),
    ("POST", "chat/completions", _chat(max_tokens=0), 400, "max_tokens"),
    ("POST", "chat/completions", _chat(n=2), 400, "n"),
    ("POST", "chat/completions", _chat(frobnicate=True), 400, "frobnicate"),
    (
        "POST",
        "chat/completions",
        _chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
    ),
    (
        "POST",
        "chat/completions",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                }
            ]
        ),
        400,
        "messages[0].content[0]",
    ),
    ("POST", "chat/completions", _chat(tools=[{"type": "code_interpreter"}]), 400, "tools[0].type"),
    (
        "POST",
        "chat/completions",
        _chat(tool_choice={"type": "function", "function": {"name": "nope"}}),
        400,
        "tool_choice.function.name",
    ),
    ("POST", "chat/completions", _chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (
        "POST",
        "completions",
        json.dumps({"model": "m", "prompt": "x", "best_of": 3}).encode(),
        400,
        "best_of",
    ),
    ("POST", "completions", json.dumps({"model": "m", "prompt": [999]}).encode(), 400, "prompt"),
    ("GET", "chat/completions", b"", 405, None),
    ("POST", "models", b"", 405, None),
    ("POST", "embeddings", _chat(), 404, None),
]


async def test_bad_requests_get_an_openai_error_naming_the_problem_and_record_nothing():
    engine = ScriptedEngine()
    async with gateway(engine) as gw:
        session = gw.open()
        prefix = session.base_url.removeprefix(gw.url)
        for method, endpoint, body, status, param in BAD:
            response = await http(gw.url, method, f"{prefix}/{endpoint}", body)
            assert response.status == status, (endpoint, body, response.body)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert error["param"] == param, (body, error)
            assert response.headers["x-should-retry"] == "false"
            if status == 405:
                assert response.headers["allow"] in ("GET", "POST")
    assert session.calls == () and engine.started == 0


async def test_unknown_closed_oversize_and_too_long_requests(client):
    engine = ScriptedEngine()
    async with gateway(engine, max_body=4096, max_context=300) as gw:
        session = gw.open()
        prefix = session.base_url.removeprefix(gw.url)
        unknown = await http(gw.url, "POST", "/" + "x" * 43 + "/v1/chat/completions", _chat())
        assert unknown.status == 404 and unknown.json()["error"]["code"] == "session_not_found"
        big = await http(gw.url, "POST", f"{prefix}/chat/completions", b" " * 5000)
        assert big.status == 413
        streamed_big = await http(
            gw.url,
            "POST",
            f"{prefix}/chat/completions",
            b" " * 5000,
            headers={"transfer-encoding": "chunked", "content-length": ""},
        )
        assert streamed_big.status in (400, 413)
        long = _chat(messages=[{"role": "user", "content": "x" * 400}])
        too_long = await http(gw.url, "POST", f"{prefix}/chat/completions", long)
        assert too_long.status == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        assert session.truncation == "context" and session.calls == ()
        session.close("finished")
        closed = await http(gw.url, "POST", f"{prefix}/chat/completions", _chat())
        assert closed.status == 410 and closed.headers["x-should-retry"] == "false"
        with pytest.raises(openai.APIStatusError) as raised:
            await client(session).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        assert raised.value.status_code == 410
    assert engine.started == 0


async def test_closing_a_session_cancels_its_engine_call_and_answers_410(client):
    engine = ScriptedEngine(delay=None)
    async with gateway(engine) as gw:
        session = gw.open()
        answered = {}

        async def ask():
            try:
                await client(session, max_retries=0).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
            except openai.APIStatusError as error:
                answered["status"] = error.status_code

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            while session.in_flight == 0:
                await trio.testing.wait_all_tasks_blocked()
            session.close("cancelled")
    assert answered == {"status": 410}
    assert engine.cancelled == 1 and session.calls == ()


async def test_a_retried_call_is_recorded_once():
    engine = ScriptedEngine(["one", "two", "three"])
    async with gateway(engine) as gw:
        session = gw.open()
        prefix = session.base_url.removeprefix(gw.url)
        body = _chat()
        first = await http(gw.url, "POST", f"{prefix}/chat/completions", body)
        assert first.status == 200
        # The client never got that answer: it retries the same body.
        retry = await http(
            gw.url,
            "POST",
            f"{prefix}/chat/completions",
            body,
            headers={"x-stainless-retry-count": "1"},
        )
        assert retry.json()["choices"][0]["message"]["content"] == "two"
        # A harness asking the same thing again on purpose is two calls.
        again = await http(gw.url, "POST", f"{prefix}/chat/completions", body)
        assert again.status == 200
    assert [tokenizer.decode(c.completion) for c in session.calls] == [
        "two<|im_end|>",
        "three<|im_end|>",
    ]


async def test_a_call_whose_client_timed_out_is_not_recorded_and_its_retry_is(client):
    engine = ScriptedEngine(["late", "in time"], delay=None)
    async with gateway(engine) as gw:
        session = gw.open()
        api = client(session, max_retries=1, timeout=0.5)

        async def ask():
            return await api.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            while engine.started == 0:
                await trio.testing.wait_all_tasks_blocked()
            # The first attempt hangs until the client gives up, which cancels its engine
            # call; the retry is answered at once.
            engine.delay = 0.0
            while engine.cancelled == 0:
                await trio.sleep(0.05)
    assert engine.started == 2
    assert [tokenizer.decode(c.completion) for c in session.calls] == ["in time<|im_end|>"]


# --- security and load ---------------------------------------------------------------------------


async def test_sessions_are_unguessable_isolated_and_served_on_loopback(client):
    engine = ScriptedEngine(["a"])
    async with gateway(engine) as gw:
        assert gw.url.startswith("http://127.0.0.1:")
        first, second = gw.open(), gw.open()
        token = first.base_url.removeprefix(gw.url + "/").removesuffix("/v1")
        assert len(token) >= 43  # 32 random bytes
        assert first.base_url != second.base_url
        await client(first).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        for path in [
            f"/{token[:-1]}/v1/chat/completions",
            f"/{token}/../{token}/v1/chat/completions",
            f"/{token}/v1/../v1/chat/completions",
            "/v1/chat/completions",
        ]:
            response = await http(gw.url, "POST", path, _chat())
            assert response.status == 404, path
    assert len(first.calls) == 1 and second.calls == ()


@pytest.mark.medium
async def test_64_sessions_of_20_calls_each_with_slow_clients_beside_them():
    engine = ScriptedEngine(["fine"])
    async with gateway(engine) as gw:
        sessions = [gw.open() for _ in range(64)]
        slow = gw.open()
        prefix = slow.base_url.removeprefix(gw.url)
        host, port = gw.url.removeprefix("http://").rsplit(":", 1)

        async def stall():
            # Headers promising a body that never comes.
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                await stream.send_all(
                    f"POST {prefix}/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    "content-length: 1000\r\n\r\n{".encode()
                )
                await trio.sleep_forever()

        async def harness(session):
            # A keep-alive connection per session: 1,280 calls through an SDK client would
            # time the client more than the gateway.
            path = session.base_url.removeprefix(gw.url) + "/chat/completions"
            connection = await KeepAlive.open(gw.url)
            async with connection.stream:
                messages = [{"role": "user", "content": "go"}]
                for _ in range(20):
                    status, answer = await connection.post(
                        path, {"model": "m", "messages": messages}
                    )
                    assert status == 200
                    messages += [
                        answer["choices"][0]["message"],
                        {"role": "user", "content": "more"},
                    ]

        async with trio.open_nursery() as stalls:
            for _ in range(4):
                stalls.start_soon(stall)
            async with trio.open_nursery() as nursery:
                for session in sessions:
                    nursery.start_soon(harness, session)
            stalls.cancel_scope.cancel()
    assert [len(s.calls) for s in sessions] == [20] * 64
    assert engine.started == 64 * 20 and slow.calls == ()
    assert all(one_chain(s) for s in sessions)


def test_the_docs_say_what_every_standard_field_does():
    docs = (pathlib.Path(__file__).parent.parent / "docs" / "gateway.md").read_text()
    for name in CHAT_FIELDS:
        assert f"| `{name}` |" in docs, name
    for name in COMPLETION_FIELDS:
        assert f"`{name}`" in docs, name
