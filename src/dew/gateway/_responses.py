"""The Responses API (`POST .../v1/responses`), served over the chat path.

A Responses request is turned into the chat completions request it stands for (`chat_payload`):
`instructions` and the `input` items become chat messages (an assistant message item and the
function_call items after it one assistant turn, each function_call_output a tool turn), the
function tools and `tool_choice` chat's, `max_output_tokens` the budget, `text.format` the
response format. From there the gateway renders, samples, records and matches its own turns as
for chat, so a harness on the Responses API (the OpenAI Agents SDK's default) trains the same
way. The answer is laid out as a Response (`response_body`): a message item with the text, then
one function_call item per tool call; streamed, as the Responses events (`response_events`).

Nothing is stored: `previous_response_id` is refused, and the harness sends the conversation.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Mapping
from typing import Any

from dew.gateway._answers import Sample, chat_logprobs, sse, text_deltas
from dew.gateway._api_error import invalid, unsupported
from dew.gateway._fields import CHAT_FIELDS
from dew.gateway._schema import (
    MAX_MESSAGES,
    MAX_TOOLS,
    _check_fields,
    _kind,
    _positive,
    _refuse_given,
    _text_of,
    check_count,
)
from dew.gateway._template import Reply

LOGPROBS = "message.output_text.logprobs"
"""The `include` entry that asks for the output text's log-probs."""

RESPONSE_FIELDS: Mapping[str, str] = {
    "model": CHAT_FIELDS["model"],
    "input": (
        "honoured: a string (one user turn) or items: messages (input_text and output_text "
        "parts), function_call and function_call_output; reasoning items are ignored"
    ),
    "instructions": "honoured: a leading system turn",
    "stream": "honoured: the Responses events, response.created to response.completed",
    "stream_options": "ignored",
    "max_output_tokens": "honoured: as chat's max_completion_tokens",
    "tools": "honoured: function tools, as chat's; other tool types are refused",
    "tool_choice": "honoured: as chat's (a named function is {type: function, name})",
    "parallel_tool_calls": CHAT_FIELDS["parallel_tool_calls"],
    "text": "honoured in part: text.format as chat's response_format (an instruction)",
    "include": f"honoured: {LOGPROBS} adds the output text's log-probs; other strings are ignored",
    "top_logprobs": f"honoured with {LOGPROBS}: as chat's top_logprobs (0 to 20, checked "
    "without it too)",
    "temperature": CHAT_FIELDS["temperature"],
    "top_p": CHAT_FIELDS["top_p"],
    "reasoning": "ignored",
    "truncation": "ignored: a prompt beyond the context is refused (400)",
    "max_tool_calls": "ignored (below 1 is refused)",
    "store": "ignored: nothing is stored",
    "metadata": "ignored",
    "user": "ignored",
    "service_tier": "ignored",
    "safety_identifier": "ignored",
    "prompt_cache_key": "ignored",
    "prompt_cache_retention": "ignored",
    "previous_response_id": "refused when given: nothing is stored; send the conversation",
    "conversation": "refused when given: nothing is stored; send the conversation",
    "prompt": "refused when given: no stored prompt templates",
    "background": "refused when true: a response is answered while the request waits",
}
"""What the gateway does with each field of a Responses request (same wording as CHAT_FIELDS)."""

_TYPES = {
    "model": "str",
    "input": "str_or_array",
    "instructions": "str",
    "stream": "bool",
    "stream_options": "object",
    "max_output_tokens": "int",
    "tools": "array",
    "tool_choice": "str_or_object",
    "parallel_tool_calls": "bool",
    "text": "object",
    "include": "array",
    "top_logprobs": "int",
    "temperature": "number",
    "top_p": "number",
    "reasoning": "object",
    "truncation": "str",
    "max_tool_calls": "int",
    "store": "bool",
    "metadata": "object",
    "user": "str",
    "service_tier": "str",
    "safety_identifier": "str",
    "prompt_cache_key": "str",
    "prompt_cache_retention": "str",
    "previous_response_id": "str",
    "conversation": "any",
    "prompt": "any",
    "background": "bool",
}

_ROLES = ("user", "system", "developer", "assistant")


