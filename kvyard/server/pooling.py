"""The pooling endpoints' work between a validated body and the engine: inputs to token prompts, prompts to
embeddings or scores, results to the response bodies vLLM's clients read.

Embeddings pool the final hidden states of any served decoder (the last token's, or the mean, normalized), as
decoder embedding models such as Qwen3-Embedding are used. Scores are what yes/no rerankers such as
Qwen3-Reranker compute: the model's chat template renders a judging prompt of instruction, query and document,
and the score is the probability of the answer token `yes` against `no` after it."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.api.checks import check_token_ids
from kvyard.api.errors import APIError, bad_request
from kvyard.api.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest, ScoringFields
from kvyard.api.protocol import MAX_PROMPTS
from kvyard.engine.pooling.params import PoolingParams
from kvyard.server.backend import ReplicaEngine, Vocabulary
from kvyard.server.prepare import vocabulary_of

JUDGE_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)


@dataclass(frozen=True, slots=True)
class PoolingJob:
    """Token prompts to pool, all with the same parameters."""

    request_id: str
    prompts: list[list[int]]
    params: PoolingParams
    cache_salt: str | None

    @property
    def num_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)


async def run_job(engine: ReplicaEngine, job: PoolingJob) -> list[list[float]]:
    """Every prompt's pooled result, in order; the prompts run side by side in the engine."""

    async def one(index: int, prompt: list[int]) -> list[float]:
        output = await engine.pool(f"{job.request_id}-{index}", prompt, job.params, job.cache_salt)
        assert output.pooled is not None, "a pooling request finished without its result"
        return output.pooled

    return list(await asyncio.gather(*(one(index, prompt) for index, prompt in enumerate(job.prompts))))


# ------------------------------------------------------------------ embeddings


def embedding_job(engine: ReplicaEngine, body: EmbeddingRequest, method: str, salt: str | None) -> PoolingJob:
    prompts = [_truncated(prompt, body.truncate_prompt_tokens) for prompt in _embedding_inputs(engine, body)]
    for index, prompt in enumerate(prompts):
        _check_length(engine, prompt, f"input.{index}" if len(prompts) > 1 else "input")
    normalize = True if body.normalize is None else body.normalize
    params = PoolingParams(method=_method(engine, method), normalize=normalize)  # type: ignore[arg-type]
    return PoolingJob(f"embd-{uuid.uuid4().hex}", prompts, params, salt)


def embedding_response(
    engine: ReplicaEngine, body: EmbeddingRequest, job: PoolingJob, vectors: list[list[float]]
) -> dict[str, Any]:
    if body.dimensions is not None and vectors and body.dimensions != len(vectors[0]):
        raise bad_request(
            f"this model's embeddings have {len(vectors[0])} dimensions; shortening them (matryoshka) is not supported",
            "dimensions",
        )
    data = [
        {"object": "embedding", "index": index, "embedding": _encoded(vector, body.encoding_format)}
        for index, vector in enumerate(vectors)
    ]
    return {
        "id": job.request_id,
        "object": "list",
        "created": int(time.time()),
        "model": engine.model_name,
        "data": data,
        "usage": {"prompt_tokens": job.num_tokens, "total_tokens": job.num_tokens},
    }


def _embedding_inputs(engine: ReplicaEngine, body: EmbeddingRequest) -> list[list[int]]:
    given = body.input
    if isinstance(given, str):
        return [_encode(engine, given, body.add_special_tokens, "input")]
    if not given:
        raise bad_request("input is empty", "input")
    if len(given) > MAX_PROMPTS:
        raise bad_request(f"input holds {len(given)} items; at most {MAX_PROMPTS} per request", "input")
    if all(isinstance(item, int) for item in given):
        return [list(given)]  # type: ignore[arg-type]
    if all(isinstance(item, str) for item in given):
        return [_encode(engine, text, body.add_special_tokens, f"input.{i}") for i, text in enumerate(given)]  # type: ignore[arg-type]
    return [list(item) for item in given]  # type: ignore[arg-type]


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _method(engine: ReplicaEngine, configured: str) -> str:
    """`--pooling`; auto: the model directory's sentence-transformers pooling where it names one, else last."""
    if configured != "auto":
        return configured
    model_path = engine.server_info().get("model_path")
    return sentence_transformers_pooling(Path(model_path)) if isinstance(model_path, str) else "last"


