"""The OpenAI request schema the gateway accepts: parsing, checking, and what each field does.

Each request body is parsed into a frozen value, or refused with an `ApiError` that names the
field (`param`) and says what is wrong. Every field of the Chat Completions and Completions
schemas that real clients send is accepted; each one is either honoured or ignored, as
`CHAT_FIELDS` and `COMPLETION_FIELDS` say. A field outside the schema, and a standard one asking
for something the gateway cannot do (`n` above 1, audio, image content), is refused with 400.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from typing import Any

import attrs
import orjson

from dew.gateway._api_error import invalid, unsupported

MAX_DEPTH = 64
"""How deeply a request's JSON may nest (a tool's parameter schema within its tool within
`tools` is 5 levels). Rendering a schema as text, and answering a Responses request's settings
back, recurse once per level: a value nested 1,000 deep would exhaust Python's stack (or
orjson's 255 levels) while answering, a fault of the gateway, where it is the client's."""


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        ApiError: 400 when it is not valid UTF-8 JSON, not an object, or a field nests deeper
            than `MAX_DEPTH` (naming the field).
    """
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise invalid(
            None, f"the request body is not valid JSON: {error}", "invalid_json"
        ) from None
    if not isinstance(value, dict):
        raise invalid(None, f"the request body must be a JSON object, got {_kind(value)}")
    for name, field in value.items():
        _check_depth(name, field)
    return value


def _check_depth(name: str, value) -> None:
    """Refuse a field nesting deeper than MAX_DEPTH, walked without recursion (the walk itself
    must not be what a deep value breaks)."""
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(MAX_DEPTH):  # after k rounds, `level` holds the containers k + 1 deep
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, dict | list)
        ]
        if not level:
            return
    if level:
        raise invalid(
            name,
            f"'{name}' nests deeper than {MAX_DEPTH} levels of arrays and objects, the most "
            "the gateway takes",
            "nested_too_deeply",
        )


def _kind(value) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), "a number")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# Each type check: (test, what the error says the field must be).
_TYPES = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "int": (_is_int, "an integer"),
    "number": (_is_number, "a number"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "array": (lambda v: isinstance(v, list), "an array"),
    "str_or_array": (lambda v: isinstance(v, str | list), "a string or an array"),
    "str_or_object": (lambda v: isinstance(v, str | dict), "a string or an object"),
    "any": (lambda v: True, "anything"),
}

_CHAT_TYPES = {
    "model": "str",
    "messages": "array",
    "stream": "bool",
    "stream_options": "object",
    "max_tokens": "int",
    "max_completion_tokens": "int",
    "n": "int",
    "stop": "str_or_array",
    "logprobs": "bool",
    "top_logprobs": "int",
    "tools": "array",
    "tool_choice": "str_or_object",
    "parallel_tool_calls": "bool",
    "response_format": "object",
    "temperature": "number",
    "top_p": "number",
    "seed": "int",
    "frequency_penalty": "number",
    "presence_penalty": "number",
    "logit_bias": "object",
    "user": "str",
    "metadata": "object",
    "store": "bool",
    "service_tier": "str",
    "reasoning_effort": "str",
    "verbosity": "str",
    "modalities": "array",
    "audio": "any",
    "prediction": "object",
    "prompt_cache_key": "str",
    "prompt_cache_retention": "str",
    "safety_identifier": "str",
    "web_search_options": "any",
    "functions": "any",
    "function_call": "any",
}

_COMPLETION_TYPES = {
    "model": "str",
    "prompt": "str_or_array",
    "stream": "bool",
    "stream_options": "object",
    "max_tokens": "int",
    "n": "int",
    "best_of": "int",
    "stop": "str_or_array",
    "logprobs": "int",
    "echo": "bool",
    "suffix": "any",
    "temperature": "number",
    "top_p": "number",
    "seed": "int",
    "frequency_penalty": "number",
    "presence_penalty": "number",
    "logit_bias": "object",
    "user": "str",
}


