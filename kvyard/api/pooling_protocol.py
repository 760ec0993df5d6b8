"""Request bodies of the pooling endpoints: `/v1/embeddings` (OpenAI's shape), `/v1/rerank` (Jina's and Cohere's,
as vLLM serves it) and `/score` (vLLM's), validated as strictly as the completion bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvyard.api.protocol import MAX_PROMPTS

# Qwen3-Reranker's task when a request names none (its model card's default).
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
MAX_TEXT_CHARS = 1 << 22


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: the server's default (unit length)
    cache_salt: str | None = Field(default=None, max_length=256)


class ScoringFields(BaseModel):
    """What rerank and score share: the task the judging prompt names, and truncation."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    instruction: str = Field(default=DEFAULT_INSTRUCTION, max_length=4096)  # kvyard extension: the <Instruct>
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)


class RerankRequest(ScoringFields):
    query: str = Field(max_length=MAX_TEXT_CHARS)
    documents: list[str] = Field(min_length=1, max_length=MAX_PROMPTS)
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True


class ScoreRequest(ScoringFields):
    """vLLM's `/score`: `text_1` a query (or one per `text_2`), `text_2` the documents."""

    text_1: str | list[str]
    text_2: str | list[str]
