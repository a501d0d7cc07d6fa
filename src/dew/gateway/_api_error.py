"""ApiError: a request the gateway answers with an OpenAI-style JSON error, and the two 400s
every part of the gateway raises (a field that is wrong, a field asking for what the gateway
cannot do).

Its own module because every room of the gateway raises it (the schema, the HTTP plumbing, the
templates, the budget, the recorded session) and none of them should need the schema for it.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the gateway answers with an OpenAI-style JSON error.

    Args:
        status: the HTTP status.
        message: what is wrong, naming the culprit.
        type: the OpenAI error type (`invalid_request_error`, `not_found_error`, ...).
        param: the request field at fault, or None.
        code: a machine-readable code, or None.
        retry: whether a client may retry it (sent as `x-should-retry`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry = retry

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for a field that is wrong."""
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> ApiError:
    """A 400 for a field asking for something the gateway cannot do."""
    return ApiError(400, message, param=param, code="unsupported_parameter")