def _check_fields(body: dict[str, Any], types: Mapping[str, str], required: tuple[str, ...]):
    """Refuse unknown fields, missing required ones and wrong types (null means not given)."""
    for name in body:
        if name not in types:
            raise unsupported(name, f"unrecognized request argument supplied: {name}")
    for name in required:
        if body.get(name) is None:
            raise invalid(
                name, f"missing required parameter: '{name}'", "missing_required_parameter"
            )
    for name, value in body.items():
        if value is None:
            continue
        test, described = _TYPES[types[name]]
        if not test(value):
            raise invalid(name, f"'{name}' must be {described}, got {_kind(value)}", "invalid_type")


@attrs.frozen
class Message:
    """One chat message, reduced to what the template renders.

    Args:
        role: system (developer is rendered as system), user, assistant or tool.
        content: its text ("" for an assistant turn with only tool calls).
        tool_calls: an assistant turn's calls as (id, name, arguments text).
        tool_call_id: a tool turn's call id (a checkpoint's template may render it).
    """

    role: str
    content: str
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    tool_call_id: str | None = None


@attrs.frozen
class Sampled:
    """What a request asks of the sampling: its budget, stops and what to report.

    Args:
        max_tokens: the most completion tokens asked for, or None for the gateway's default.
        stop: stop strings.
        logprobs: whether to report log-probs.
        top_logprobs: how many top log-probs per token were asked for.
        stream: whether to answer with server-sent events.
        include_usage: whether a stream ends with a usage chunk.
    """

    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool


@attrs.frozen
class ChatRequest:
    """A parsed chat completions request.

    Args:
        messages: the conversation.
        tools: the function tools, as the request gave them (JSON objects).
        tool_choice: "auto", "required", "none" or a function's name.
        response_format: the response_format object, or None.
        sampled: budget, stops and reporting.
        model: the model name asked for, echoed back.
    """

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]
    tool_choice: str
    response_format: dict[str, Any] | None
    sampled: Sampled
    model: str

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(tool["function"]["name"] for tool in self.tools)

    @property
    def parses_tools(self) -> bool:
        """Whether the reply's tool-call blocks are parsed into tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


@attrs.frozen
class CompletionRequest:
    """A parsed (legacy) completions request.

    Args:
        prompt: the prompt text, or its token ids.
        echo: whether the answer repeats the prompt before the completion.
        sampled: budget, stops and reporting (`top_logprobs` is the `logprobs` int).
        model: the model name asked for, echoed back.
    """

    prompt: str | tuple[int, ...]
    echo: bool
    sampled: Sampled
    model: str


def _stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if len(stops) > 4:
        raise invalid("stop", f"'stop' holds at most 4 sequences, got {len(stops)}")
    for index, stop in enumerate(stops):
        if not isinstance(stop, str) or not stop:
            raise invalid(
                f"stop[{index}]", f"each stop sequence must be a non-empty string, got {stop!r}"
            )
    return tuple(stops)


def _positive(body, name) -> int | None:
    value = body.get(name)
    if value is not None and value < 1:
        raise invalid(name, f"'{name}' must be >= 1, got {value}")
    return value


def _single_choice(body, name="n") -> None:
    value = body.get(name)
    if value is not None and value < 1:
        raise invalid(name, f"'{name}' must be >= 1, got {value}")
    if value is not None and value != 1:
        raise unsupported(name, f"'{name}' must be 1: the gateway samples one choice, got {value}")


# OpenAI's bounds on the sampling fields. The gateway ignores their values (the behaviour
# policy's sampling is its own), but a value out of bounds is a client's mistake that OpenAI
# refuses: a harness that sends one is told here, not first in production.
_BOUNDS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
}


def _check_bounds(body) -> None:
    """Raises: ApiError 400 naming a sampling field out of OpenAI's bounds."""
    for name, (low, high) in _BOUNDS.items():
        value = body.get(name)
        if value is not None and not low <= value <= high:
            raise invalid(name, f"'{name}' must be in [{low:g}, {high:g}], got {value}")


def _include_usage(body) -> bool:
    options = body.get("stream_options") or {}
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise invalid("stream_options.include_usage", "'include_usage' must be a boolean")
    return include


def _refuse_given(body, *names: str) -> None:
    for name in names:
        if body.get(name) is not None:
            raise unsupported(name, f"'{name}' is not supported by the dew gateway")


