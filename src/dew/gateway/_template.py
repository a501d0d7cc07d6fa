"""How tools, tool calls and tool results become text for the chat template, and back.

The formats (documented in docs/gateway.md):

- `tools` (with `tool_choice` and `response_format`) become one system turn ahead of the
  conversation: each tool's JSON on its own line, then how to call one.
- The model calls a tool by writing, anywhere in its reply, one block per call:

      <tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>

  A reply whose blocks all parse is answered with `tool_calls` (the text outside the blocks is
  the content) and `finish_reason: "tool_calls"`; a reply with any block that does not parse
  (bad JSON, no name, an unclosed block) is answered as plain content.
- An assistant turn the harness wrote itself renders as its content followed by its calls' blocks
  on their own lines; an assistant turn the gateway produced renders as the ids it sampled.
- A `tool` message renders as a turn of role `tool` holding its content.

Under a checkpoint's own chat template (`dew.serve.tokenizer.TemplateTokenizer`) the template
renders the tools, calls and results (`dew.gateway._templated`), and a reply's calls are parsed
in the format that template teaches (`tool_format`): Qwen's and Hermes' `<tool_call>` blocks as
above, Llama 3.x's reply that is one JSON object `{"name": ..., "parameters": {...}}`, or
Mistral's `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

import attrs

from dew.gateway._schema import ChatRequest, Message

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


def call_block(name: str, arguments: str) -> str:
    """One tool call as the model writes it: arguments that are JSON are embedded as JSON."""
    try:
        block = json.dumps({"name": name, "arguments": json.loads(arguments)}, ensure_ascii=False)
    except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past Python's stack
        block = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return _OPEN + block + "</tool_call>"


def message_text(message: Message) -> str:
    """The text of a message the harness wrote, as the template renders it."""
    blocks = [call_block(name, arguments) for _, name, arguments in message.tool_calls]
    return "\n".join(([message.content] if message.content else []) + blocks)


def system_text(request: ChatRequest) -> str | None:
    """The leading system turn that tells the model its tools and answer format, or None."""
    lines = []
    if request.tools:
        lines.append("You can call these tools, each given as a JSON schema:")
        lines += [json.dumps(tool["function"], ensure_ascii=False) for tool in request.tools]
        lines.append(
            'To call a tool, write <tool_call>{"name": <tool name>, "arguments": <arguments '
            "object>}</tool_call>, one block per call."
        )
    lines += instruction_lines(request)
    return "\n".join(lines) if lines else None


def instruction_lines(request: ChatRequest) -> list[str]:
    """What `tool_choice` (with tools) and `response_format` ask of the model, one line each:
    the system turn's last lines under ChatML, added to the system message under a
    checkpoint's own chat template (which has no place for them)."""
    lines = []
    if request.tools:
        if request.tool_choice == "required":
            lines.append("You must call at least one tool.")
        elif request.tool_choice == "none":
            lines.append("Do not call a tool now.")
        elif request.tool_choice != "auto":
            lines.append(f"You must call the tool {request.tool_choice}.")
    if request.response_format is not None:
        if request.response_format["type"] == "json_object":
            lines.append("Answer with one JSON object.")
        else:
            schema = request.response_format["json_schema"].get("schema", {})
            lines.append(
                "Answer with one JSON value matching this schema: "
                + json.dumps(schema, ensure_ascii=False)
            )
    return lines


@attrs.frozen
class Reply:
    """A completion's text as the answer carries it.

    Args:
        content: the text outside tool-call blocks, or None when there is none.
        tool_calls: (id, name, arguments JSON text) per parsed call.
    """

    content: str | None
    tool_calls: tuple[tuple[str, str, str], ...] = ()


def tool_call_id(format: str | None = "hermes") -> str:
    """A fresh, unguessable tool-call id (for Mistral's template, 9 letters and digits, the
    only ids it renders)."""
    if format == "mistral":
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return "call_" + secrets.token_urlsafe(12)


_ALPHANUMERIC = string.ascii_letters + string.digits


def tool_format(tokenizer: Any) -> str | None:
    """How the model a tokenizer's chat template is for writes tool calls: "hermes" (dew's
    ChatML, Qwen, Hermes), "llama3_json", "mistral", or None where the template names no format
    (its replies are never parsed for calls)."""
    template = getattr(tokenizer, "template", None)
    if template is None:
        return "hermes"
    source = template.source(tools=True)
    if _OPEN in source:
        return "hermes"
    if _MISTRAL in source:
        return "mistral"
    if '"parameters"' in source:
        return "llama3_json"
    return None


def parse_reply(text: str, *, tools: bool, format: str | None = "hermes") -> Reply:
    """Split a completion's text into content and tool calls (see the module for the formats).

    Args:
        text: the completion's text, without its stop token.
        tools: whether the request's tools allow calls; without them the text is content.
        format: the tool-call format (`tool_format`); None parses no calls.
    """
    if not tools or format is None:
        return Reply(text)
    if format == "llama3_json":
        return _llama3_reply(text)
    if format == "mistral":
        return _mistral_reply(text)
    if _OPEN not in text:
        return Reply(text)
    calls = []
    for match in _BLOCK.finditer(text):
        call = _parsed_call(match.group(1))
        if call is None:
            return Reply(text)
        calls.append(call)
    rest = _BLOCK.sub("", text)
    if _OPEN in rest:
        return Reply(text)
    content = rest.strip()
    return Reply(content or None, tuple(calls))


def _parsed_call(block: str) -> tuple[str, str, str] | None:
    try:
        value = json.loads(block)
    except (json.JSONDecodeError, RecursionError):  # a model can write 1,000 brackets too
        return None
    return _call(value, "arguments", "hermes")


def _call(value: Any, arguments_key: str, format: str) -> tuple[str, str, str] | None:
    """(id, name, arguments JSON text) of a call the model wrote as a JSON object, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, str):
        try:
            arguments = json.dumps(arguments, ensure_ascii=False)
        except RecursionError:
            return None
    call_id = value.get("id")
    if not (format == "mistral" and isinstance(call_id, str) and _mistral_id(call_id)):
        call_id = tool_call_id(format)
    return call_id, value["name"], arguments


_PYTHON_TAG = "<|python_tag|>"
_MISTRAL = "[TOOL_CALLS]"


def _llama3_reply(text: str) -> Reply:
    """Llama 3.x: a reply that is one JSON object with a `name` and `parameters` is a call."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return Reply(text)
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return Reply(text)
    key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
    call = _call(value, key, "llama3_json")
    return Reply(text) if call is None else Reply(None, (call,))


def _mistral_reply(text: str) -> Reply:
    """Mistral: `[TOOL_CALLS]` then a JSON list of calls; the text before it is the content."""
    if _MISTRAL not in text:
        return Reply(text)
    before, _, after = text.partition(_MISTRAL)
    try:
        values = json.loads(after)
    except (json.JSONDecodeError, RecursionError):
        return Reply(text)
    if not isinstance(values, list) or not values:
        return Reply(text)
    calls = [_call(value, "arguments", "mistral") for value in values]
    if None in calls:
        return Reply(text)
    return Reply(before.strip() or None, tuple(calls))


def _mistral_id(call_id: str) -> bool:
    return len(call_id) == 9 and all(c in _ALPHANUMERIC for c in call_id)
