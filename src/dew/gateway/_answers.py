"""The gateway's answers in the OpenAI schema: a sampled call cut at its stops, as a JSON body or
as server-sent event chunks, with log-probs.

Log-probs are reported for the completion's tokens but a final stop token (OpenAI leaves the stop
token out). `top_logprobs` lists each position's most likely tokens as the engine reported them
(`Call.top_logprobs`, under the distribution the token was drawn from); an engine that reports
none gets the sampled token alone in each list. Each token is reported with its own bytes
(`token_bytes`): a token that holds part of a multi-byte character has that part's bytes, so the
reply's tokens' bytes join into the reply's UTF-8.
A stream is the same answer cut into chunks: concatenating the chunks' content and log-probs
gives the JSON body's, token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any

import attrs
import numpy as np
import orjson

from dew.gateway._template import Reply
from dew.objectives.rl.sessions import Call


@attrs.frozen
class Sample:
    """A call's completion as answered.

    Args:
        call: the call to record: its completion ends with the stop token, or with the token
            that completed a stop string, or where its budget ran out.
        text: the text answered (without stop token or stop string).
        tokens: the completion ids reported: the completion without a final stop token; cut at
            a stop string, the ids up to the first whose text reaches the end of the answered
            text (OpenAI reports no log-prob of a stop string: the stop string's tokens were
            sampled and are recorded, but not answered).
        finish: "stop" or "length" (the caller turns a stop with tool calls into "tool_calls").
    """

    call: Call
    text: str
    tokens: np.ndarray
    finish: str


def cut(call: Call, tokenizer, stops: tuple[str, ...]) -> Sample:
    """Cut a completion after the token that completes the first stop string.

    The engine stops on the stop token only; a stop string is honoured after sampling by keeping
    the completion up to it (the tokens after it were sampled but are not part of the answer,
    and a prefix of a sample is a sample, so the behaviour log-probs stay right).
    """
    completion = call.completion
    ended = len(completion) and int(completion[-1]) == tokenizer.eos_id
    body = completion[:-1] if ended else completion
    text = tokenizer.decode(body)
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    if not hits:
        return Sample(call, text, body, "stop" if ended else "length")
    at, stop = min(hits)
    keep = next(k for k in range(1, len(body) + 1) if stop in tokenizer.decode(body[:k]))
    support = None if call.support is None else call.support[:keep]
    top = None if call.top_logprobs is None else call.top_logprobs[:keep]
    kept = Call(call.prompt, body[:keep], call.logprobs[:keep], call.version, support, top)
    answered = text[:at]
    reported = next(
        (k for k in range(keep + 1) if tokenizer.decode(body[:k]).startswith(answered)), keep
    )
    return Sample(kept, answered, body[:reported], "stop")


def _reported_logprobs(sample: Sample) -> np.ndarray:
    """The log-probs of the reported tokens (the completion's but a final stop token's)."""
    return sample.call.logprobs[: len(sample.tokens)]


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """Each token id's own bytes, as OpenAI's log-probs report them (`bytes`): the tokenizer's
    `token_bytes` where it has one (dew's tokenizers do: a token holding part of a multi-byte
    character has that part's bytes), else the token's decoded text."""
    own = getattr(tokenizer, "token_bytes", None)
    if own is not None:
        return own
    return lambda token: tokenizer.decode(np.array([token], np.int32)).encode()


def token_text(raw: bytes) -> str:
    """A token's text as OpenAI writes it: its bytes as UTF-8, or, where they are no text alone
    (part of a character), `bytes:` and the bytes escaped (`bytes:\\xc3`)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + raw.decode(errors="backslashreplace")


def _alternatives(sample: Sample, top: int, vocab_size: int):
    """Per reported token, its `top` most likely ids and their log-probs as lists, or None
    where the engine reported none. Ids past the tokenizer's vocabulary (a model's padded
    rows) are left out: they are no text to report."""
    reported = sample.call.top_logprobs
    if not top or reported is None:
        return None
    listed = []
    for ids, values in reported[: len(sample.tokens)]:
        ids, values = np.asarray(ids), np.asarray(values)
        known = ids < vocab_size
        listed.append((ids[known][:top].tolist(), values[known][:top].tolist()))
    return listed


def _chat_entry(spell, token: int, logprob: float) -> dict[str, Any]:
    raw = spell(token)
    return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(sample: Sample, tokenizer, top: int) -> list[dict[str, Any]]:
    """The `logprobs.content` entries of a sample's reported tokens."""
    spell = token_bytes(tokenizer)
    entries = []
    tokens = sample.tokens.tolist()
    logprobs = _reported_logprobs(sample).tolist()
    alternatives = _alternatives(sample, top, tokenizer.vocab_size)
    for k, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        entry = _chat_entry(spell, token, logprob)
        if alternatives is not None:
            pairs = zip(*alternatives[k], strict=True)
            listed = [_chat_entry(spell, *pair) for pair in pairs]
        else:
            listed = [entry] if top else []
        entries.append({**entry, "top_logprobs": listed})
    return entries


def text_deltas(sample: Sample, tokenizer) -> list[str]:
    """The answer's text cut per reported token: a token that ends inside a character (a
    multi-byte character split over tokens) adds nothing until the character is whole."""
    deltas, sent = [], 0
    for k in range(1, len(sample.tokens) + 1):
        prefix = tokenizer.decode(sample.tokens[:k])
        end = len(sample.text) if k == len(sample.tokens) else len(prefix)
        if prefix.endswith("\ufffd") and k < len(sample.tokens):
            end = sent
        end = min(max(end, sent), len(sample.text))
        deltas.append(sample.text[sent:end])
        sent = end
    return deltas


def usage(call: Call) -> dict[str, int]:
    prompt, completion = len(call.prompt), len(call.completion)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        for call_id, name, arguments in reply.tool_calls
    ]


