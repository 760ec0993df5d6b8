"""The OpenAPI document of the replica API, built from the request models (served at `GET /openapi.json`).

Request bodies are the models the servers validate with, so the schema cannot drift from what is accepted;
fuzzers (schemathesis) and client generators read it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvyard.api.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from kvyard.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

_REF = "#/components/schemas/{model}"
_BODIES: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/completions": (CompletionRequest, "Completions, whole or streamed (server-sent events)"),
    "/v1/chat/completions": (ChatCompletionRequest, "Chat completions, whole or streamed (server-sent events)"),
    "/tokenize": (TokenizeRequest, "Text, token ids or chat messages to token ids"),
    "/detokenize": (DetokenizeRequest, "Token ids to text"),
    "/v1/embeddings": (EmbeddingRequest, "Embeddings: the prompts' final hidden states, pooled"),
    "/v1/rerank": (RerankRequest, "Documents ordered by a yes/no judge's probability of yes (Jina/Cohere shape)"),
    "/score": (ScoreRequest, "Scores of text pairs by a yes/no judge (vLLM's shape)"),
}
_GETS = {"/v1/models": "The served models", "/health": "200 once the model serves", "/version": "kvyard's version"}
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def openapi_document(
    version: str, paths: tuple[str, ...] = (*_BODIES, *_GETS), unknown_fields_ignored: bool = False
) -> dict[str, Any]:
    """The document for the endpoints in `paths` (a router serves the OpenAI ones only); with
    `unknown_fields_ignored`, request bodies may carry fields beyond the known ones (the server drops them)."""
    schemas: dict[str, Any] = {"Error": _ERROR}
    operations: dict[str, Any] = {}
    for path in paths:
        if path in _BODIES:
            model, summary = _BODIES[path]
            operations[path] = {"post": _post(model, summary, schemas)}
            schemas[model.__name__]["additionalProperties"] = unknown_fields_ignored
        elif path in _GETS:
            operations[path] = {"get": {"summary": _GETS[path], "responses": {"200": {"description": "OK"}}}}
    info = {"title": "kvyard OpenAI-compatible API", "version": version}
    return {"openapi": "3.1.0", "info": info, "paths": operations, "components": {"schemas": schemas}}


def _post(model: type[BaseModel], summary: str, schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    error = {"description": "OpenAI-style error", "content": _json({"$ref": _REF.format(model="Error")})}
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json({"$ref": _REF.format(model=model.__name__)})},
        "responses": {"200": {"description": "The answer"}, "400": error, "401": error, "404": error, "429": error},
    }


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}
