"""Embeddings, rerank and score: kvyard's pooled results equal Hugging Face transformers' on the same weights, in
the engine (`LLM.embed`) and through a real server and router on loopback."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from kvyard import LLM, PoolingParams
from kvyard.server.pooling import JUDGE_SYSTEM
from tests.router_utils import start_router
from tests.server_utils import ServerProcess, start_server

TOLERANCE = 1e-5
PROMPT_LENGTHS = (1, 5, 17, 40, 70)
SCORE_TOKENS = "no,is"  # single tokens of the test models' small vocabulary ("yes" is two there)


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _hidden(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden: torch.Tensor = model(torch.tensor([prompt])).last_hidden_state[0]
    return hidden


def _last_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([prompt])).logits[0, -1]
    return logits


def _max_diff(got: list[float] | None, expected: torch.Tensor) -> float:
    assert got is not None
    return float((torch.tensor(got, dtype=torch.float64) - expected.double()).abs().max())


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def engine_setup(request: Any, model_dirs: dict[str, Path]) -> Iterator[tuple[Path, LLM]]:
    model_dir = model_dirs[request.param]
    # Small steps: prompts of 17 tokens and more are computed in several chunks, which mean pooling sums over.
    with LLM(str(model_dir), block_size=16, max_num_batched_tokens=16) as llm:
        yield model_dir, llm


def test_last_token_embeddings_equal_transformers(engine_setup: tuple[Path, LLM]) -> None:
    model_dir, llm = engine_setup
    prompts = _prompts(llm.engine.limits.vocab_size)
    outputs = llm.embed(prompts)
    for prompt, output in zip(prompts, outputs):
        expected = torch.nn.functional.normalize(_hidden(model_dir, prompt)[-1], dim=0)
        assert _max_diff(output.pooled, expected) < TOLERANCE, len(prompt)
        assert output.finished and output.token_ids == []


def test_mean_and_unnormalized_embeddings_equal_transformers(engine_setup: tuple[Path, LLM]) -> None:
    model_dir, llm = engine_setup
    prompts = _prompts(llm.engine.limits.vocab_size)
    means = llm.embed(prompts, PoolingParams(method="mean"))
    raw = llm.embed(prompts, PoolingParams(normalize=False))
    for prompt, mean, last in zip(prompts, means, raw):
        hidden = _hidden(model_dir, prompt)
        assert _max_diff(mean.pooled, torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)) < TOLERANCE
        assert _max_diff(last.pooled, hidden[-1]) < TOLERANCE * float(hidden[-1].abs().max())


def test_prefix_cache_serves_last_token_pooling_but_not_mean(engine_setup: tuple[Path, LLM]) -> None:
    _, llm = engine_setup
    prompt = _prompts(llm.engine.limits.vocab_size)[-1]  # 70 tokens: 4 full blocks of 16
    llm.reset_prefix_cache()
    first, again = llm.embed([prompt])[0], llm.embed([prompt])[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 64)
    assert _max_diff(again.pooled, torch.tensor(first.pooled)) < TOLERANCE
    mean = PoolingParams(method="mean")
    mean_first, mean_again = llm.embed([prompt], mean)[0], llm.embed([prompt], mean)[0]
    assert mean_again.num_cached_tokens == 0
    assert _max_diff(mean_again.pooled, torch.tensor(mean_first.pooled)) < TOLERANCE


def test_choice_score_equals_transformers_softmax(engine_setup: tuple[Path, LLM]) -> None:
    model_dir, llm = engine_setup
    prompts = _prompts(llm.engine.limits.vocab_size)
    choice = (3, 11)
    outputs = llm.embed(prompts, PoolingParams(choice_token_ids=choice))
    for prompt, output in zip(prompts, outputs):
        expected = torch.softmax(_last_logits(model_dir, prompt)[list(choice)].double(), dim=0)[1]
        assert output.pooled is not None and len(output.pooled) == 1
        assert abs(output.pooled[0] - float(expected)) < TOLERANCE


def test_pooling_and_generation_share_a_batch(model_dirs: dict[str, Path]) -> None:
    """Embeddings computed beside generating requests are the ones computed alone, and the generations too."""
    from kvyard import SamplingParams

    model_dir = model_dirs["llama"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), block_size=16, max_num_batched_tokens=32) as llm:
        prompts = _prompts(llm.engine.limits.vocab_size)
        alone_vectors = [output.pooled for output in llm.embed(prompts)]
        alone_texts = [output.token_ids for output in llm.generate(prompts, greedy)]
        llm.reset_prefix_cache()
        for index, prompt in enumerate(prompts):
            llm.engine.add_request(f"g{index}", prompt, greedy)
            llm.engine.add_request(f"p{index}", prompt, SamplingParams(max_tokens=1), pooling=PoolingParams())
        finished: dict[str, Any] = {}
        while llm.engine.has_unfinished_requests():
            finished.update({output.request_id: output for output in llm.engine.step() if output.finished})
    for index in range(len(prompts)):
        assert finished[f"g{index}"].token_ids == alone_texts[index]
        assert _max_diff(finished[f"p{index}"].pooled, torch.tensor(alone_vectors[index])) < TOLERANCE


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def qwen3_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(model_dirs["qwen3"], tmp_path_factory.mktemp("logs"), "--score-tokens", SCORE_TOKENS)
    yield process
    process.stop()


def _embed(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)


def test_server_embeddings_of_texts_equal_transformers(
    qwen3_server: ServerProcess, model_dirs: dict[str, Path]
) -> None:
    model_dir = model_dirs["qwen3"]
    texts = ["The cache sits below the router.", "a", "Paged blocks " * 30]
    answer = _embed(qwen3_server.url, input=texts).json()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert [item["index"] for item in answer["data"]] == [0, 1, 2]
    total = 0
    for text, item in zip(texts, answer["data"]):
        ids = tokenizer(text)["input_ids"]
        total += len(ids)
        expected = torch.nn.functional.normalize(_hidden(model_dir, ids)[-1], dim=0)
        assert _max_diff(item["embedding"], expected) < TOLERANCE
    assert answer["usage"] == {"prompt_tokens": total, "total_tokens": total}
    assert answer["object"] == "list" and answer["model"] == model_dir.name


def test_server_base64_embeddings_are_the_float_ones(qwen3_server: ServerProcess) -> None:
    floats = _embed(qwen3_server.url, input=[[5, 6, 7, 8]]).json()["data"][0]["embedding"]
    packed = _embed(qwen3_server.url, input=[[5, 6, 7, 8]], encoding_format="base64").json()["data"][0]["embedding"]
    decoded = base64.b64decode(packed)
    as_float32 = [struct.unpack("<f", struct.pack("<f", value))[0] for value in floats]
    assert list(struct.unpack(f"<{len(decoded) // 4}f", decoded)) == as_float32


def _judge_ids(model_dir: Path, query: str, document: str, instruction: str) -> list[int]:
    """The judging prompt as transformers' tokenizer renders it (Qwen3-Reranker's format)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": JUDGE_SYSTEM},
        {"role": "user", "content": f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_server_rerank_scores_and_orders_as_transformers(
    qwen3_server: ServerProcess, model_dirs: dict[str, Path]
) -> None:
    model_dir = model_dirs["qwen3"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    no, yes = (tokenizer.convert_tokens_to_ids(word) for word in SCORE_TOKENS.split(","))
    query, documents, instruction = "what holds the blocks?", ["the pool", "a router", "disk and Redis"], "Find it"
    body = {"query": query, "documents": documents, "instruction": instruction}
    answer = httpx.post(f"{qwen3_server.url}/v1/rerank", json=body, timeout=60).json()
    expected = []
    for document in documents:
        logits = _last_logits(model_dir, _judge_ids(model_dir, query, document, instruction))
        expected.append(float(torch.softmax(logits[[no, yes]].double(), dim=0)[1]))
    results = answer["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
    for result in results:
        assert abs(result["relevance_score"] - expected[result["index"]]) < TOLERANCE
        assert result["document"] == {"text": documents[result["index"]]}
    top = httpx.post(f"{qwen3_server.url}/rerank", json={**body, "top_n": 1, "return_documents": False}).json()
    assert top["results"] == [{"index": results[0]["index"], "relevance_score": results[0]["relevance_score"]}]
    score_body = {"text_1": query, "text_2": documents, "instruction": instruction}
    score = httpx.post(f"{qwen3_server.url}/score", json=score_body, timeout=60).json()
    assert [item["score"] for item in score["data"]] == pytest.approx(expected, abs=TOLERANCE)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": 5}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": [[1, 2], [3, 999999]]}, "input.1"),
        ("/v1/embeddings", {"input": [[5] * 40000] * 2}, "input.0"),
        ("/v1/embeddings", {"input": "x", "dimensions": 3}, "dimensions"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "normalize": "yes"}, "normalize"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/score", {"text_1": ["a", "b", "c"], "text_2": ["a", "b"]}, "text_2"),
        ("/v1/embeddings", {"input": "x", "model": "other"}, "model"),
    ],
)
def test_server_refuses_bad_pooling_bodies_naming_the_field(
    qwen3_server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(f"{qwen3_server.url}{path}", json=body, timeout=30)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.text
    assert httpx.get(f"{qwen3_server.url}/health").status_code == 200


def test_truncation_keeps_the_last_tokens(qwen3_server: ServerProcess) -> None:
    long = list(range(1, 600))
    cut = _embed(qwen3_server.url, input=[long], truncate_prompt_tokens=100).json()
    tail = _embed(qwen3_server.url, input=[long[-100:]]).json()
    assert cut["usage"]["prompt_tokens"] == 100
    assert cut["data"][0]["embedding"] == pytest.approx(tail["data"][0]["embedding"], abs=TOLERANCE)


def test_unknown_fields_are_ignored_and_named(qwen3_server: ServerProcess) -> None:
    response = _embed(qwen3_server.url, input="hello", priority=0, extra_thing={"a": 1})
    assert response.status_code == 200
    assert response.headers["x-kvyard-ignored-fields"] in ("extra_thing, priority", "extra_thing")


def test_sentence_transformers_mean_pooling_is_read_from_the_model(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tmp_path / "mean-model"
    shutil.copytree(model_dirs["qwen3"], model_dir)
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    server = start_server(model_dir, tmp_path)
    try:
        vector = _embed(server.url, input=[[9, 8, 7, 6, 5]]).json()["data"][0]["embedding"]
    finally:
        server.stop()
    expected = torch.nn.functional.normalize(_hidden(model_dir, [9, 8, 7, 6, 5]).mean(dim=0), dim=0)
    assert _max_diff(vector, expected) < TOLERANCE


def test_router_forwards_pooling_requests(qwen3_server: ServerProcess, tmp_path: Path) -> None:
    router = start_router(tmp_path, [qwen3_server.url], replicas_publish_events=False)
    try:
        direct = _embed(qwen3_server.url, input=[[4, 5, 6]]).json()["data"]
        routed = _embed(router.url, input=[[4, 5, 6]]).json()["data"]
        ranked = httpx.post(f"{router.url}/v1/rerank", json={"query": "q", "documents": ["a", "b"]}, timeout=60)
    finally:
        router.stop()
    assert routed == direct
    assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2


def test_the_openai_client_reads_embeddings(qwen3_server: ServerProcess) -> None:
    """The official client asks for base64 by default and decodes it itself."""
    import openai

    client = openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key="unused")
    answer = client.embeddings.create(model="qwen3", input=["one text", "another"])
    direct = _embed(qwen3_server.url, input=["one text", "another"]).json()["data"]
    for item, expected in zip(answer.data, direct, strict=True):
        assert item.embedding == pytest.approx(expected["embedding"], abs=1e-6)
    assert answer.usage.prompt_tokens > 0


def _headless_copy(model_dir: Path, out: Path, architecture: str) -> Path:
    """The model saved as a base model, as embedding checkpoints ship: tensors without the `model.` prefix, no LM
    head, `tie_word_embeddings` false (Qwen3-Embedding-8B's config), under `architecture`."""
    AutoModel.from_pretrained(model_dir, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=[architecture], tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_base_model_checkpoint_embeds_and_refuses_to_generate(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from kvyard import SamplingParams

    model_dir = _headless_copy(model_dirs["qwen3"], tmp_path / "base", "Qwen3Model")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with LLM(str(model_dir)) as llm:
        vector = llm.embed([prompt])[0].pooled
        with pytest.raises(ValueError, match="no language-model head"):
            llm.generate([prompt], SamplingParams(max_tokens=2))
    expected = torch.nn.functional.normalize(_hidden(model_dirs["qwen3"], prompt)[-1], dim=0)
    assert _max_diff(vector, expected) < TOLERANCE


def test_server_of_an_embedding_checkpoint(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = _headless_copy(model_dirs["qwen3"], tmp_path / "embedding", "Qwen3ForCausalLM")
    server = start_server(model_dir, tmp_path, "--score-tokens", SCORE_TOKENS)
    try:
        vector = _embed(server.url, input=[[2, 7, 1, 8]]).json()["data"][0]["embedding"]
        completion = httpx.post(f"{server.url}/v1/completions", json={"prompt": [2, 7], "max_tokens": 2}, timeout=30)
        ranked = httpx.post(f"{server.url}/v1/rerank", json={"query": "q", "documents": ["d"]}, timeout=30)
    finally:
        server.stop()
    expected = torch.nn.functional.normalize(_hidden(model_dirs["qwen3"], [2, 7, 1, 8])[-1], dim=0)
    assert _max_diff(vector, expected) < TOLERANCE
    for refused in (completion, ranked):
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "model"
        assert "no language-model head" in refused.json()["error"]["message"]