def chat_payload(
    body: dict[str, Any], *, max_messages: int = MAX_MESSAGES, max_tools: int = MAX_TOOLS
) -> dict[str, Any]:
    """The chat completions body a Responses body stands for.

    Args:
        max_messages, max_tools: the most `input` items and tools taken.

    Raises:
        ApiError: 400 naming the field (an `input` item by its index) that is missing, of the
            wrong type or unsupported, or that holds more entries than its limit.
    """
    _check_fields(body, _TYPES, ("model", "input"))
    if isinstance(body["input"], list):
        check_count("input", body["input"], max_messages, "max_messages")
    check_count("tools", body.get("tools") or [], max_tools, "max_tools")
    _refuse_given(body, "previous_response_id", "conversation", "prompt")
    if body.get("background"):
        raise unsupported("background", "'background' responses are not supported")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(body["input"], str):
        messages.append({"role": "user", "content": body["input"]})
    else:
        _add_items(messages, body["input"])
    if not messages:
        raise invalid("input", "'input' must hold at least one message")
    payload: dict[str, Any] = {"model": body["model"], "messages": messages}
    # Checked here what the chat request would name by its own fields.
    tools = [_chat_tool(index, tool) for index, tool in enumerate(body.get("tools") or ())]
    if tools:
        payload["tools"] = tools
    if body.get("tool_choice") is not None:
        names = {tool["function"]["name"] for tool in tools}
        payload["tool_choice"] = _chat_tool_choice(body["tool_choice"], names)
    if _positive(body, "max_output_tokens") is not None:
        payload["max_completion_tokens"] = body["max_output_tokens"]
    text_format = (body.get("text") or {}).get("format")
    if text_format is not None:
        payload["response_format"] = _chat_format(text_format)
    include = body.get("include") or ()
    for index, entry in enumerate(include):
        if not isinstance(entry, str):
            raise invalid(f"include[{index}]", f"'include[{index}]' must be a string")
    top = body.get("top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise invalid("top_logprobs", f"'top_logprobs' must be in [0, 20], got {top}")
    _positive(body, "max_tool_calls")
    if LOGPROBS in include:
        payload["logprobs"] = True
        payload["top_logprobs"] = top or 0
    for name in ("stream", "parallel_tool_calls", "temperature", "top_p"):
        if body.get(name) is not None:
            payload[name] = body[name]
    return payload


def _add_items(messages: list[dict[str, Any]], items: list) -> None:
    """Append the chat messages of `input` items. An assistant message and the function calls
    right after it are one assistant turn, as the gateway answered them."""
    open_turn = None  # the assistant message the next function_call joins
    for index, item in enumerate(items):
        at = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid(at, f"'{at}' must be an object, got {_kind(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid(f"{at}.role", f"'{at}.role' must be one of {_ROLES}, got {role!r}")
            message = {"role": role, "content": _text(item.get("content"), f"{at}.content")}
            messages.append(message)
            open_turn = message if role == "assistant" else None
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", at),
                "type": "function",
                "function": {
                    "name": _string(item, "name", at),
                    "arguments": _string(item, "arguments", at),
                },
            }
            if open_turn is None:
                open_turn = {"role": "assistant", "content": None}
                messages.append(open_turn)
            open_turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = _text(output, f"{at}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", at), "content": content}
            )
            open_turn = None
        elif kind != "reasoning":
            raise unsupported(f"{at}.type", f"input items of type {kind!r} are not supported")


