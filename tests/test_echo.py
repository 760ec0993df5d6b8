"""Prompt logprobs and `echo`: each prompt token's log-probability equals Hugging Face's on the same weights
(through chunked prefill, never from a cache), and `/v1/completions` with `echo` returns the prompt before the
completion, with its tokens' logprobs and `text_offset`, whole and streamed alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_utils import ServerProcess
from transformers import AutoModelForCausalLM

from kvyard import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_logprobs_match_hugging_face_through_chunks_and_without_the_cache(
    model_dirs: dict[str, Path], arch: str
) -> None:
    prompt = torch.randint(3, 900, (75,), generator=torch.Generator().manual_seed(4)).tolist()
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    with LLM(str(model_dirs[arch]), max_num_batched_tokens=32) as llm:  # the 75-token prompt in three chunks
        llm.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's blocks are now in the prefix cache
        for output in llm.generate([prompt, prompt], params):
            assert output.num_cached_tokens == 0
            scored = output.prompt_logprobs
            assert scored is not None and len(scored) == len(prompt) and scored[0] is None
            for position, entry in enumerate(scored[1:], start=1):
                assert entry is not None and entry.token_id == prompt[position]
                assert entry.logprob == pytest.approx(float(reference[position - 1, prompt[position]]), abs=1e-4)
                assert list(entry.top) == reference[position - 1].topk(3).indices.tolist()
        later = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
        assert later.num_cached_tokens > 0 and later.prompt_logprobs is None


@pytest.fixture(scope="module")
def server(llama_server: ServerProcess) -> ServerProcess:
    return llama_server


def _streamed(server: ServerProcess, body: dict[str, Any]) -> tuple[str, dict[str, list[Any]]]:
    text, logprobs = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            for key in logprobs:
                logprobs[key] += (choice["logprobs"] or {}).get(key, [])
    return text, logprobs


def test_echo_returns_the_prompt_and_its_logprobs_whole_and_streamed(server: ServerProcess, llama_dir: Path) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    offline = LLM(str(llama_dir)).generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    )[0]
    assert whole["text"] == prompt + offline.text
    logprobs = whole["logprobs"]
    num_tokens = len(offline.prompt_token_ids) + 3
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == num_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert offline.prompt_logprobs is not None and offline.logprobs is not None
    expected = [e.logprob for e in offline.prompt_logprobs[1:] if e is not None] + [e.logprob for e in offline.logprobs]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(num_tokens)]
    streamed_text, streamed = _streamed(server, body)
    assert streamed_text == whole["text"]
    assert streamed["tokens"] == logprobs["tokens"] and streamed["text_offset"] == logprobs["text_offset"]
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": None}, timeout=60).json()
    assert plain["choices"][0]["text"] == whole["text"] and plain["choices"][0]["logprobs"] is None
