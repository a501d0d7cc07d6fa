"""How the gateway reads a request: its body within the size and time limits, then the body
parsed into a checked request and its fingerprint, on the event loop or off it by the body's
size.

Apart from `_server.py`'s `Gateway` because none of it knows of sessions or engines: each
function takes the limits it checks (the gateway's options) as arguments.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import trio

from dew.gateway._api_error import ApiError, invalid
from dew.gateway._http import content_length
from dew.gateway._schema import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    parse_json,
)

# A body at least this large is parsed and rendered in a worker thread: the event loop serves
# every session, and reading a request of megabytes on it would hold them all (200,000 messages
# in 6 MB took seconds). Smaller ones stay on the loop, where a thread's round trip would cost
# more than the work.
OFF_LOOP_BYTES = 1 << 16


class Gone(Exception):
    """The client hung up before its request was read."""


async def read_body(scope, receive, *, max_body: int, body_timeout: float) -> bytes:
    """The request's whole body.

    Raises:
        Gone: when the client hung up first.
        ApiError: 413 when the body is above `max_body` bytes (by its content-length header or
            as it arrives); 408 when it has not all arrived within `body_timeout` seconds.
    """
    length = content_length(scope)
    if length is not None and length > max_body:
        raise ApiError(
            413,
            f"the request body holds {length} bytes, above {max_body}",
            code="request_too_large",
        )
    chunks, size = [], 0
    with trio.move_on_after(body_timeout):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Gone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_body:
                raise ApiError(
                    413,
                    f"the request body is above {max_body} bytes",
                    code="request_too_large",
                )
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)
    raise ApiError(
        408,
        f"the request body did not arrive within the gateway's body_timeout of {body_timeout:g} s",
        code="request_timeout",
    )


async def off_loop(size: int, limiter: trio.CapacityLimiter, function: Callable, *args):
    """`function(*args)`, in a worker thread under `limiter` when the request's body is `size`
    bytes or more (see OFF_LOOP_BYTES), where it holds no other session's request."""
    if size < OFF_LOOP_BYTES:
        return function(*args)
    return await trio.to_thread.run_sync(functools.partial(function, *args), limiter=limiter)


def read_chat(
    body: bytes, as_chat, max_messages: int, max_tools: int
) -> tuple[dict, dict, ChatRequest, bytes]:
    """A chat (or Responses, through `as_chat`) body's payload, the chat payload it stands
    for, the parsed request and the body's fingerprint."""
    request_payload = parse_json(body)
    payload = request_payload
    limit = max_messages
    if as_chat is not None:
        payload = as_chat(request_payload, max_messages=limit, max_tools=max_tools)
        limit += 1  # `instructions` adds a leading system message to the items
    request = chat_request(payload, max_messages=limit, max_tools=max_tools)
    return request_payload, payload, request, hashlib.sha256(body).digest()


def read_completion(body: bytes, vocab: int) -> tuple[CompletionRequest, bytes]:
    """A completions body's request, checked against the tokenizer's vocabulary of `vocab`
    ids, and its fingerprint."""
    request = completion_request(parse_json(body))
    if isinstance(request.prompt, str):
        if not request.prompt:
            raise invalid("prompt", "'prompt' must not be empty")
    else:
        for index, token in enumerate(request.prompt):
            if not 0 <= token < vocab:
                raise invalid(
                    "prompt",
                    f"prompt[{index}] is {token}: token ids must be in [0, {vocab}), the "
                    "tokenizer's vocabulary",
                )
    return request, hashlib.sha256(body).digest()
