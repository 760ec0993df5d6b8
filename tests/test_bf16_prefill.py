"""A many-row step of a model that multiplies in bf16 keeps its activations in bf16 between the matmuls
(kvyard.models.bf16_prefill) and computes exactly what the layers' modules compute: the same hidden states and the
same KV-cache bytes, bit for bit, for each weight format and KV-cache format, on whole prompts and on steps that
mix decodes with a chunk over a cached prefix; the native kernels it adds round as PyTorch does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvyard.engine.runners.model_runner import PagedModel
from kvyard.kernels.ops import NativeKernels
from kvyard.models.decoder import DecoderLayer
from kvyard.models.loader import load_model
from kvyard.models.quantization import cpu_has_fast_bf16, quantize_model

Step = Callable[[PagedModel], torch.Tensor]
BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 16
CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not cpu_has_fast_bf16(), reason="bf16 prefill attention needs AMX or AVX512-BF16")


def _paged_model(model_dir: Path, scheme: str, kv_cache_dtype: str) -> PagedModel:
    model = load_model(model_dir, torch.float32, CPU, max_positions=256)
    quantize_model(model, scheme)
    return PagedModel(
        model,
        BLOCKS_PER_SEQ * 4,
        BLOCK_SIZE,
        torch.float32,
        CPU,
        attention_backend="native",
        kv_cache_dtype=kv_cache_dtype,
        bf16_matmul=True,
    )


def _ids(paged: PagedModel, count: int, seed: int) -> list[int]:
    vocab = paged.model.config.vocab_size
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _table(seq: int) -> list[int]:
    return list(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))


def _whole_prompts(paged: PagedModel) -> torch.Tensor:
    """Two sequences' whole prompts, 40 and 25 tokens, in one step."""
    positions = [*range(40), *range(25)]
    return paged.run(_ids(paged, 65, 1), positions, [_table(0), _table(1)], [40, 25], [40, 25])


def _mixed(paged: PagedModel) -> torch.Tensor:
    """After _whole_prompts: a decode for each of its sequences, a 20-token chunk after the first sequence's
    prompt (in its own blocks, as a continued conversation), and a third sequence's whole 12-token prompt."""
    paged.run(_ids(paged, 20, 2), list(range(20)), [_table(2)], [20], [20])
    positions = [40, 25, *range(20, 40), *range(12)]
    tables = [_table(0), _table(1), _table(2), _table(3)]
    return paged.run(_ids(paged, 34, 3), positions, tables, [41, 26, 40, 12], [1, 1, 20, 12])


def _forbid_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the step went through the layers' modules")

    monkeypatch.setattr(DecoderLayer, "forward", refuse)


def _compare(paged: PagedModel, monkeypatch: pytest.MonkeyPatch, steps: list[Step]) -> None:
    """Each step on the bf16 path, then on the modules from the same caches: equal outputs and cache bytes."""
    before = [cache.clone() for cache in paged.kv_caches]
    with monkeypatch.context() as patch:
        _forbid_modules(patch)
        ours = [step(paged) for step in steps]
    our_caches = [cache.clone() for cache in paged.kv_caches]
    for cache, saved in zip(paged.kv_caches, before):
        cache.copy_(saved)
    with monkeypatch.context() as patch:
        patch.setattr(paged.model, "bf16_prefill", None)
        theirs = [step(paged) for step in steps]
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)
    for mine, reference in zip(our_caches, paged.kv_caches):
        assert torch.equal(mine, reference)


@pytest.mark.parametrize(
    ("scheme", "kv_cache_dtype"),
    [("none", "auto"), ("none", "bf16"), ("bf16", "bf16"), ("int8", "int8"), ("int8", "fp16"), ("bf16", "auto")],
)
def test_bf16_activations_equal_the_modules_bit_for_bit(
    model_dirs: dict[str, Path],
    native_kernels: NativeKernels,
    scheme: str,
    kv_cache_dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    paged = _paged_model(model_dirs["llama"], scheme, kv_cache_dtype)
    assert paged.model.bf16_prefill is not None
    _compare(paged, monkeypatch, [_whole_prompts, _mixed])


def test_steps_it_does_not_compute_go_through_the_modules(
    model_dirs: dict[str, Path], native_kernels: NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Query/key norms (Qwen3) and QKV biases (Qwen2) are computed in fp32 by the modules: no bf16 path there.
    for arch in ("qwen2", "qwen3"):
        assert _paged_model(model_dirs[arch], "none", "auto").model.bf16_prefill is None
    paged = _paged_model(model_dirs["llama"], "none", "auto")
    bf16 = paged.model.bf16_prefill
    assert bf16 is not None
    calls: list[int] = []
    original = type(bf16).__call__

    def counted(self: object, *args: object) -> object:
        calls.append(1)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(type(bf16), "__call__", counted)
    paged.run(_ids(paged, 16, 4), list(range(16)), [_table(0)], [16], [16])  # small-rows kernels: fp32
    assert calls == []
    _whole_prompts(paged)
    assert calls == [1]


def test_the_bf16_kernels_round_as_pytorch_does(native_kernels: NativeKernels) -> None:
    kernels, generator = native_kernels.elementwise, torch.Generator().manual_seed(0)
    rows, dim, eps = 37, 96, 1e-6
    residual, weight = torch.randn(rows, dim, generator=generator), torch.randn(dim, generator=generator)
    x16 = torch.randn(rows, dim, generator=generator).bfloat16()
    ours, theirs = residual.clone(), residual.clone()
    normed = kernels.add_rms_norm_bf16(x16, ours, weight, eps)
    assert torch.equal(normed, kernels.add_rms_norm(x16.float(), theirs, weight, eps).bfloat16())
    assert torch.equal(ours, theirs)
    gate_up = (torch.randn(rows, 2 * dim, generator=generator) * 4).bfloat16()
    gate, up = gate_up.split(dim, dim=-1)
    assert torch.equal(kernels.silu_mul_bf16(gate_up), F.silu(gate).mul(up))
    table = torch.randn(64, 8, generator=generator)
    qkv = torch.randn(rows, 3 * 16, generator=generator).bfloat16()
    q = qkv[:, :32].view(rows, 2, 16)
    positions = torch.randint(0, 64, (rows,), generator=generator)
    expected = q.float()
    kernels.rotary(expected, table, table.flip(0), positions)
    kernels.rotary_bf16(q, table, table.flip(0), positions)
    assert torch.equal(q, expected.bfloat16())
    with pytest.raises(ValueError, match="bf16"):
        kernels.rotary_bf16(q.float(), table, table, positions)
