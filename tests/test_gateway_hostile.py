"""The gateway against hostile clients: bodies no schema foresaw, slow sockets, runaway sizes and
another session's key. Whatever a client sends, it gets a 4xx naming the problem, nothing is
recorded for it and its session is left as it was; other sessions are served meanwhile.

Tests run on trio's real clock over loopback (the server's sockets are real); the timeouts the
slow-client tests wait out are configured small, and what they assert is what the server did,
never how long it took.
"""

from __future__ import annotations

import json
import threading

import hypothesis
import hypothesis.strategies as st
import openai
import pytest
import trio
import trio.testing

from _gateway import LOOKUP_TOOL, ScriptedEngine, http, tool_call
from dew.envs import Sampling
from dew.gateway import Gateway
from dew.gateway._schema import MAX_DEPTH
from dew.objectives.rl.sessions import Label
from dew.serve.tokenizer import ByteTokenizer

# The openai client leaves its stream's event iterator unclosed after [DONE] (see test_gateway.py).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '.*' was garbage collected:ResourceWarning"
)


def gateway(engine, **kwargs) -> Gateway:
    kwargs.setdefault("max_context", 1 << 20)
    kwargs.setdefault("max_tokens", 16)
    return Gateway(engine, announce=False, freeze_gc=False, **kwargs)


DEEP = "@deep"


def nested(depth: int) -> str:
    """JSON text of a value `depth` arrays and objects deep (built as text: the standard
    library's encoder cannot write it)."""
    opening = "".join("[" if level % 2 else '{"x": ' for level in range(depth))
    closing = "".join("]" if level % 2 else "}" for level in reversed(range(depth)))
    return opening + "null" + closing


def deepen(body: bytes, depth: int) -> bytes:
    """`body` with its `"@deep"` string replaced by a value `depth` levels deep."""
    return body.replace(json.dumps(DEEP).encode(), nested(depth).encode())


