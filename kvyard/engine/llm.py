"""Offline batch inference: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvyard.engine.config import EngineConfig
from kvyard.engine.llm_engine import LLMEngine, RequestOutput
from kvyard.engine.pooling.params import PoolingParams
from kvyard.engine.sampling.params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs a model over a whole batch of prompts with continuous batching.

    Keyword options are the settings of `EngineConfig` and of the configs it nests (`kvyard generate --help`
    lists them): block_size, num_kv_blocks, max_num_batched_tokens, max_num_seqs, max_model_len, dtype, ...
    and kv_tier (a `kvyard.kvcache.KVTierConfig`: keep KV blocks in memory, on disk and in Redis across
    runs and machines; call `close()`, or use `with LLM(...)`, so queued blocks are written).
    """

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.create(model, **options))
        self._next_id = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        llm._next_id = 0
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Write out queued KV-tier blocks and release the tier."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. between benchmark runs); call between generate calls."""
        self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        token_lists = [self._tokenize(p, index) for index, p in enumerate(prompt_list)]
        requests = [(tokens, params, None) for tokens, params in zip(token_lists, params_list)]
        return self._run(self._add_all(requests, cache_salt), use_tqdm)

    def embed(
        self,
        prompts: Sequence[Prompt] | Prompt,
        pooling: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Pool every prompt (default: the last token's final hidden state, normalized); each output's `pooled` is
        the embedding, or with `pooling.choice_token_ids` a one-value score. Outputs come back in prompt order."""
        pooling = pooling or PoolingParams()
        token_lists = [self._tokenize(p, index) for index, p in enumerate(_as_prompt_list(prompts))]
        requests = [(tokens, SamplingParams(max_tokens=1), pooling) for tokens in token_lists]
        return self._run(self._add_all(requests, cache_salt), use_tqdm)

    def _add_all(
        self, requests: Sequence[tuple[list[int], SamplingParams, PoolingParams | None]], cache_salt: str | None
    ) -> list[str]:
        """Queue every request, or none: one the engine refuses takes back those queued before it."""
        request_ids: list[str] = []
        for index, (tokens, params, pooling) in enumerate(requests):
            request_id = str(self._next_id)
            self._next_id += 1
            try:
                self.engine.add_request(request_id, tokens, params, cache_salt=cache_salt, pooling=pooling)
            except ValueError as error:
                for added in request_ids:
                    self.engine.abort_request(added)
                raise ValueError(f"prompt {index}: {error}") from error
            request_ids.append(request_id)
        return request_ids

    def _tokenize(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this model directory has none")
            if not prompt:
                raise ValueError(f"prompt {index} is empty: at least one token is required")
            tokens: list[int] = self.engine.tokenizer.encode(prompt)
            return tokens
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise TypeError(f"prompt {index} must be a string or a list of token ids")
        return prompt

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Sequence[Prompt] | Prompt) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
