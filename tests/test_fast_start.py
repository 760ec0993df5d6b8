"""Serving a weight package before PyTorch loads: the native fast-start engine (kvyard.engine.fast_start.engine), the
PyTorch engine taking over its requests and blocks, and `kvyard serve` doing both."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from server_utils import start_server

from kvyard.api.errors import InputError
from kvyard.engine.config import EngineConfig
from kvyard.engine.core import EngineCore
from kvyard.engine.fast_start.engine import NativeStartEngine, fast_start_blocker
from kvyard.engine.fast_start.native_runner import runs_natively
from kvyard.engine.llm_engine import LLMEngine
from kvyard.engine.sampling.bad_words import bad_words_token_ids
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.speculative.policy import SpeculativeConfig
from kvyard.models.config import load_model_config
from kvyard.models.layers import RotaryEmbedding
from kvyard.models.mapped_safetensors import MappedTensorsError, map_tensors
from kvyard.models.native_model import NativeModel
from kvyard.models.package import PackageError, convert
from kvyard.models.rope_tables import rotary_tables
from kvyard.testing.model_presets import DEMO_MODEL_DIR

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def packages(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("packages")
    schemes = {"llama": ("int8", "fp16", "bf16"), "qwen2": ("int8",), "qwen3": ("int8",)}
    converted = {
        (arch, scheme): root / f"{arch}-{scheme}" for arch, arch_schemes in schemes.items() for scheme in arch_schemes
    }
    for (arch, scheme), out in converted.items():
        convert(model_dirs[arch], scheme, out)
    return {**converted, **{(arch, "none"): model_dirs[arch] for arch in schemes}}  # checkpoints as stored


def _prompts() -> list[list[int]]:
    """Few rows a step (every step stays on the PyTorch engine's fused few-rows path), a shared prefix."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 17, 1)]
    return [*prompts, [*prompts[1][:16], 9, 10]]


def _run(
    engine: EngineCore,
    prompts: list[list[int]],
    takeover: tuple[int, LLMEngine] | None = None,
    params: SamplingParams = GREEDY,
) -> dict[str, list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    tokens, step = {}, 0
    while engine.has_unfinished_requests():
        if takeover is not None and step == takeover[0]:
            assert isinstance(engine, NativeStartEngine)
            takeover[1].take_over(engine)
            engine = takeover[1]
        tokens.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
        step += 1
    return tokens


@pytest.mark.parametrize(
    ("arch", "scheme", "kv"),
    [
        ("llama", "int8", "auto"),
        ("llama", "fp16", "int8"),
        ("llama", "bf16", "fp16"),
        ("qwen2", "int8", "auto"),
        ("qwen3", "int8", "int8"),
        ("llama", "none", "auto"),
        ("qwen2", "none", "int8"),
        ("qwen3", "none", "auto"),
    ],
)
def test_the_native_engine_and_a_takeover_give_the_pytorch_engines_tokens(
    packages: dict[tuple[str, str], Path], arch: str, scheme: str, kv: str
) -> None:
    # fp32 layers take their few-rows kernels up to 16 rows (converted ones up to 64): steps of at most that many
    batched = 16 if scheme == "none" else 2048
    config = EngineConfig.create(
        str(packages[arch, scheme]),
        kv_cache_dtype=kv,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=batched,
        kv_tier=None,
    )
    expected = _run(LLMEngine(config), _prompts())
    native = NativeStartEngine(config)
    assert _run(native, _prompts()) == expected
    native = NativeStartEngine(config)
    full = LLMEngine(config, native.kv_buffers)
    assert (full.namespace, full.limits) == (native.namespace, native.limits)
    assert _run(native, _prompts(), takeover=(3, full)) == expected  # mid-prefill and mid-decode of others


def test_bad_words_are_banned_alike_on_the_native_kernels_and_in_pytorch(model_dirs: dict[str, Path]) -> None:
    config = EngineConfig.create(
        str(model_dirs["llama"]), num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, kv_tier=None
    )
    pytorch = LLMEngine(config)
    plain = _run(pytorch, _prompts())
    word, sequences = _bad_word_generated(pytorch.tokenizer, list(plain.values()), config)
    banned = replace(GREEDY, bad_words=[word])
    expected = _run(LLMEngine(config), _prompts(), params=banned)
    assert _run(NativeStartEngine(config), _prompts(), params=banned) == expected != plain
    for tokens in expected.values():
        assert not any(_contains(tokens, sequence) for sequence in sequences)


def _bad_word_generated(tokenizer: Any, outputs: list[list[int]], config: EngineConfig) -> tuple[str, list[Any]]:
    """A word of two tokens the outputs hold (as one of its token sequences), and its sequences."""
    vocab_size = load_model_config(config.model).vocab_size
    for tokens in outputs:
        for start in range(len(tokens) - 1):
            word = tokenizer.decode(tokens[start : start + 2])
            try:
                sequences = bad_words_token_ids([word], tokenizer, vocab_size)
            except InputError:
                continue
            if tuple(tokens[start : start + 2]) in sequences:
                return word, sequences
    raise AssertionError("no output holds a two-token word")


def _contains(tokens: list[int], sequence: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(sequence)]) == sequence for i in range(len(tokens) - len(sequence) + 1))


