"""A chat request's prompt under a checkpoint's own chat template, token in / token out.

The template renders the whole conversation (tools, calls and results included), as
`apply_chat_template` would. The model was trained on that text; but the gateway also owes the
trainer one chain per session: the prompt of a call that follows the gateway's own answer must
extend that call's prompt and the ids it sampled, not a re-tokenisation of the answer's text.

So, where the conversation holds an assistant turn the gateway produced (matched as under ChatML,
by its tool-call ids or its text), the latest such turn k is spliced:

- the messages before k and the tools must be those of call k's request (`Turn.templated`):
  then call k's prompt ids stand for them;
- the rendering of the whole conversation must start with the text rendered for call k (the
  template renders the conversation incrementally there, and renders the same messages the same
  way: a date it writes has not changed);
- the prompt is call k's prompt, the ids it sampled, its stop token if it was cut before one, and
  the rendering's text after turn k's stop token, tokenized.

Where turn k's text as the template renders it is not the text sampled (a client that reformats
a call's arguments, Qwen3 dropping a reply's reasoning once a new question follows), the sampled
ids are kept and the request is counted as `drift`: the model is trained on what it saw. Where
the prefix does not hold (the history before k changed, the tools changed, or the template
rewrites what came before the reply, as Qwen3 with thinking off and Mistral's moving tools do),
the conversation is tokenized from its text and each of the gateway's turns in it is counted as
`rerendered`: the chain breaks, visibly. Both are counted on
the session and the gateway, and logged once per gateway.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from dew.gateway._api_error import ApiError
from dew.gateway._schema import ChatRequest, Message
from dew.gateway._template import instruction_lines
from dew.serve.chat_template import ChatTemplateError

_log = logging.getLogger("dew.gateway")


@attrs.frozen
class Rendered:
    """A chat request's prompt under the template.

    Args:
        ids: the prompt's token ids.
        text: the template's text of the request (with the generation prompt), which a later
            call's splice checks its prefix against; None under dew's ChatML template.
        messages: the request's messages as the template took them.
        tools: the request's tools, or None.
        spliced: whether the prompt extends one of the gateway's calls.
        drift: whether that call's turn renders as other text than was sampled.
        rerendered: how many of the gateway's turns were tokenized from their text.
    """

    ids: np.ndarray
    text: str | None
    messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    spliced: bool = False
    drift: bool = False
    rerendered: int = 0


def tally(rendering: collections.Counter[str], rendered: Rendered) -> None:
    """Count in a gateway's `rendering` how a prompt under a checkpoint's template kept the
    gateway's turns, and say once when the template first renders one of them other than as
    sampled."""
    if rendered.text is None:
        return
    first = not (rendering["drift"] or rendering["rerendered"])
    rendering["spliced"] += rendered.spliced
    rendering["drift"] += rendered.drift
    rendering["rerendered"] += rendered.rerendered
    if first and (rendered.drift or rendered.rerendered):
        _log.warning(
            "dew gateway: the chat template renders one of the gateway's own turns other "
            "than as the model sampled it (%s); Gateway.rendering counts these",
            "its ids kept" if rendered.drift else "the session's chain breaks there",
        )


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them: the JSON object, else the text as sent."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def template_message(message: Message) -> dict[str, Any]:
    """A message as chat templates take it (OpenAI's shape, arguments as objects)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _arguments(arguments)},
            }
            for call_id, name, arguments in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _instructed(tokenizer, request: ChatRequest, messages: list, field: str) -> tuple[list, int]:
    """The messages with what `tool_choice` and `response_format` ask of the model (which a
    chat template has no place for) added to the leading system message, or as one put ahead
    of the conversation; and how many messages were put ahead (0 or 1)."""
    lines = instruction_lines(request)
    if not lines:
        return messages, 0
    instruction = "\n".join(lines)
    token = tokenizer.spelled_special(instruction)
    if token is not None:
        param = "response_format" if field == "messages" else "text"
        raise ApiError(
            400,
            f"'{param}' spells the special token {token!r}, which the chat template's output "
            "would carry as structure",
            param=param,
        )
    first = messages[0] if messages else None
    if first is not None and first["role"] in ("system", "developer"):
        if isinstance(first["content"], str) and first["content"]:
            return [{**first, "content": first["content"] + "\n\n" + instruction}, *messages[1:]], 0
    return [{"role": "system", "content": instruction}, *messages], 1


