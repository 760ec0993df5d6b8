"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used, so servers built on other frameworks need not load FastAPI
    from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}  # fmt: skip


@dataclass(slots=True)
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.retry_after)


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, retry_after: int | None = None
) -> JSONResponse:
    from fastapi.responses import JSONResponse

    body = error_body(status, message, param, code)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


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
    if param is not None and param.split(".")[0] not in message:
        message = f"{param}: {message}"
    return APIError(400, message, param, code)
