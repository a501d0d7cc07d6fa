"""The gateway's side of its engines: the tokenizer they must share, whether an engine takes an
option, and one engine call that a client's hanging up cancels.

Apart from `_server.py`'s `Gateway`, which picks a session's engine and its sampling options,
because none of it routes or records: it only speaks to an engine.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import trio

from dew.gateway._api_error import ApiError
from dew.objectives.rl.sessions import Call
from dew.serve.tokenizer import BYTES, Tokenizer


def engines_tokenizer(tokenizer: Any, servers) -> Tokenizer:
    """The gateway's tokenizer: `tokenizer`, else the first engine's, else the byte one; every
    engine that names its tokenizer must agree with it on the ids (vocabulary, stop and special
    ids), or the prompts the gateway renders would mean other text to it."""
    own = [getattr(server, "tokenizer", None) for server in servers]
    if tokenizer is None:
        tokenizer = next((t for t in own if t is not None), BYTES)
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(
            f"tokenizer must implement dew.serve.tokenizer.Tokenizer, got {tokenizer!r}"
        )
    ids = (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.special_ids)
    for index, other in enumerate(own):
        if other is not None and other is not tokenizer:
            if (other.vocab_size, other.eos_id, other.special_ids) != ids:
                raise ValueError(
                    f"engine {index}'s tokenizer {other!r} differs from the gateway's {tokenizer!r}"
                )
    return tokenizer


def takes(function, name: str) -> bool:
    """Whether `function` takes a keyword argument `name`."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


async def engine_call(
    server, session, prompt: np.ndarray, receive, *, max_tokens: int, stop: int, options
) -> Call | None:
    """`server.generate` of a session's prompt, cancelled when the client hangs up; None then.

    Args:
        server: the session's engine.
        session: the `GatewaySession` the call runs under (`running` while it does).
        receive: the request's ASGI receive, watched for the client's disconnect.
        max_tokens: the call's budget of completion tokens.
        stop: the stop token (the tokenizer's end of sequence).
        options: the call's sampling options (`Sampling.options`).

    Raises:
        ApiError: 500 when the engine failed (the session is then an infrastructure fault) or
            the call was cancelled otherwise; 410 when the session closed meanwhile.
    """
    outcome: dict[str, Any] = {}

    async def watch(cancel_scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        outcome["gone"] = True
        cancel_scope.cancel(reason="client hung up")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, nursery.cancel_scope)
        with session.running():
            try:
                outcome["call"] = await server.generate(
                    prompt, max_tokens=max_tokens, stop=(stop,), **options
                )
            except Exception as error:
                outcome["error"] = error
        nursery.cancel_scope.cancel(reason="call answered")
    if "error" in outcome:
        error = outcome["error"]
        session.fail(f"engine: {type(error).__name__}: {error}")
        raise ApiError(
            500,
            f"the engine failed the call: {error}",
            type="server_error",
            code="engine_error",
        )
    if "call" in outcome:
        return outcome["call"]
    if outcome.get("gone"):
        return None
    session.check_open()
    raise ApiError(500, "the engine call was cancelled", type="server_error", code="cancelled")