# Chat's content parts that carry text: each type and the key of its text.
_CHAT_PARTS = {"text": "text", "refusal": "refusal"}


def _text_of(content, where: str, parts: Mapping[str, str] = _CHAT_PARTS) -> str:
    """A message content's text: a string, or its text parts joined.

    Args:
        parts: the part types that carry text, each with the key its text is under; a part of
            another type is refused.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or an array of parts")
    texts = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(at, f"'{at}' must be an object with a 'type'")
        if part["type"] not in parts:
            raise unsupported(at, f"content parts of type {part['type']!r} are not supported")
        key = parts[part["type"]]
        if not isinstance(part.get(key), str):
            raise invalid(f"{at}.{key}", f"'{at}.{key}' must be a string")
        texts.append(part[key])
    return "".join(texts)


def _tool_calls(value, where: str) -> tuple[tuple[str, str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(where, f"'{where}' must be an array")
    calls = []
    for index, call in enumerate(value):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise invalid(f"{at}.function", f"'{at}.function' must be an object")
        if not isinstance(call.get("id"), str):
            raise invalid(f"{at}.id", f"'{at}.id' must be a string")
        name, arguments = function.get("name"), function.get("arguments", "")
        if not isinstance(name, str):
            raise invalid(f"{at}.function.name", f"'{at}.function.name' must be a string")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise invalid(f"{at}.function.arguments", f"'{at}.function.arguments' must be a string")
        calls.append((call["id"], name, arguments))
    return tuple(calls)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _message(index: int, message) -> Message:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(where, f"'{where}' must be an object, got {_kind(message)}")
    role = message.get("role")
    if role == "function":
        raise unsupported(f"{where}.role", "the 'function' role is not supported: use 'tool'")
    if role not in (*_ROLES, "tool"):
        raise invalid(
            f"{where}.role",
            f"'{where}.role' must be one of system, developer, user, assistant, tool; got {role!r}",
        )
    content = message.get("content")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise invalid(f"{where}.tool_call_id", f"'{where}.tool_call_id' must be a string")
        text = _text_of(content if content is not None else "", f"{where}.content")
        return Message("tool", text, tool_call_id=message["tool_call_id"])
    if role == "assistant":
        calls = _tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
        text = "" if content is None else _text_of(content, f"{where}.content")
        return Message("assistant", text, calls)
    if content is None:
        raise invalid(f"{where}.content", f"'{where}.content' is required for role {role!r}")
    return Message(_ROLES[role], _text_of(content, f"{where}.content"))


def _tools(value) -> tuple[dict[str, Any], ...]:
    tools = []
    for index, tool in enumerate(value or ()):
        at = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(at, f"'{at}' must be an object")
        if tool.get("type") != "function":
            raise unsupported(
                f"{at}.type", f"only function tools are supported, got {tool.get('type')!r}"
            )
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{at}.function.name", f"'{at}.function.name' must be a string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise invalid(
                f"{at}.function.parameters", f"'{at}.function.parameters' must be an object"
            )
        tools.append(tool)
    return tuple(tools)


def _tool_choice(value, names: frozenset[str]) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "required", "none"):
            raise invalid(
                "tool_choice", f"'tool_choice' must be auto, required or none, got {value!r}"
            )
        if value == "required" and not names:
            # A reply cannot call a tool there is none of: OpenAI refuses it too.
            raise invalid("tool_choice", "'tool_choice' is 'required' but 'tools' is empty")
        return value
    if value.get("type") != "function":
        raise unsupported(
            "tool_choice", f"tool_choice of type {value.get('type')!r} is not supported"
        )
    function = value.get("function")
    if not isinstance(function, dict):
        raise invalid(
            "tool_choice.function", "'tool_choice.function' must be an object naming the tool"
        )
    name = function.get("name")
    if not isinstance(name, str) or name not in names:
        raise invalid(
            "tool_choice.function.name", f"tool_choice names {name!r}, which is not in tools"
        )
    return name


def _response_format(value) -> dict[str, Any] | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid("response_format.type", f"response_format type {kind!r} is unknown")
    if kind == "json_schema" and not isinstance(value.get("json_schema"), dict):
        raise invalid(
            "response_format.json_schema", "'response_format.json_schema' must be an object"
        )
    return None if kind == "text" else value


MAX_MESSAGES = 2048
"""The default most messages of a chat request (the gateway's `max_messages`)."""

MAX_TOOLS = 128
"""The default most tools of a request (the gateway's `max_tools`; OpenAI's own limit)."""


def check_count(name: str, values: list, limit: int, option: str) -> None:
    """Raises: ApiError 400 naming the field and the gateway's option when `values` holds more
    than `limit` entries."""
    if len(values) > limit:
        raise invalid(
            name,
            f"'{name}' holds {len(values)} entries, above the gateway's {option} of {limit}",
            "too_many_entries",
        )


def chat_request(
    body: dict[str, Any], *, max_messages: int = MAX_MESSAGES, max_tools: int = MAX_TOOLS
) -> ChatRequest:
    """Parse a chat completions body.

    Args:
        max_messages, max_tools: the most messages and tools taken (checked before either is
            read, so that a runaway request costs no more than its count).

    Raises:
        ApiError: 400 naming the field that is missing, of the wrong type, out of bounds or
            unsupported, or that holds more entries than its limit.
    """
    _check_fields(body, _CHAT_TYPES, ("model", "messages"))
    check_count("messages", body["messages"], max_messages, "max_messages")
    check_count("tools", body.get("tools") or [], max_tools, "max_tools")
    _single_choice(body)
    _check_bounds(body)
    _refuse_given(body, "audio", "web_search_options", "functions", "function_call")
    if body.get("modalities") not in (None, ["text"]):
        raise unsupported(
            "modalities", f"only the text modality is supported, got {body['modalities']!r}"
        )
    if not body["messages"]:
        raise invalid("messages", "'messages' must hold at least one message")
    messages = tuple(_message(i, message) for i, message in enumerate(body["messages"]))
    tools = _tools(body.get("tools"))
    top = body.get("top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise invalid("top_logprobs", f"'top_logprobs' must be in [0, 20], got {top}")
    if top and not body.get("logprobs"):
        # Nothing would be reported: the client asked for lists it would not get.
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs' to be true")
    budget = _positive(body, "max_completion_tokens") or _positive(body, "max_tokens")
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(
            body.get("tool_choice"), frozenset(t["function"]["name"] for t in tools)
        ),
        response_format=_response_format(body.get("response_format")),
        sampled=Sampled(
            max_tokens=budget,
            stop=_stops(body.get("stop")),
            logprobs=bool(body.get("logprobs")),
            top_logprobs=top or 0,
            stream=bool(body.get("stream")),
            include_usage=_include_usage(body),
        ),
        model=body["model"],
    )


# OpenAI's default for the completions endpoint.
_COMPLETION_DEFAULT_TOKENS = 16


def completion_request(body: dict[str, Any]) -> CompletionRequest:
    """Parse a (legacy) completions body.

    Raises:
        ApiError: 400 naming the field that is missing, of the wrong type, out of bounds or
            unsupported.
    """
    _check_fields(body, _COMPLETION_TYPES, ("model", "prompt"))
    _single_choice(body)
    _single_choice(body, "best_of")
    _check_bounds(body)
    _refuse_given(body, "suffix")
    prompt = body["prompt"]
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif prompt and all(_is_int(token) for token in prompt):
            prompt = tuple(prompt)
        else:
            raise unsupported(
                "prompt", "'prompt' must be a string, one string in an array, or token ids"
            )
    logprobs = body.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise invalid("logprobs", f"'logprobs' must be in [0, 5], got {logprobs}")
    echo = bool(body.get("echo"))
    if echo and logprobs is not None:
        raise unsupported(
            "echo", "'echo' with 'logprobs' is not supported: prompt log-probs are not computed"
        )
    return CompletionRequest(
        prompt=prompt,
        echo=echo,
        sampled=Sampled(
            max_tokens=_positive(body, "max_tokens") or _COMPLETION_DEFAULT_TOKENS,
            stop=_stops(body.get("stop")),
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            stream=bool(body.get("stream")),
            include_usage=_include_usage(body),
        ),
        model=body["model"],
    )