def chat(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def response(**fields) -> bytes:
    return json.dumps({"model": "m", "input": "hi", **fields}).encode()


TOOL = {"type": "function", "function": {"name": "f", "parameters": DEEP}}


def untouched(session) -> bool:
    """Whether nothing was recorded or booked against the session."""
    return (
        session.calls == ()
        and session.infra_error is None
        and session.truncation is None
        and session.closed is None
        and session.requests == 0
    )


# --- item 9: no client input is a server error ---------------------------------------------------

HOSTILE = [
    # Token ids past int32 and past the vocabulary: once a 500 and an infrastructure fault.
    ("completions", completion(prompt=[5000000000]), "prompt", "prompt[0] is 5000000000"),
    ("completions", completion(prompt=[1, 2, -1]), "prompt", "prompt[2] is -1"),
    ("completions", completion(prompt=[2**63 - 1]), "prompt", "vocabulary"),
    # A valid-JSON tool schema 1,000 levels deep: once a 500 (recursion while rendering).
    ("chat/completions", deepen(chat(tools=[TOOL]), 1000), "tools", "nests deeper"),
    # One level past the most taken: the tools array, the tool, its function, the schema.
    ("chat/completions", deepen(chat(tools=[TOOL]), MAX_DEPTH - 2), "tools", "nests deeper"),
    (
        "chat/completions",
        deepen(chat(response_format={"type": "json_schema", "json_schema": {"schema": DEEP}}), 300),
        "response_format",
        "nests deeper",
    ),
    ("responses", deepen(response(metadata=DEEP), 300), "metadata", "nests deeper"),
    (
        "responses",
        deepen(response(tools=[{"type": "function", "name": "f", "parameters": DEEP}]), 900),
        "tools",
        "nests deeper",
    ),
    # An unhashable tool name: once a TypeError.
    (
        "chat/completions",
        chat(tools=[LOOKUP_TOOL], tool_choice={"type": "function", "function": {"name": [1]}}),
        "tool_choice.function.name",
        "not in tools",
    ),
    ("completions", completion(prompt=""), "prompt", "must not be empty"),
]


@pytest.mark.parametrize(("endpoint", "body", "param", "says"), HOSTILE)
async def test_hostile_requests_are_400_naming_the_field_and_leave_the_session_alone(
    endpoint, body, param, says
):
    engine = ScriptedEngine(["fine"])
    async with gateway(engine, sampling=Sampling(seed=3)) as gw:
        hit, control = gw.open(Label(7, 0, 0)), gw.open(Label(7, 0, 0))
        prefix = hit.base_url.removeprefix(gw.url)
        # Sent as a retry, too: a refused retry must not drop the call it would replace.
        for retry in ("0", "1"):
            refused = await http(
                gw.url,
                "POST",
                f"{prefix}/{endpoint}",
                body,
                headers={"x-stainless-retry-count": retry},
            )
            assert refused.status == 400, refused.body
            error = refused.json()["error"]
            assert error["param"] == param and says in error["message"], error
        assert untouched(hit) and engine.started == 0
        # The session goes on as if the requests had not come: its next call is its first.
        for session in (hit, control):
            path = session.base_url.removeprefix(gw.url) + "/chat/completions"
            assert (await http(gw.url, "POST", path, chat())).status == 200
    assert len(hit.calls) == 1 and hit.infra_error is None
    assert engine.keys[0] == engine.keys[1]


async def test_a_deep_but_allowed_schema_and_deep_tool_call_arguments_are_served():
    engine = ScriptedEngine(["fine"])
    async with gateway(engine) as gw:
        session = gw.open()
        path = session.base_url.removeprefix(gw.url) + "/chat/completions"
        # The deepest schema taken: the tools array, the tool, its function and the schema.
        deepest = deepen(chat(tools=[TOOL]), MAX_DEPTH - 3)
        assert (await http(gw.url, "POST", path, deepest)).status == 200
        # Arguments are a string: 5,000 brackets deep, they render as the text they are.
        messages = [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ]
        assert (await http(gw.url, "POST", path, chat(messages=messages))).status == 200
    assert len(session.calls) == 2 and session.infra_error is None


@pytest.mark.parametrize("stream", [False, True])
async def test_log_probs_of_a_reply_ended_by_its_stop_token_are_answered(stream):
    # The stop token is not reported: its log-prob was once zipped against the reported tokens,
    # strictly, and every such request asking for log-probs was answered 500.
    engine = ScriptedEngine(["fine"])
    async with gateway(engine) as gw:
        session = gw.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
            answer = await api.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                logprobs=True,
                top_logprobs=2,
                stream=stream,
            )
            if stream:
                async with answer:
                    chunks = [chunk async for chunk in answer]
                entries = [
                    e
                    for c in chunks
                    if c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content
                ]
            else:
                entries = answer.choices[0].logprobs.content
            response = await api.responses.create(
                model="m", input="hi", include=["message.output_text.logprobs"]
            )
    (call, second) = session.calls
    assert [e.token for e in entries] == list("fine") and len(call.completion) == 5
    assert [e.logprob for e in entries] == call.logprobs[:4].tolist()
    assert response.output[0].content[0].logprobs[-1].logprob == second.logprobs[3]
    assert session.infra_error is None


class ShortEngine(ScriptedEngine):
    """The scripted engine with a `RolloutServer`'s `max_len` (building a real one initialises
    a model, seconds of compilation for a check made before anything is served)."""

    max_len = 128


def test_a_context_longer_than_the_engines_is_refused_when_the_gateway_is_made():
    # Else a prompt the gateway lets through fails in the engine: a 500 for a client's prompt.
    with pytest.raises(ValueError, match="max_context must be at most engine 0's max_len 128"):
        Gateway(ShortEngine(), max_context=129)
    assert Gateway(ShortEngine(), max_context=128).max_context == 128