def finish_reason(sample: Sample, reply: Reply) -> str:
    return "tool_calls" if reply.tool_calls else sample.finish


def assistant_message(reply: Reply) -> dict[str, Any]:
    """The reply as a chat answer's assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return message


def chat_body(
    completion_id: str, model: str, sample: Sample, reply: Reply, tokenizer, request
) -> dict[str, Any]:
    """A chat completion's JSON body."""
    message = assistant_message(reply)
    logprobs = None
    if request.sampled.logprobs:
        content = chat_logprobs(sample, tokenizer, request.sampled.top_logprobs)
        logprobs = {"content": content, "refusal": None}
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason(sample, reply),
            }
        ],
        "usage": usage(sample.call),
    }


def chat_chunks(
    completion_id: str, model: str, sample: Sample, reply: Reply, tokenizer, request
) -> Iterator[dict[str, Any]]:
    """A chat completion's stream chunks: the role, the content per token (or, for tool calls,
    the content then one chunk per call), the finish reason, and the usage when asked."""
    created = int(time.time())
    sampled = request.sampled

    def chunk(delta, logprobs=None, finish=None):
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
        }
        if sampled.include_usage:
            body["usage"] = None
        return body

    entries = chat_logprobs(sample, tokenizer, sampled.top_logprobs) if sampled.logprobs else None

    def logprobs(start, stop=None):
        if entries is None:
            return None
        return {"content": entries[start:stop], "refusal": None}

    yield chunk({"role": "assistant", "content": ""})
    if reply.tool_calls:
        first = True
        if reply.content:
            yield chunk({"content": reply.content}, logprobs(0))
            first = False
        for index, call in enumerate(_tool_calls(reply)):
            yield chunk({"tool_calls": [{"index": index, **call}]}, logprobs(0) if first else None)
            first = False
    else:
        for k, delta in enumerate(text_deltas(sample, tokenizer)):
            yield chunk({"content": delta}, logprobs(k, k + 1))
    yield chunk({}, finish=finish_reason(sample, reply))
    if sampled.include_usage:
        yield {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [],
            "usage": usage(sample.call),
        }


def _legacy_logprobs(sample: Sample, tokenizer, top: int, offset: int) -> dict[str, Any]:
    """A text completion's `logprobs`: each reported token's text, log-prob, top list and
    offset in the answer's text (`offset` where the completion starts), where the stream's
    delta of that token starts."""
    spell = token_bytes(tokenizer)
    tokens = [token_text(spell(t)) for t in sample.tokens.tolist()]
    logprobs = _reported_logprobs(sample).tolist()
    deltas = text_deltas(sample, tokenizer)
    offsets = list(accumulate((len(delta) for delta in deltas), initial=offset))[:-1]
    alternatives = _alternatives(sample, top, tokenizer.vocab_size)
    if alternatives is None:
        listed = [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)]
    else:
        # Keyed by text, which ids that spell the same text share: each key keeps its most
        # likely id's log-prob, the first listed.
        listed = []
        for ids, values in alternatives:
            texts: dict[str, float] = {}
            for token, logprob in zip(ids, values, strict=True):
                texts.setdefault(token_text(spell(token)), logprob)
            listed.append(texts)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": listed,
        "text_offset": offsets,
    }


def completion_body(
    completion_id: str, model: str, sample: Sample, tokenizer, request, prompt_text
):
    """A (legacy) text completion's JSON body."""
    echoed = prompt_text if request.echo else ""
    logprobs = None
    if request.sampled.logprobs:
        logprobs = _legacy_logprobs(sample, tokenizer, request.sampled.top_logprobs, len(echoed))
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "text": echoed + sample.text,
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": sample.finish,
            }
        ],
        "usage": usage(sample.call),
    }


def completion_chunks(
    completion_id: str, model: str, sample: Sample, tokenizer, request, prompt_text
):
    """A text completion's stream chunks: one per token, then the finish, then the usage."""
    created = int(time.time())

    def chunk(text, logprobs=None, finish=None):
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
        }

    offset = len(prompt_text) if request.echo else 0
    if request.echo:
        yield chunk(prompt_text)
    whole = None
    if request.sampled.logprobs:
        whole = _legacy_logprobs(sample, tokenizer, request.sampled.top_logprobs, offset)
    for k, delta in enumerate(text_deltas(sample, tokenizer)):
        logprobs = None if whole is None else {key: its[k : k + 1] for key, its in whole.items()}
        yield chunk(delta, logprobs)
    yield chunk("", finish=sample.finish)
    if request.sampled.include_usage:
        body = chunk("")
        body["choices"] = []
        body["usage"] = usage(sample.call)
        yield body


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"
