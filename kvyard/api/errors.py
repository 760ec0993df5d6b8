"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

`InputError` is what a check of user input raises anywhere (engine included): a `ValueError` that
also knows which field it is about. `APIError` is its HTTP form, with a status and `Retry-After`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


class InputError(ValueError):
    """Bad user input; the message names the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        if param is not None and param.split(".")[0] not in message:
            message = f"{param}: {message}"
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(slots=True)
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None

    @classmethod
    def from_input(cls, error: InputError) -> APIError:
        return cls(400, str(error), error.param, error.code)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 whose message names the offending field."""
    return APIError.from_input(InputError(message, param, code))