# Any JSON value: what a client may put in any field.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly something a client might mean, one time in 24 any JSON at all (so
    that most bodies get past their first field to the checks and the rendering behind it)."""
    return st.integers(0, 23).flatmap(lambda k: JSON if k == 0 else plausible)


TEXT = st.text(max_size=40)
SOMETIMES_TEXT = st.text(st.sampled_from('ab {}[]"<>/_:'), max_size=40) | TEXT
PARTS = st.lists(
    field(st.fixed_dictionaries({"type": st.just("text"), "text": field(TEXT)})), max_size=3
)
STOP = st.text(st.sampled_from("ok<>_ \n"), min_size=1, max_size=4)
ARGUMENTS = SOMETIMES_TEXT | st.just('{"key": [1, 2]}') | JSON.map(json.dumps)
TOOL_CALLS = st.lists(
    field(
        st.fixed_dictionaries(
            {
                "id": field(st.sampled_from(["call_1", "call_2"])),
                "type": st.just("function"),
                "function": field(
                    st.fixed_dictionaries(
                        {"name": field(st.just("lookup"))}, optional={"arguments": field(ARGUMENTS)}
                    )
                ),
            }
        )
    ),
    min_size=1,
    max_size=2,
)
MESSAGE = field(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer"]), "content": field(TEXT | PARTS)}
    )
    | st.fixed_dictionaries(
        {"role": st.just("assistant")},
        optional={"content": field(TEXT | st.none()), "tool_calls": field(TOOL_CALLS)},
    )
    | st.fixed_dictionaries(
        {
            "role": st.just("tool"),
            "tool_call_id": field(st.sampled_from(["call_1", "call_2"])),
            "content": field(TEXT | PARTS),
        }
    )
)
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=5)
PARAMETERS = field(st.just({"type": "object", "properties": {"key": {"type": "string"}}}) | JSON)
CHAT_TOOL = st.fixed_dictionaries(
    {
        "type": field(st.just("function")),
        "function": field(
            st.fixed_dictionaries(
                {"name": field(st.just("lookup"))},
                optional={"parameters": PARAMETERS, "description": TEXT, "strict": st.booleans()},
            )
        ),
    }
)
CHOICE = st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries(
    {
        "type": field(st.just("function")),
        "function": field(st.fixed_dictionaries({"name": field(st.just("lookup"))})),
    }
)
SCHEMA_FORMAT = {
    "type": st.just("json_schema"),
    "json_schema": field(st.fixed_dictionaries({}, optional={"schema": JSON})),
}
COMMON = {
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans())})),
    "max_tokens": field(st.integers(1, 32)),
    "stop": field(STOP | st.lists(STOP, max_size=4)),
    "temperature": field(st.floats(0, 2)),
    "seed": field(st.integers(-(2**70), 2**70)),
    "n": field(st.just(1)),
    "user": field(TEXT),
}
CHAT_BODIES = st.fixed_dictionaries(
    {"model": field(st.just("m")), "messages": field(MESSAGES)},
    optional={
        **COMMON,
        "tools": field(st.lists(CHAT_TOOL, max_size=3)),
        "tool_choice": field(CHOICE),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 20)),
        "max_completion_tokens": field(st.integers(1, 32)),
        "response_format": field(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
            | st.fixed_dictionaries(SCHEMA_FORMAT)
        ),
        "metadata": field(st.dictionaries(TEXT, TEXT, max_size=2)),
    },
)
COMPLETION_BODIES = st.fixed_dictionaries(
    {
        "model": field(st.just("m")),
        "prompt": field(
            SOMETIMES_TEXT
            | st.lists(SOMETIMES_TEXT, min_size=1, max_size=1)
            | st.lists(st.integers(0, 259) | st.integers(-(2**70), 2**70), min_size=1, max_size=6)
        ),
    },
    optional={
        **COMMON,
        "logprobs": field(st.integers(0, 5)),
        "echo": field(st.booleans()),
        "best_of": field(st.just(1)),
    },
)
ITEM = field(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant"])},
        optional={
            "type": st.just("message"),
            "content": field(
                TEXT
                | st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["input_text", "output_text"]),
                            "text": field(TEXT),
                        }
                    ),
                    max_size=2,
                )
            ),
        },
    )
    | st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": field(st.sampled_from(["c1", "c2"])),
            "name": field(st.just("lookup")),
            "arguments": field(ARGUMENTS),
        }
    )
    | st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": field(st.sampled_from(["c1", "c2"])),
            "output": field(TEXT),
        }
    )
    | st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([])})
)
RESPONSE_BODIES = st.fixed_dictionaries(
    {"model": field(st.just("m")), "input": field(TEXT | st.lists(ITEM, min_size=1, max_size=5))},
    optional={
        "instructions": field(TEXT),
        "stream": field(st.booleans()),
        "max_output_tokens": field(st.integers(1, 32)),
        "tools": field(
            st.lists(
                st.fixed_dictionaries(
                    {"type": field(st.just("function")), "name": field(st.just("lookup"))},
                    optional={"parameters": PARAMETERS},
                ),
                max_size=2,
            )
        ),
        "tool_choice": field(
            st.sampled_from(["auto", "none", "required"])
            | st.fixed_dictionaries({"type": st.just("function"), "name": field(st.just("lookup"))})
        ),
        "text": field(
            st.fixed_dictionaries(
                {
                    "format": field(
                        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
                        | st.fixed_dictionaries(
                            {"type": st.just("json_schema")}, optional={"schema": JSON}
                        )
                    )
                }
            )
        ),
        "include": field(st.lists(st.just("message.output_text.logprobs"), max_size=1)),
        "top_logprobs": field(st.integers(0, 20)),
        "metadata": field(st.dictionaries(TEXT, TEXT, max_size=2)),
        "background": field(st.just(False)),
    },
)


@hypothesis.settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large],
    derandomize=True,
)
@hypothesis.given(
    st.one_of(
        st.tuples(st.just("chat/completions"), CHAT_BODIES),
        st.tuples(st.just("completions"), COMPLETION_BODIES),
        st.tuples(st.just("responses"), RESPONSE_BODIES),
    ),
    # What the engine writes: a tool call cut by max_tokens, or a short reply and its stop token.
    st.sampled_from(["ok", "", tool_call("lookup", {"key": "x"}, content="Let me see.")]),
)
@pytest.mark.medium
async def test_no_request_body_gets_a_server_error_or_harms_its_session(case, reply):
    endpoint, body = case
    engine = ScriptedEngine([reply])
    async with gateway(engine) as gw:
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
            # The session still serves a well-formed call.
            assert (
                await http(
                    gw.url, "POST", path.rsplit("/v1/", 1)[0] + "/v1/chat/completions", chat()
                )
            ).status == 200


def edited(message: dict) -> st.SearchStrategy:
    """An assistant message the gateway answered, as a client might send it back: as it came,
    its text stripped, emptied or changed, its content null, its tool calls' ids or arguments
    changed, or dropped altogether (None)."""
    calls = message.get("tool_calls") or []
    return st.one_of(
        st.just(message),
        st.just({**message, "content": (message["content"] or "").strip() or None}),
        st.builds(lambda text: {**message, "content": text}, TEXT),
        st.just({k: v for k, v in message.items() if k != "tool_calls"}),
        st.builds(
            lambda ids, arguments: {
                **message,
                "tool_calls": [
                    {**call, "id": i, "function": {**call["function"], "arguments": a}}
                    for call, i, a in zip(calls, ids, arguments, strict=False)
                ],
            },
            st.lists(
                st.sampled_from([c["id"] for c in calls] + ["call_x"]),
                min_size=len(calls),
                max_size=len(calls),
            ),
            st.lists(ARGUMENTS, min_size=len(calls), max_size=len(calls)),
        ),
        st.just(None),
    )


@hypothesis.settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large],
    derandomize=True,
)
@hypothesis.given(st.data())
async def test_follow_up_requests_that_edit_the_gateways_answers_get_no_server_error(data):
    # The turn matching and the retry rule read the session's record: the second request sends
    # the first answer back edited (or drops it), adds fuzzed messages, and may claim to be a
    # retry, of the same body or not.
    replies = [tool_call("lookup", {"key": "x"}, content="Let me see."), "", " plain answer "]
    engine = ScriptedEngine([data.draw(st.sampled_from(replies)), "done"])
    first = {
        "model": "m",
        "messages": [{"role": "user", "content": "look x up"}],
        **data.draw(st.fixed_dictionaries({}, optional={"tools": st.just([LOOKUP_TOOL])})),
    }
    async with gateway(engine) as gw:
        session = gw.open()
        path = session.base_url.removeprefix(gw.url) + "/chat/completions"
        answer = await http(gw.url, "POST", path, json.dumps(first).encode())
        assert answer.status == 200
        message = answer.json()["choices"][0]["message"]
        back = data.draw(edited(message))
        messages = first["messages"] + ([back] if back is not None else [])
        messages += data.draw(st.lists(MESSAGE, max_size=3))
        body = json.dumps({**first, "messages": messages}).encode()
        if data.draw(st.booleans()):
            body = json.dumps(first).encode()  # the first body again
        retry = data.draw(st.sampled_from(["0", "1", "x"]))
        follow = await http(gw.url, "POST", path, body, {"x-stainless-retry-count": retry})
    assert follow.status < 500, follow.body
    assert session.infra_error is None and session.truncation is None
    # A retry of the answered body replaces its call; any other answered request adds one.
    replaced = retry == "1" and body == json.dumps(first).encode()
    assert len(session.calls) == (1 if follow.status != 200 or replaced else 2)


# --- item 10: slow clients -----------------------------------------------------------------------


async def read_to_close(stream: trio.SocketStream) -> bytes:
    """What the server sends until it closes the connection (a reset counts as a close)."""
    data = bytearray()
    try:
        while chunk := await stream.receive_some():
            data += chunk
    except trio.BrokenResourceError:
        pass
    return bytes(data)


async def test_a_client_slow_with_its_headers_or_its_body_is_cut_off():
    engine = ScriptedEngine()
    async with gateway(engine, header_timeout=0.3, body_timeout=0.3) as gw:
        session = gw.open()
        prefix = session.base_url.removeprefix(gw.url)
        host, port = gw.url.removeprefix("http://").rsplit(":", 1)
        head = f"POST {prefix}/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
        with trio.fail_after(20):  # a hang, not a measure: the timeouts are 0.3 s
            # Headers dribbled a byte at a time, each well inside any per-read timeout: the
            # headers' deadline counts from the connection's opening, so it is closed.
            async with await trio.open_tcp_stream(host, int(port)) as dribbler:
                sent = 0
                try:
                    for byte in head.encode()[:-4]:
                        await dribbler.send_all(bytes([byte]))
                        sent += 1
                        await trio.sleep(0.05)
                    closed = await read_to_close(dribbler) == b""
                except trio.BrokenResourceError:  # the server closed it
                    closed = True
                assert closed and sent < len(head) - 4
            # Headers, then one byte of a body of 100: answered 408, then closed.
            async with await trio.open_tcp_stream(host, int(port)) as stalled:
                await stalled.send_all(head.encode() + b"{")
                answer = await read_to_close(stalled)
        assert answer.startswith(b"HTTP/1.1 408 ")
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout" and "body_timeout" in error["message"]
        # The session was never touched and serves the next call.
        assert untouched(session)
        assert (await http(gw.url, "POST", f"{prefix}/chat/completions", chat())).status == 200
    assert engine.started == 1


async def test_a_session_takes_at_most_max_session_requests_at_once():
    engine = ScriptedEngine()
    async with gateway(engine, max_session_requests=2) as gw:
        held, other = gw.open(), gw.open()
        prefix = held.base_url.removeprefix(gw.url)
        host, port = gw.url.removeprefix("http://").rsplit(":", 1)

        async def stall():
            # Headers and one body byte: the request is the session's until its body_timeout.
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                await stream.send_all(
                    f"POST {prefix}/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    "content-length: 1000\r\n\r\n{".encode()
                )
                await trio.sleep_forever()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(stall)
                while held.requests < 2:
                    await trio.testing.wait_all_tasks_blocked()
                refused = await http(gw.url, "POST", f"{prefix}/chat/completions", chat())
                # Another session is served meanwhile.
                path = other.base_url.removeprefix(gw.url) + "/chat/completions"
                served = await http(gw.url, "POST", path, chat())
                nursery.cancel_scope.cancel()
            # The stalled requests end with their connections, and the session serves again.
            while held.requests:
                await trio.testing.wait_all_tasks_blocked()
            again = await http(gw.url, "POST", f"{prefix}/chat/completions", chat())
    assert refused.status == 429 and refused.headers["x-should-retry"] == "false"
    error = refused.json()["error"]
    assert error["code"] == "too_many_requests" and "max_session_requests" in error["message"]
    assert served.status == 200 and again.status == 200
    assert len(held.calls) == 1 and held.infra_error is None and len(other.calls) == 1


async def test_a_client_that_stops_reading_its_answer_is_cut_off_and_frees_its_request():
    # An answer of about 6 MB (100,000 tokens, each with its log-prob): more than both sockets
    # hold, so the gateway's write waits on the client, which never reads.
    engine = ScriptedEngine(["x" * 100_000])
    async with gateway(engine, max_tokens=1 << 17, write_timeout=0.5, max_session_requests=1) as gw:
        session = gw.open()
        prefix = session.base_url.removeprefix(gw.url)
        host, port = gw.url.removeprefix("http://").rsplit(":", 1)
        body = chat(logprobs=True)
        head = f"POST {prefix}/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}"
        with trio.fail_after(30):  # a hang, not a measure: the write timeout is 0.5 s
            async with await trio.open_tcp_stream(host, int(port)) as silent:
                await silent.send_all(f"{head}\r\n\r\n".encode() + body)
                while engine.started < 1 or session.requests:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                # Cut off: the connection is closed before the whole answer was sent.
                answer = await read_to_close(silent)
            assert answer.startswith(b"HTTP/1.1 200 ") and len(answer) < 6_000_000
            # Its request ended, and with it its place among the session's one: served again.
            again = await http(gw.url, "POST", f"{prefix}/chat/completions", chat())
    assert again.status == 200 and len(session.calls) == 2


async def test_the_gateway_holds_at_most_max_connections_open_and_queues_the_next():
    engine = ScriptedEngine()
    async with gateway(engine, max_connections=2, header_timeout=60) as gw:
        session = gw.open()
        prefix = session.base_url.removeprefix(gw.url)
        host, port = gw.url.removeprefix("http://").rsplit(":", 1)
        answers = []

        async def ask():
            answers.append(await http(gw.url, "POST", f"{prefix}/chat/completions", chat()))

        with trio.fail_after(30):
            idle = [await trio.open_tcp_stream(host, int(port)) for _ in range(2)]
            while gw.connections < 2:
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                # The third connection waits in the backlog: not taken, its request not read.
                await trio.testing.wait_all_tasks_blocked(cushion=0.1)
                assert (gw.connections, answers, engine.started) == (2, [], 0)
                await idle[0].aclose()  # one closes: the waiting one is taken and answered
            await idle[1].aclose()
            while gw.connections:
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
    assert [answer.status for answer in answers] == [200] and len(session.calls) == 1


def test_a_bad_write_timeout_or_max_connections_is_refused_naming_it():
    with pytest.raises(ValueError, match="write_timeout must be a number of seconds"):
        gateway(ScriptedEngine(), write_timeout=0)
    with pytest.raises(ValueError, match="max_connections must be an int >= 1"):
        gateway(ScriptedEngine(), max_connections=0)


# --- item 11: large requests ---------------------------------------------------------------------


async def test_requests_with_too_many_messages_tools_or_items_are_refused_naming_the_limit():
    engine = ScriptedEngine()
    many = [{"role": "user", "content": "hi"}] * 51
    tools = [LOOKUP_TOOL] * 4
    cases = [
        ("chat/completions", chat(messages=many), "messages", "max_messages of 50"),
        ("chat/completions", chat(tools=tools), "tools", "max_tools of 3"),
        ("responses", response(input=many), "input", "max_messages of 50"),
        (
            "responses",
            response(tools=[{"type": "function", "name": "f"}] * 4),
            "tools",
            "max_tools of 3",
        ),
    ]
    async with gateway(engine, max_messages=50, max_tools=3) as gw:
        session = gw.open()
        prefix = session.base_url.removeprefix(gw.url)
        for endpoint, body, param, says in cases:
            refused = await http(gw.url, "POST", f"{prefix}/{endpoint}", body)
            assert refused.status == 400, refused.body
            error = refused.json()["error"]
            assert error["param"] == param and says in error["message"], error
        # At the limits, served; a Responses request's instructions are one message more.
        at_limit = [
            chat(messages=many[:50], tools=tools[:3]),
            response(input=many[:50], instructions="be brief"),
        ]
        for endpoint, body in zip(("chat/completions", "responses"), at_limit, strict=True):
            assert (await http(gw.url, "POST", f"{prefix}/{endpoint}", body)).status == 200
    assert len(session.calls) == 2 and session.infra_error is None


class GateTokenizer(ByteTokenizer):
    """The byte tokenizer, whose rendering of a message holding GATE waits (in whatever thread
    renders it) until the test opens the gate: a stand-in for a request slow to render."""

    def __init__(self):
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.waiting = False

    def encode_turn(self, message):
        if "GATE" in message["content"]:
            self.waiting = True
            self.entered.set()
            self.opened.wait(timeout=10)
            self.waiting = False
        return super().encode_turn(message)


async def test_a_large_request_is_read_off_the_event_loop_while_other_sessions_are_served():
    gate = GateTokenizer()
    engine = ScriptedEngine(["fine"])
    # Above the size read in a worker thread: 100 messages of 1 kB each.
    filler = [{"role": "user", "content": "x" * 1000}] * 100
    large = chat(messages=[*filler, {"role": "user", "content": "GATE"}])
    async with gateway(engine, tokenizer=gate) as gw:
        slow, other = gw.open(), gw.open()
        answers = {}

        async def ask(name, session, body):
            path = session.base_url.removeprefix(gw.url) + "/chat/completions"
            answers[name] = await http(gw.url, "POST", path, body)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "large", slow, large)
                await trio.to_thread.run_sync(gate.entered.wait, 20)
                # The large request is being rendered: the loop still serves another session.
                await ask("other", other, chat())
                served_while_rendering = gate.waiting
                gate.opened.set()
    assert served_while_rendering and answers["other"].status == 200
    assert answers["large"].status == 200
    assert len(slow.calls) == 1 and len(other.calls) == 1


# --- item 12: another session's key ---------------------------------------------------------------


async def test_a_key_that_is_not_the_sessions_is_refused_and_none_is_accepted():
    engine = ScriptedEngine(["fine"])
    async with gateway(engine) as gw:
        mine, theirs = gw.open(), gw.open()
        hello = [{"role": "user", "content": "hi"}]
        # The official client with another session's key: 401, nothing recorded.
        for key in (theirs.api_key, "sk-hard-coded"):
            async with openai.AsyncOpenAI(
                base_url=mine.base_url, api_key=key, max_retries=0
            ) as api:
                with pytest.raises(openai.AuthenticationError) as refused:
                    await api.chat.completions.create(model="m", messages=hello)
            error = refused.value.body
            assert error["code"] == "invalid_api_key" and "not this session's" in error["message"]
        prefix = mine.base_url.removeprefix(gw.url)
        for header in ("Basic dXNlcjpwdw==", "Bearer empty", f"Bearer {theirs.api_key}x"):
            raw = await http(
                gw.url, "POST", f"{prefix}/completions", completion(), {"authorization": header}
            )
            assert raw.status == 401, header
        assert untouched(mine)
        # Its own key, and no key at all (the URL is the credential), are served.
        async with openai.AsyncOpenAI(base_url=mine.base_url, api_key=mine.api_key) as api:
            await api.chat.completions.create(model="m", messages=hello)
        bare = await http(gw.url, "POST", f"{prefix}/chat/completions", chat())
        assert bare.status == 200
        # Nor do the keys that say "no key": an empty one, and the placeholder EMPTY that
        # verifiers sends when its key variable is unset.
        for header in ("Bearer", "Bearer EMPTY"):
            nameless = await http(
                gw.url, "POST", f"{prefix}/chat/completions", chat(), {"authorization": header}
            )
            assert nameless.status == 200, header
    assert len(mine.calls) == 4 and theirs.calls == () and mine.infra_error is None