def _string(item: dict[str, Any], name: str, at: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{at}.{name}", f"'{at}.{name}' must be a string, got {_kind(value)}")
    return value


# The Responses API's content parts that carry text, and the key of each one's text.
_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _text(content, where: str) -> str:
    """The text of a message's content or a tool's output: a string, or its text parts."""
    return _text_of(content, where, _PARTS)


def _chat_tool(index: int, tool) -> dict[str, Any]:
    at = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else _kind(tool)
        raise unsupported(f"{at}.type", f"only function tools are supported, got {kind!r}")
    function = {"name": _string(tool, "name", at)}
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise invalid(f"{at}.parameters", f"'{at}.parameters' must be an object")
    for name in ("description", "parameters", "strict"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice, names: set[str]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise unsupported(
            "tool_choice", f"tool_choice of type {choice.get('type')!r} is not supported"
        )
    name = _string(choice, "name", "tool_choice")
    if name not in names:
        raise invalid("tool_choice.name", f"tool_choice names {name!r}, which is not in tools")
    return {"type": "function", "function": {"name": name}}


def _chat_format(text_format) -> dict[str, Any]:
    if not isinstance(text_format, dict):
        raise invalid("text.format", "'text.format' must be an object")
    kind = text_format.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid("text.format.type", f"text.format type {kind!r} is unknown")
    if kind != "json_schema":
        return {"type": text_format.get("type")}
    schema = {
        name: text_format[name] for name in ("name", "schema", "strict") if name in text_format
    }
    return {"type": "json_schema", "json_schema": schema}


# --- the answer --------------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(18)}"


def _usage(sample: Sample) -> dict[str, Any]:
    prompt, completion = len(sample.call.prompt), len(sample.call.completion)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class Answer:
    """One sampled reply laid out as a Response: its items, ids and events.

    Args:
        response_id: the response's id.
        body: the Responses request, whose settings the response echoes.
        sample, reply: the sampled call and its parsed reply.
        tokenizer: decodes the log-probs' tokens.
        request: the chat request the body stood for.
    """

    def __init__(
        self, response_id: str, body: dict, sample: Sample, reply: Reply, tokenizer, request
    ):
        self.response_id = response_id
        self.body = body
        self.sample = sample
        self.reply = reply
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.logprobs = (
            chat_logprobs(sample, tokenizer, request.sampled.top_logprobs)
            if request.sampled.logprobs
            else None
        )
        self.message_id = _item_id("msg") if reply.content or not reply.tool_calls else None
        self.call_ids = [_item_id("fc") for _ in reply.tool_calls]
        self.incomplete = sample.finish == "length" and not reply.tool_calls

    def _text_part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.logprobs is not None:
            part["logprobs"] = self.logprobs if text else []
        return part

    def _message(self, done: bool) -> dict[str, Any]:
        text = self.reply.content or ""
        return {
            "type": "message",
            "id": self.message_id,
            "status": "completed" if done else "in_progress",
            "role": "assistant",
            "content": [self._text_part(text)] if done else [],
        }

    def _call(self, index: int, done: bool) -> dict[str, Any]:
        call_id, name, arguments = self.reply.tool_calls[index]
        return {
            "type": "function_call",
            "id": self.call_ids[index],
            "call_id": call_id,
            "name": name,
            "arguments": arguments if done else "",
            "status": "completed" if done else "in_progress",
        }

    def items(self) -> list[dict[str, Any]]:
        """The response's output items: the message (when it has text or no tool calls),
        then each function call."""
        items = [self._message(done=True)] if self.message_id else []
        return items + [self._call(i, done=True) for i in range(len(self.call_ids))]

    def response(self, done: bool = True) -> dict[str, Any]:
        """The Response object: in progress (no output yet) or done."""
        body = self.body
        status = "in_progress" if not done else "incomplete" if self.incomplete else "completed"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if done and self.incomplete else None
            ),
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": body["model"],
            "output": self.items() if done else [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": body.get("reasoning"),
            "store": False,
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "truncation": body.get("truncation", "disabled"),
            "usage": _usage(self.sample) if done else None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def events(self) -> Iterator[dict[str, Any]]:
        """The streamed events of the response, in order, each with its sequence number."""
        number = 0

        def event(kind: str, **fields) -> dict[str, Any]:
            nonlocal number
            number += 1
            return {"type": kind, "sequence_number": number - 1, **fields}

        yield event("response.created", response=self.response(done=False))
        yield event("response.in_progress", response=self.response(done=False))
        index = 0
        if self.message_id:
            where = {"item_id": self.message_id, "output_index": index}
            yield event("response.output_item.added", output_index=index, item=self._message(False))
            yield event(
                "response.content_part.added", **where, content_index=0, part=self._text_part("")
            )
            # As chat streams it: a reply with tool calls sends its text in one delta, with
            # every log-prob; a plain reply one delta per token, with its log-prob.
            logprobs = self.logprobs or []
            if self.reply.tool_calls:
                deltas = [(self.reply.content, logprobs)] if self.reply.content else []
            else:
                texts = text_deltas(self.sample, self.tokenizer)
                deltas = [(text, logprobs[k : k + 1]) for k, text in enumerate(texts)]
            for delta, its_logprobs in deltas:
                yield event(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=delta,
                    logprobs=its_logprobs,
                )
            text = self.reply.content or ""
            yield event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=text,
                logprobs=self.logprobs or [],
            )
            yield event(
                "response.content_part.done", **where, content_index=0, part=self._text_part(text)
            )
            yield event("response.output_item.done", output_index=index, item=self._message(True))
            index += 1
        for call in range(len(self.call_ids)):
            where = {"item_id": self.call_ids[call], "output_index": index}
            arguments = self.reply.tool_calls[call][2]
            yield event(
                "response.output_item.added", output_index=index, item=self._call(call, False)
            )
            yield event("response.function_call_arguments.delta", **where, delta=arguments)
            yield event("response.function_call_arguments.done", **where, arguments=arguments)
            yield event(
                "response.output_item.done", output_index=index, item=self._call(call, True)
            )
            index += 1
        finished = "response.incomplete" if self.incomplete else "response.completed"
        yield event(finished, response=self.response())


def named_sse(event: dict[str, Any]) -> bytes:
    """One server-sent event named by its type, as the Responses stream sends them."""
    return b"event: " + event["type"].encode() + b"\n" + sse(event)
