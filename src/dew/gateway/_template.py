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
"""

from __future__ import annotations

import json
import re
import secrets

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
    return "\n".join(lines) if lines else None


@attrs.frozen
class Reply:
    """A completion's text as the answer carries it.

    Args:
        content: the text outside tool-call blocks, or None when there is none.
        tool_calls: (id, name, arguments JSON text) per parsed call.
    """

    content: str | None
    tool_calls: tuple[tuple[str, str, str], ...] = ()


def tool_call_id() -> str:
    """A fresh, unguessable tool-call id."""
    return "call_" + secrets.token_urlsafe(12)


def parse_reply(text: str, *, tools: bool) -> Reply:
    """Split a completion's text into content and tool calls (see the module for the format).

    Args:
        text: the completion's text, without its stop token.
        tools: whether the request's tools allow calls; without them the text is content.
    """
    if not tools or _OPEN not in text:
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
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
    except (json.JSONDecodeError, RecursionError):  # a model can write 1,000 brackets too
        return None
    return tool_call_id(), value["name"], arguments