def sentence_transformers_pooling(model_dir: Path) -> str:
    """The pooling a sentence-transformers model directory declares (`1_Pooling/config.json`): last or mean."""
    try:
        config = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return "last"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    return "last"


# ------------------------------------------------------------------ rerank and score


def score_pairs(body: ScoreRequest) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, or text_1 and text_2 item by item."""
    queries = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    documents = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not queries or not documents:
        raise bad_request("text_1 and text_2 must not be empty", "text_1" if not queries else "text_2")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise bad_request(
            f"text_1 has {len(queries)} items and text_2 {len(documents)}: give one text_1, or one per text_2", "text_2"
        )
    if len(documents) > MAX_PROMPTS:
        raise bad_request(f"text_2 holds {len(documents)} items; at most {MAX_PROMPTS} per request", "text_2")
    return list(zip(queries, documents))


def scoring_job(
    engine: ReplicaEngine,
    body: ScoringFields,
    pairs: Sequence[tuple[str, str]],
    answer_tokens: str,
    salt: str | None,
    param: str,
) -> PoolingJob:
    vocabulary = vocabulary_of(engine, param)
    choice = answer_token_ids(vocabulary, answer_tokens)
    prompts = [
        _truncated(judging_prompt(vocabulary, body.instruction, query, document), body.truncate_prompt_tokens)
        for query, document in pairs
    ]
    for index, prompt in enumerate(prompts):
        _check_length(engine, prompt, f"{param}.{index}")
    return PoolingJob(f"score-{uuid.uuid4().hex}", prompts, PoolingParams(choice_token_ids=choice), salt)


def judging_prompt(vocabulary: Vocabulary, instruction: str, query: str, document: str) -> list[int]:
    """The reranker's prompt through the model's chat template, thinking off (Qwen3-Reranker's format)."""
    messages = [
        {"role": "system", "content": JUDGE_SYSTEM},
        {"role": "user", "content": f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"},
    ]
    return vocabulary.render_chat(messages, True, {"enable_thinking": False})


def answer_token_ids(vocabulary: Vocabulary, answer_tokens: str) -> tuple[int, int]:
    """The (no, yes) token ids of `--score-tokens`; each must be one token of the model's vocabulary."""
    no, yes = answer_tokens.split(",")
    ids = [vocabulary.encode(word, add_special_tokens=False) for word in (no, yes)]
    if any(len(token_ids) != 1 for token_ids in ids):
        raise APIError(
            400,
            f"this model's tokenizer has no single token for each of {no!r} and {yes!r} "
            "(--score-tokens): it cannot score",
            "model",
            "model_cannot_score",
        )
    return ids[0][0], ids[1][0]


def rerank_response(engine: ReplicaEngine, body: RerankRequest, job: PoolingJob, scores: list[float]) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    kept = order[: body.top_n] if body.top_n else order
    results = [
        {
            "index": index,
            "relevance_score": scores[index],
            **({"document": {"text": body.documents[index]}} if body.return_documents else {}),
        }
        for index in kept
    ]
    return {
        "id": job.request_id,
        "model": engine.model_name,
        "results": results,
        "usage": {"prompt_tokens": job.num_tokens, "total_tokens": job.num_tokens},
    }


def score_response(engine: ReplicaEngine, job: PoolingJob, scores: list[float]) -> dict[str, Any]:
    data = [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)]
    return {
        "id": job.request_id,
        "object": "list",
        "created": int(time.time()),
        "model": engine.model_name,
        "data": data,
        "usage": {"prompt_tokens": job.num_tokens, "total_tokens": job.num_tokens},
    }


# ------------------------------------------------------------------ shared


def _encode(engine: ReplicaEngine, text: str, add_special_tokens: bool, param: str) -> list[int]:
    if not text:
        raise bad_request("an empty text has no tokens to pool", param)
    return vocabulary_of(engine, param).encode(text, add_special_tokens)


def _truncated(prompt: list[int], keep: int | None) -> list[int]:
    return prompt[-keep:] if keep is not None else prompt


def _check_length(engine: ReplicaEngine, prompt: list[int], param: str) -> None:
    if not prompt:
        raise bad_request("an empty prompt has no tokens to pool", param)
    check_token_ids(prompt, engine.limits.vocab_size, param, param)
    if len(prompt) >= engine.limits.max_model_len:
        raise bad_request(
            f"{len(prompt)} tokens; the model's context is {engine.limits.max_model_len} (use "
            "truncate_prompt_tokens to keep the last ones)",
            param,
            "context_length_exceeded",
        )
