"""The attention backend is chosen once, by ModelRunner's `attention_backend`, and both match Hugging Face."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from kvyard.engine.runners.model_runner import ModelRunner
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.sampling.sampler import torch_argmax
from kvyard.engine.scheduling.request import Request
from kvyard.engine.scheduling.scheduler import ScheduledRequest
from kvyard.kernels.build import KernelsUnavailable
from kvyard.kernels.ops import NativeKernels
from kvyard.models import attention_backends
from kvyard.models.attention_backends import AttentionBackendUnavailable, select_attention_backend
from kvyard.models.decoder import CausalLM
from kvyard.models.layers import Linear, NativeElementwise
from kvyard.models.loader import load_model

BLOCK_SIZE = 4
NUM_NEW_TOKENS = 12
CHUNK = 7  # prompts longer than this are prefilled in chunks, the later ones over a cached prefix
PROMPT_LENGTHS = (1, 5, 16, 23)
CPU = torch.device("cpu")


def _model(model_dir: Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    return load_model(model_dir, dtype, CPU, max_positions=128)


def _runner(model: CausalLM, backend: str, dtype: torch.dtype = torch.float32) -> ModelRunner:
    blocks_per_seq = -(-(max(PROMPT_LENGTHS) + NUM_NEW_TOKENS) // BLOCK_SIZE)
    return ModelRunner(model, blocks_per_seq * len(PROMPT_LENGTHS), BLOCK_SIZE, dtype, CPU, attention_backend=backend)


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Continuous batching in miniature: every request advances each step, by a token or a prefill chunk
    (single-token queries first, as the runner requires); blocks are handed out up front."""
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [Request(f"r{i}", prompt, params, b"", BLOCK_SIZE) for i, prompt in enumerate(prompts)]
    blocks_per_seq = runner.kv_caches[0].shape[1] // BLOCK_SIZE // len(requests)
    for i, request in enumerate(requests):
        request.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
    while running := [r for r in requests if r.num_output_tokens < NUM_NEW_TOKENS]:
        steps = [ScheduledRequest(r, min(CHUNK, r.num_tokens - r.num_computed_tokens)) for r in running]
        steps.sort(key=lambda step: step.num_new_tokens != 1)
        sampled = runner.execute(steps)
        for step in steps:
            step.request.num_computed_tokens += step.num_new_tokens
        for token in sampled:
            token.request.append_token(token.token_id)
    return [r.output_token_ids for r in requests]


def _hugging_face_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = reference.generate(
                torch.tensor([prompt]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_both_backends_give_hugging_faces_greedy_tokens(
    model_dirs: dict[str, Path], native_kernels: NativeKernels, arch: str
) -> None:
    model_dir = model_dirs[arch]
    model = _model(model_dir)
    prompts = _prompts(model.config.vocab_size)
    expected = _hugging_face_greedy(model_dir, prompts)
    for backend in ("torch", "native"):
        runner = _runner(model, backend)
        assert runner.attention_backend.name == backend
        assert _greedy(runner, prompts) == expected, f"{backend} backend"


def _native_layers(model: nn.Module) -> list[object]:
    """What the layers run natively: each linear's small-row kernel, each fusable layer's kernels."""
    linears = [m.small_kernel for m in model.modules() if isinstance(m, Linear)]
    return linears + [m.native for m in model.modules() if isinstance(m, NativeElementwise)]


def test_the_choice_decides_every_native_path(model_dirs: dict[str, Path], native_kernels: NativeKernels) -> None:
    model = _model(model_dirs["llama"])
    auto = _runner(model, "auto")
    assert auto.attention_backend.name == "native"
    assert all(path is not None for path in _native_layers(model))
    assert auto.argmax != torch_argmax
    # The same model under a later runner takes that runner's choice, all of it.
    pure = _runner(model, "torch")
    assert pure.attention_backend.name == "torch"
    assert all(path is None for path in _native_layers(model))
    assert pure.argmax is torch_argmax


def test_native_refuses_a_bfloat16_model_and_auto_falls_back(model_dirs: dict[str, Path]) -> None:
    model = _model(model_dirs["llama"], torch.bfloat16)
    with pytest.raises(
        AttentionBackendUnavailable,
        match=r"float32 activations only, and the model's dtype is "
        r"torch\.bfloat16",
    ):
        _runner(model, "native", torch.bfloat16)
    runner = _runner(model, "auto", torch.bfloat16)
    assert runner.attention_backend.name == "torch"
    assert all(path is None for path in _native_layers(model))


def test_native_refuses_a_gpu() -> None:
    with pytest.raises(AttentionBackendUnavailable, match="CPU only"):
        select_attention_backend("native", torch.device("cuda"), torch.float32)
    assert select_attention_backend("auto", torch.device("cuda"), torch.float32).name == "torch"


def test_a_failed_kernel_build_stops_native_and_auto_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_kernels() -> NativeKernels:
        raise KernelsUnavailable("no C compiler (cc or gcc) on PATH")

    monkeypatch.setattr(attention_backends, "load_native_kernels", no_kernels)
    with pytest.raises(AttentionBackendUnavailable, match="no C compiler"):
        select_attention_backend("native", CPU, torch.float32)
    with caplog.at_level(logging.WARNING, logger=attention_backends.__name__):
        assert select_attention_backend("auto", CPU, torch.float32).name == "torch"
    assert "no C compiler" in caplog.text


def test_an_unknown_backend_name_is_refused() -> None:
    with pytest.raises(ValueError, match="one of auto, native, torch, not 'flash'"):
        select_attention_backend("flash", CPU, torch.float32)