def _render(tokenizer, messages, tools, field: str) -> str:
    try:
        return tokenizer.render(messages, tools=tools, add_generation_prompt=True)
    except ChatTemplateError as error:
        raise ApiError(400, str(error), param=field, code="chat_template") from None


def templated_prompt(
    tokenizer, request: ChatRequest, match: Callable[[Message], Any], field: str = "messages"
) -> Rendered:
    """The prompt of a chat request under `tokenizer`'s template (see the module).

    Args:
        tokenizer: a `dew.serve.tokenizer.TemplateTokenizer`.
        request: the chat request.
        match: the gateway's turn an assistant message stands for, or None.
        field: the request's field the conversation came in: `messages`, or a Responses
            request's `input` (whose items are not the messages one for one: an error names
            `input` and the message).

    Raises:
        ApiError: 400 when the template refuses the conversation, or a message the client
            wrote or a tool spells a special token.
    """
    messages = [template_message(message) for message in request.messages]
    tools = list(request.tools) or None
    messages, shift = _instructed(tokenizer, request, messages, field)
    own = [(index + shift, turn) for index, m in enumerate(request.messages) if (turn := match(m))]
    written = {index for index, _ in own}
    checked = [
        (f"messages[{i - shift}]", m)
        for i, m in enumerate(messages)
        if i >= shift and i not in written
    ]
    for where, value in [*checked, *((f"tools[{i}]", t) for i, t in enumerate(tools or ()))]:
        token = tokenizer.spelled_special(value)
        if token is not None:
            param, named = where, f"'{where}'"
            if field != "messages" and not where.startswith("tools"):
                param, named = field, f"'{field}' ({where} of the chat it stands for)"
            raise ApiError(
                400,
                f"{named} spells the special token {token!r}, which the chat template's output "
                "would carry as structure",
                param=param,
            )
    text = _render(tokenizer, messages, tools, field)
    asked = (tuple(messages), None if tools is None else tuple(tools))
    if own:
        index, turn = own[-1]
        spliced = _splice(tokenizer, (asked[0][:index], asked[1]), text, turn)
        if spliced is not None:
            ids, drift = spliced
            return Rendered(ids, text, *asked, spliced=True, drift=drift)
    return Rendered(tokenizer.encode_rendered(text), text, *asked, rerendered=len(own))


def _splice(tokenizer, before: tuple, text: str, turn) -> tuple[np.ndarray, bool] | None:
    """The prompt extending `turn`'s call, and whether its text drifted; None where the
    template's rendering does not extend what that call was prompted with.

    Args:
        before: the messages before the turn and the tools, as the template takes them.
    """
    asked = turn.templated
    if asked is None or (asked.messages, asked.tools) != before:
        return None
    prefix = asked.text
    if not text.startswith(prefix):
        return None
    completion = turn.call.completion
    ended = len(completion) and int(completion[-1]) == tokenizer.eos_id
    sampled = tokenizer.decode(completion[:-1] if ended else completion)
    eos = tokenizer.decode([tokenizer.eos_id])
    start = len(prefix)
    drift = not text.startswith(sampled, start)
    at = text.find(eos, start if drift else start + len(sampled))
    if at < 0:
        return None
    drift = drift or at != start + len(sampled)
    close = [] if ended else [tokenizer.eos_id]
    rest = tokenizer.encode_rendered(text[at + len(eos) :])
    ids = np.concatenate([turn.call.prompt, completion, np.array(close, np.int32), rest])
    return ids.astype(np.int32), drift
