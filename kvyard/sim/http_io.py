"""JSON in and out of the simulated replica's aiohttp handlers, with OpenAI-style errors."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvyard.api.errors import APIError, bad_request, error_body

_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json", headers=headers)


def error_json(error: APIError) -> web.Response:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return json_response(error_body(error.status, error.message, error.param, error.code), error.status, headers)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as error:
        raise bad_request(f"request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def validate(body: dict[str, Any], model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise validation_error(error) from error


async def parse_body(request: web.Request, model: type[BaseModel]) -> Any:
    return validate(await read_json(request), model)


def take_token_ids(body: dict[str, Any]) -> list[int] | None:
    """A long token-id `prompt`, taken out of `body` so that validating the rest stays cheap."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and set(map(type, prompt)) == {int}:
        body["prompt"] = prompt[:1]
        return prompt
    return None


def validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    parts = [str(p) for p in first.get("loc", ()) if str(p) not in _UNION_TAGS and "[" not in str(p)]
    param = ".".join(p for p in parts if not p.startswith("function-")) or None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {param}", param, "extra_forbidden")
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param, first.get("type"))


def int_query(request: web.Request, name: str, default: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {value!r}", name) from None


def sse_bytes(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
