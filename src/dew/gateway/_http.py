"""What the gateway reads from an ASGI request's scope (the API key, the client's retry count and
conversation, the body's length) and how it writes a JSON or server-sent-event response.

Apart from `_server.py`'s `Gateway`, which routes each request to its session and engine,
because none of it knows of sessions: it is HTTP alone.
"""

from __future__ import annotations

from typing import Any

import orjson

from dew.gateway._answers import sse
from dew.gateway._api_error import ApiError, invalid

_JSON = [(b"content-type", b"application/json")]


def bearer(scope) -> str | None:
    """The API key of the request's `Authorization: Bearer KEY` header, None without one.

    Raises:
        ApiError: 401 when the header is there but not a bearer key.
    """
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                raise ApiError(
                    401,
                    "the Authorization header must be 'Bearer <the session's api_key>'",
                    code="invalid_api_key",
                )
            return key.strip()
    return None


def retry_count(scope) -> int:
    for name, value in scope["headers"]:
        if name == b"x-stainless-retry-count":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def conversation(scope) -> str | None:
    """The request's `X-Session-ID` header: the client's name for the conversation it continues
    (verifiers names each agent trace so), or None."""
    for name, value in scope["headers"]:
        if name == b"x-session-id":
            return value.decode("latin-1")
    return None


def content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise invalid(None, "the content-length header is not an integer") from None
    return None


async def send_json(send, status: int, body: dict[str, Any], headers=()) -> None:
    data = orjson.dumps(body)
    length = [(b"content-length", str(len(data)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": [*_JSON, *length, *headers]}
    )
    await send({"type": "http.response.body", "body": data})


async def send_stream(send, events, encode=sse, done: bool = True) -> None:
    """Send `events`, each encoded as one server-sent event, then chat's `[DONE]` unless not
    `done` (the Responses stream ends with its last event)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        }
    )
    for event in events:
        await send({"type": "http.response.body", "body": encode(event), "more_body": True})
    await send({"type": "http.response.body", "body": sse("[DONE]") if done else b""})


def model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "dew"}
