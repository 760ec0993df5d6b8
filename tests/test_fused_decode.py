"""The layers of a step of few rows in one native call each (kvyard.models.fused_decode) compute exactly what the
layers' modules compute: the same hidden states and the same KV-cache bytes, bit for bit, for every architecture,
weight format and KV-cache format, on decode steps and on steps with short chunks (a speculative verification, a
short prompt); steps it cannot compute go through the modules."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvyard.engine.runners.model_runner import PagedModel
from kvyard.kernels.ops import NativeKernels
from kvyard.models.decoder import CausalLM, DecoderLayer
from kvyard.models.loader import load_model
from kvyard.models.quantization import quantize_model

Step = Callable[[PagedModel, list[int], int], torch.Tensor]
BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 16
CPU = torch.device("cpu")


def _paged_model(model_dir: Path, scheme: str, kv_cache_dtype: str, num_seqs: int) -> PagedModel:
    model = load_model(model_dir, torch.float32, CPU, max_positions=256)
    quantize_model(model, scheme)
    return PagedModel(
        model,
        BLOCKS_PER_SEQ * num_seqs,
        BLOCK_SIZE,
        torch.float32,
        CPU,
        attention_backend="native",
        kv_cache_dtype=kv_cache_dtype,
    )


def _prefill(paged: PagedModel, prompt_lens: list[int]) -> None:
    """Fill each sequence's cache with a prompt (random ids), through the modules."""
    generator = torch.Generator().manual_seed(3)
    vocab = paged.model.config.vocab_size
    for seq, length in enumerate(prompt_lens):
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        paged.run(ids, list(range(length)), [_table(seq)], [length], [length])


def _table(seq: int) -> list[int]:
    return list(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))


def _decode(paged: PagedModel, prompt_lens: list[int], seed: int) -> torch.Tensor:
    """One decode step: a new token for every sequence, at the position after its prompt."""
    ids = torch.randint(
        0, paged.model.config.vocab_size, (len(prompt_lens),), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    tables = [_table(seq) for seq in range(len(prompt_lens))]
    return paged.run(ids, list(prompt_lens), tables, [n + 1 for n in prompt_lens], [1] * len(prompt_lens))


def _mixed(paged: PagedModel, prompt_lens: list[int], seed: int) -> torch.Tensor:
    """Two decodes, a 3-token chunk over the third sequence's cached prompt (as a speculative verification is),
    and a fourth sequence's whole 4-token prompt."""
    first, second, third = prompt_lens
    ids = torch.randint(
        0, paged.model.config.vocab_size, (2 + 3 + 4,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    positions = [first, second, *range(third, third + 3), *range(4)]
    tables = [_table(seq) for seq in range(4)]
    return paged.run(ids, positions, tables, [first + 1, second + 1, third + 3, 4], [1, 1, 3, 4])


def _modules_only(monkeypatch: pytest.MonkeyPatch, model: CausalLM) -> None:
    monkeypatch.setattr(model, "fused_decode", None)


def _forbid_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the decode step went through the layers' modules")

    monkeypatch.setattr(DecoderLayer, "forward", refuse)


def _compare_one_step(
    paged: PagedModel, prompt_lens: list[int], monkeypatch: pytest.MonkeyPatch, step: Step = _decode
) -> None:
    before = [cache.clone() for cache in paged.kv_caches]
    with monkeypatch.context() as patch:
        _forbid_modules(patch)
        fused = step(paged, prompt_lens, 5)
    fused_caches = [cache.clone() for cache in paged.kv_caches]
    for cache, saved in zip(paged.kv_caches, before):
        cache.copy_(saved)
    with monkeypatch.context() as patch:
        _modules_only(patch, paged.model)
        reference = step(paged, prompt_lens, 5)
    assert torch.equal(fused, reference)
    for ours, theirs in zip(fused_caches, paged.kv_caches):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", ["none", "int8", "fp16", "bf16"])
def test_fused_layers_equal_the_modules_bit_for_bit(
    model_dirs: dict[str, Path],
    native_kernels: NativeKernels,
    arch: str,
    scheme: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt_lens = [5, 17, 30]
    paged = _paged_model(model_dirs[arch], scheme, "auto", len(prompt_lens))
    assert paged.model.fused_decode is not None
    _prefill(paged, prompt_lens)
    _compare_one_step(paged, prompt_lens, monkeypatch)
    _compare_one_step(paged, prompt_lens[:1], monkeypatch)  # a single stream


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(("scheme", "kv_cache_dtype"), [("none", "auto"), ("int8", "int8")])
def test_fused_layers_equal_the_modules_on_steps_with_chunks(
    model_dirs: dict[str, Path],
    native_kernels: NativeKernels,
    arch: str,
    scheme: str,
    kv_cache_dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An int8 cache rounds what it stores, so there even the whole-prompt chunk reads its keys from the cache.
    prompt_lens = [6, 13, 21]
    paged = _paged_model(model_dirs[arch], scheme, kv_cache_dtype, 4)
    _prefill(paged, prompt_lens)
    _compare_one_step(paged, prompt_lens, monkeypatch, _mixed)


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "bf16", "int8"])
def test_fused_layers_write_every_kv_format_as_the_modules_do(
    model_dirs: dict[str, Path],
    native_kernels: NativeKernels,
    kv_cache_dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt_lens = [9, 22]
    paged = _paged_model(model_dirs["qwen3"], "int8", kv_cache_dtype, len(prompt_lens))
    _prefill(paged, prompt_lens)
    _compare_one_step(paged, prompt_lens, monkeypatch)


def test_steps_beyond_the_small_row_kernels_go_through_the_modules(
    model_dirs: dict[str, Path], native_kernels: NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fp32 projections leave their small-rows kernel beyond 16 rows (for oneDNN): the fused call must not run.
    prompt_lens = [3] * 17
    paged = _paged_model(model_dirs["llama"], "none", "auto", len(prompt_lens))
    fused = paged.model.fused_decode
    assert fused is not None and fused.max_rows == 16
    _prefill(paged, prompt_lens)
    calls: list[int] = []
    original = type(fused).__call__
    monkeypatch.setattr(type(fused), "__call__", lambda self, *args: calls.append(1) or original(self, *args))
    _decode(paged, prompt_lens, seed=1)
    assert calls == []
    _decode(paged, prompt_lens[:16], seed=1)
    assert calls == [1]


def test_a_model_on_the_torch_backend_has_no_fused_path(model_dirs: dict[str, Path]) -> None:
    model = load_model(model_dirs["llama"], torch.float32, CPU, max_positions=64)
    PagedModel(model, 8, BLOCK_SIZE, torch.float32, CPU, attention_backend="torch")
    assert model.fused_decode is None
