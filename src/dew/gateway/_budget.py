"""How many tokens the gateway's prompt of a first request holds, before anything is served.

A run sizes its context (and refuses a task that cannot fit) by its agents' first prompts. An
agent's request is rendered by the gateway with more than its messages: the tools' schemas (a
leading system turn under dew's template, the template's own place under a checkpoint's), what
`tool_choice` asks, and the template's wrapping of each turn. Counting the messages alone sized
a tool environment's runs too short for its first call; so the length is the one the gateway
itself renders, with a session of its own that serves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dew.gateway._record import GatewaySession, Template
from dew.gateway._schema import chat_request


def first_prompt_length(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
) -> int:
    """The tokens of the gateway's prompt for a chat request of `messages` and `tools` (the
    generation prompt included), under `tokenizer`'s template.

    Raises:
        ApiError: as the gateway would answer the request (naming the field that is wrong).
    """
    body: dict[str, Any] = {"model": "dew", "messages": [dict(m) for m in messages]}
    if tools:
        body["tools"] = [dict(tool) for tool in tools]
    session = GatewaySession(
        "",
        "",
        label=None,
        engine=None,
        template=Template.of(tokenizer),
        max_calls=None,
        on_close=lambda _: None,
    )
    return len(session.chat_prompt(chat_request(body)).ids)
