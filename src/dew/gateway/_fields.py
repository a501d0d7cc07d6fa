"""What the gateway does with each standard field of a Chat Completions and a Completions request:
honoured, overridden by the engine's sampling, ignored, or refused. Public as
`dew.gateway.CHAT_FIELDS` and `COMPLETION_FIELDS`; docs/gateway.md's tables are read against it.
"""

from __future__ import annotations

from collections.abc import Mapping

# What each standard field does. "honoured" fields change the answer; "ignored" ones are accepted
# and have no effect: the behaviour policy's sampling settings are the gateway's, so that what
# is trained on is what the engine sampled under the settings the trainer chose.
CHAT_FIELDS: Mapping[str, str] = {
    "model": "ignored: one policy is served under whatever name (GET /v1/models lists it)",
    "messages": "honoured: rendered with the chat template (see docs/gateway.md)",
    "stream": "honoured: server-sent events ending with [DONE]",
    "stream_options": "honoured: include_usage adds the usage chunk",
    "max_tokens": "honoured: clipped to the gateway's max_tokens and to the context left",
    "max_completion_tokens": "honoured: as max_tokens, and it wins when both are sent",
    "n": "honoured: 1 only; above 1 is refused (below 1 too)",
    "stop": "honoured: the reply is cut after the token that completes a stop string",
    "logprobs": "honoured: the behaviour log-prob of each sampled token",
    "top_logprobs": (
        "honoured: 0 to 20 (above 0 with logprobs true), each position's most likely tokens "
        "with their log-probs under the behaviour policy's distribution (tokens it cannot draw, "
        "filtered by top-k/top-p, are left out); an engine without "
        "`generate(top_logprobs=...)` lists the sampled token alone"
    ),
    "tools": "honoured: rendered into a leading system turn, or as a checkpoint's own chat "
    "template renders them",
    "tool_choice": "honoured: rendered as an instruction (under a checkpoint's own chat "
    "template, added to the system message); 'none' turns off tool-call parsing; 'required' "
    "with no tools is refused",
    "parallel_tool_calls": "ignored: every parsed tool call is returned",
    "response_format": "honoured in part: the format or schema is rendered as an instruction "
    "(under a checkpoint's own chat template, added to the system message), never enforced by "
    "constrained decoding",
    "temperature": "ignored: the gateway's sampling settings are the behaviour policy's; "
    "outside OpenAI's [0, 2] it is refused",
    "top_p": "ignored: as temperature; outside [0, 1] it is refused",
    "seed": "ignored: each call's key comes from the rollout's label and call index",
    "frequency_penalty": "ignored: as temperature; outside [-2, 2] it is refused",
    "presence_penalty": "ignored: as temperature; outside [-2, 2] it is refused",
    "logit_bias": "ignored: as temperature",
    "user": "ignored",
    "metadata": "ignored",
    "store": "ignored: nothing is stored beyond the rollout's record",
    "service_tier": "ignored",
    "reasoning_effort": "ignored",
    "verbosity": "ignored",
    "modalities": "honoured: text only; audio is refused",
    "audio": "refused when given",
    "prediction": "ignored",
    "prompt_cache_key": "ignored",
    "prompt_cache_retention": "ignored",
    "safety_identifier": "ignored",
    "web_search_options": "refused when given",
    "functions": "refused when given: use tools",
    "function_call": "refused when given: use tool_choice",
}
"""What the gateway does with each field of a chat-completions request: honoured, overridden by
the engine's sampling, ignored, or refused (400)."""


COMPLETION_FIELDS: Mapping[str, str] = {
    "model": CHAT_FIELDS["model"],
    "prompt": "honoured: a string, one string in a list, or a list of token ids",
    "stream": CHAT_FIELDS["stream"],
    "stream_options": CHAT_FIELDS["stream_options"],
    "max_tokens": "honoured: clipped to the gateway's max_tokens and to the context left "
    "(default 16, as OpenAI's)",
    "n": CHAT_FIELDS["n"],
    "best_of": "honoured: 1 only; above 1 is refused",
    "stop": CHAT_FIELDS["stop"],
    "logprobs": "honoured: an int 0..5, each token's log-prob and its top list of that many",
    "echo": "honoured without logprobs; with logprobs it is refused (prompt log-probs are not "
    "computed)",
    "suffix": "refused when given",
    "temperature": CHAT_FIELDS["temperature"],
    "top_p": CHAT_FIELDS["top_p"],
    "seed": CHAT_FIELDS["seed"],
    "frequency_penalty": CHAT_FIELDS["frequency_penalty"],
    "presence_penalty": CHAT_FIELDS["presence_penalty"],
    "logit_bias": CHAT_FIELDS["logit_bias"],
    "user": "ignored",
}
"""What the gateway does with each field of a completions request (same wording as CHAT_FIELDS)."""