def test_both_models_build_the_same_rotary_tables(model_dirs: dict[str, Path]) -> None:
    from kvyard.models.config import load_model_config

    config = load_model_config(model_dirs["qwen3"])
    rotary = RotaryEmbedding(config.rope, config.head_dim, 300)
    rotary.build(torch.device("cpu"))
    cos, sin = rotary_tables(config.rope, config.head_dim, 300)
    assert np.array_equal(rotary.cos_table.numpy(), cos) and np.array_equal(rotary.sin_table.numpy(), sin)


def test_what_the_native_engine_cannot_run_waits_or_starts_without_it(
    packages: dict[tuple[str, str], Path], llama_dir: Path
) -> None:
    assert runs_natively(SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_tokens=2))
    assert runs_natively(SamplingParams(bad_words=["x"], skip_special_tokens=False, priority=1))
    for params in (
        SamplingParams(seed=1),
        SamplingParams(logprobs=2),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(logit_bias={3: 1.0}),
        SamplingParams(prompt_logprobs=1),
    ):
        assert not runs_natively(params)
    package = str(packages["llama", "int8"])
    assert fast_start_blocker(EngineConfig.create(package)) is None
    assert fast_start_blocker(EngineConfig.create(str(llama_dir))) is None  # a checkpoint as stored
    assert "converts at load time" in str(fast_start_blocker(EngineConfig.create(str(llama_dir), quantization="int8")))
    assert "speculative" in str(
        fast_start_blocker(EngineConfig.create(package, speculative=SpeculativeConfig("ngram")))
    )
    assert "bfloat16" in str(fast_start_blocker(EngineConfig.create(package, dtype="bfloat16")))


def test_a_broken_package_is_refused_by_the_native_model(packages: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    package = packages["llama", "int8"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in package.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    tensors = broken / "model.safetensors"
    whole = tensors.read_bytes()
    tensors.write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(PackageError, match="corrupt or truncated"):
        NativeModel.from_package(broken, 64, {}, 1)
    with pytest.raises(MappedTensorsError, match="does not fit"):
        map_tensors(tensors)
    tensors.write_bytes(whole[:1000])
    with pytest.raises(MappedTensorsError, match="more than the file holds"):
        map_tensors(tensors)


def test_serve_answers_on_the_native_kernels_then_pytorch_takes_over(
    packages: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    package = packages["llama", "int8"]
    offline = LLMEngine(EngineConfig.create(str(package), kv_tier=None))
    prompt = _prompts()[1]
    expected = _run(offline, [prompt])["r0"]
    server = start_server(package, tmp_path, "--served-model-name", "p")
    try:
        body = {"model": "p", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        seeded = httpx.post(
            f"{server.url}/v1/completions", timeout=60, json={**body, "temperature": 0.8, "seed": 5, "logprobs": 1}
        ).json()
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        log = server.log()
    finally:
        assert server.stop() == 0
    assert "on the native kernels" in log and "took over" in log
    assert seeded["choices"][0]["logprobs"] is not None  # waited for the PyTorch engine
    tokenized = [_text(answer) for answer in (first, again)]
    assert tokenized[0] == tokenized[1]
    assert first["usage"]["completion_tokens"] == len(expected)


def _text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["text"])


def test_serve_help_names_the_fast_start_switch() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvyard", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--no-fast-start" in result.stdout


def test_a_pytorch_engine_that_fails_after_a_fast_start_ends_the_replica_with_the_reason(
    packages: dict[tuple[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests waiting for the PyTorch engine get a 503 naming why it failed; the load error ends the replica
    (`kvyard serve` exits 1 on it), as any failed load does."""
    from kvyard.api.errors import APIError
    from kvyard.server import model_server
    from kvyard.server.app import ReplicaApp
    from kvyard.server.async_engine import AsyncEngine
    from kvyard.server.options import ServerOptions

    def broken_engine(config: EngineConfig, kv_buffers: object) -> LLMEngine:
        raise RuntimeError("libtorch_cpu.so: cannot open shared object file")

    monkeypatch.setattr(model_server, "_torch_engine", broken_engine)
    config = EngineConfig.create(str(packages["llama", "int8"]), num_kv_blocks=64, kv_tier=None)

    async def scenario() -> tuple[BaseException | None, list[int], str]:
        app = ReplicaApp(ServerOptions())
        engines: list[AsyncEngine] = []
        original = model_server._native_start

        async def native_then_wait(*args: Any) -> AsyncEngine | None:
            native = await original(*args)
            assert native is not None
            waiting.append(asyncio.ensure_future(_collect(native, SamplingParams(max_tokens=4, seed=3))))
            greedy.extend(await _collect(native, SamplingParams(max_tokens=4, temperature=0)))
            return native

        waiting: list[asyncio.Future[list[int]]] = []
        greedy: list[int] = []
        monkeypatch.setattr(model_server, "_native_start", native_then_wait)
        await model_server._load(app, config, engines)
        with pytest.raises(APIError, match="libtorch_cpu") as refused:
            await waiting[0]
        for engine in engines:
            engine.stop()
        return app.load_error, greedy, str(refused.value.status)

    load_error, greedy, status = asyncio.run(scenario())
    assert isinstance(load_error, RuntimeError) and len(greedy) == 4 and status == "503"


async def _collect(engine: Any, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(f"req-{id(params)}", list(range(5, 25)), params):
        tokens = output.token_ids
    return tokens


@pytest.mark.parametrize("kv_name", ["fp32", "fp16", "bf16", "int8"])
def test_numpy_blocks_are_the_bytes_pytorch_reads_and_writes(kv_name: str) -> None:
    """The fast-start engine's KV tier and transfers see the same block bytes as LLMEngine's, both ways."""
    from kvyard.engine.fast_start.native_blocks import CODEC_NAMES, NumpyBlocks
    from kvyard.engine.kv_links.device_blocks import DeviceBlocks
    from kvyard.kvcache.codec import DecodedBlock
    from kvyard.models.kv_format import KVFormat
    from kvyard.models.native_model import KV_STORAGE

    kv_format, block_size, num_blocks = KVFormat(kv_name), 4, 6
    shape = (2, num_blocks * block_size, 3, kv_format.row_width(8))
    row_bytes = kv_format.row_bytes(8)
    caches = [
        torch.randint(0, 256, (*shape[:3], row_bytes), dtype=torch.uint8).view(kv_format.storage_dtype)
        for _ in range(2)
    ]  # random bits: the blocks are compared as bytes
    views = [cache.view(torch.uint8).numpy().view(KV_STORAGE[kv_name][0]) for cache in caches]
    device, native = DeviceBlocks(caches, block_size, kv_format.codec_name), NumpyBlocks(views, block_size, kv_name)
    assert native.format == device.format and CODEC_NAMES[kv_name] == kv_format.codec_name
    read = [bytes(row) for row in native.read([4, 1, 3])]
    assert read == [bytes(row) for row in device.read([4, 1, 3])]
    native.write([0, 5], [DecodedBlock(b"k", b"", memoryview(payload)) for payload in read[:2]])
    assert [bytes(row) for row in device.read([0, 5])] == read[:2]


def test_the_embedded_demo_stored_in_fp16_starts_on_the_native_kernels_with_the_same_tokens() -> None:
    """The demo (the README's first command) keeps its weights in fp16 for an fp32 model: both engines widen them."""
    config = EngineConfig.create(
        str(DEMO_MODEL_DIR), num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, kv_tier=None
    )
    assert fast_start_blocker(config) is None
    prompts = [list(range(40, 40 + n)) for n in (3, 11, 7)]
    assert _run(NativeStartEngine(config), prompts) == _run(LLMEngine(config), prompts)
