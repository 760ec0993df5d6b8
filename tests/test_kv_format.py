"""KV-cache formats: fp16, bf16, and int8 rows with their own scale, beside fp32.

The bytes a native kernel stores equal PyTorch's; the int8 round trip and the attention kernels are held to a
float64 reference with stated tolerances; an engine serving each format keeps it apart in block keys, holds more
blocks in the same memory, and round-trips its blocks through the KV tier byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvyard import LLM
from kvyard.engine.sampling.params import SamplingParams
from kvyard.kernels.ops import NativeKernels
from kvyard.kvcache.block_key import chain_block_keys
from kvyard.kvcache.config import KVTierConfig
from kvyard.models.attention import AttentionBackend, build_attention_metadata, paged_attention
from kvyard.models.attention_backends import CPUNativeBackend, TorchSDPABackend
from kvyard.models.kv_format import KVFormat, dequantize_int8_rows, quantize_int8_rows, store_rows, to_storage

FORMATS = ("fp16", "bf16", "int8")
CPU = torch.device("cpu")
# Largest relative rounding error of one stored value: half a unit in the last place (fp16 keeps 11 significant
# bits, bf16 8); int8 is bounded per row instead, by half its scale.
HALF_ULP = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def _values(num_tokens: int, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes, plus the rows where rounding has edges: all zero, one large value
    among small ones, fp16's overflow threshold (65520 rounds to inf, 65504 is its largest value) and its
    subnormals."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.empty(num_tokens, num_kv_heads, 1).uniform_(-3, 3, generator=generator)
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * magnitudes
    x[0, 0] = 0.0
    x[1, 0] = 1e-3
    x[1, 0, 3] = 50.0
    edges = torch.tensor([65504.0, 65519.0, 65520.0, -7e4, 6e-8, 2.9e-8, 3e-8, 1e-9, 2.0**-14, -(2.0**-20)])
    x[2, 0, : len(edges)] = edges[:head_dim]
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 20])  # whole vectors, and a scalar tail
@pytest.mark.parametrize("build", ["native", "portable"])
def test_the_store_kernel_writes_the_bytes_pytorch_writes(
    native_kernels: NativeKernels, portable: NativeKernels, fmt: str, head_dim: int, build: str
) -> None:
    kernels = native_kernels if build == "native" else portable
    kv_format = KVFormat(fmt)
    num_tokens, num_kv_heads, num_slots = 40, 3, 64
    k, v = _values(num_tokens, num_kv_heads, head_dim, 1), _values(num_tokens, num_kv_heads, head_dim, 2)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(3))[:num_tokens]
    shape = (2, num_slots, num_kv_heads, kv_format.row_width(head_dim))
    by_torch = torch.zeros(shape, dtype=kv_format.storage_dtype)
    store_rows(by_torch[0], slots, k)
    store_rows(by_torch[1], slots, v)
    by_kernel = torch.zeros(shape, dtype=kv_format.storage_dtype)
    kernels.store_kv(by_kernel[0], by_kernel[1], slots, k, v)
    assert torch.equal(by_kernel.view(torch.uint8), by_torch.view(torch.uint8))


def test_the_store_kernel_reads_strided_rows_of_a_fused_projection(native_kernels: NativeKernels) -> None:
    qkv = _values(12, 6, 32, 4).view(12, 6 * 32)
    k, v = qkv[:, 64:128].view(12, 2, 32), qkv[:, 128:].view(12, 2, 32)
    slots = torch.arange(12) * 2
    for fmt in FORMATS:
        kv_format = KVFormat(fmt)
        by_kernel = torch.zeros(2, 24, 2, kv_format.row_width(32), dtype=kv_format.storage_dtype)
        native_kernels.store_kv(by_kernel[0], by_kernel[1], slots, k, v)
        for stored, x in zip(by_kernel, (k, v)):
            expected = to_storage(x, kv_format.storage_dtype)
            assert torch.equal(stored[slots].view(torch.uint8), expected.view(torch.uint8))


def test_int8_rows_round_trip_within_half_a_step_of_the_float64_values() -> None:
    x = _values(200, 4, 64, 5)[3:]  # without fp16's edge row, whose scale is set by 7e4
    rows = quantize_int8_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (197, 4, 68)
    step = x.double().abs().amax(dim=-1, keepdim=True) / 127  # the float64 scale of each row
    error = (dequantize_int8_rows(rows, torch.float64) - x.double()).abs()
    assert (error <= step * (0.5 + 1e-5)).all()  # half a step, and the fp32 scale's own rounding
    q = rows[..., :64].view(torch.int8)
    assert q.abs().amax(dim=-1).eq(127).all()  # each row uses the whole range


def test_an_all_zero_row_stores_a_zero_scale_and_reads_back_zero() -> None:
    rows = quantize_int8_rows(torch.zeros(1, 2, 16))
    assert torch.equal(rows, torch.zeros(1, 2, 20, dtype=torch.uint8))
    assert torch.equal(dequantize_int8_rows(rows, torch.float32), torch.zeros(1, 2, 16))


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_half_formats_round_to_within_half_an_ulp(fmt: str) -> None:
    x = _values(100, 2, 64, 6)[3:]
    stored = to_storage(x, KVFormat(fmt).storage_dtype).double()
    assert ((stored - x.double()).abs() <= x.double().abs() * HALF_ULP[fmt] + 2.0**-25).all()


def _dequantize64(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The values a cache of any format holds, in float64: int8 q times its scale, exactly."""
    if rows.dtype != torch.uint8:
        return rows.double()
    scales = rows[..., head_dim:].contiguous().view(torch.float32).double()
    return rows[..., :head_dim].view(torch.int8).double() * scales


def _attention64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal attention in float64: q [T, Hq, D] at `positions`, keys/values [context, Hkv, D]."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,chd->htc", q.double(), keys) * q.shape[-1] ** -0.5
    future = torch.arange(keys.shape[0])[None, :] > positions[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("htc,chd->thd", probs, values).float()


def _paged_cache(fmt: str, num_slots: int, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(2, num_slots, num_kv_heads, head_dim, generator=generator)
    return to_storage(values, KVFormat(fmt).storage_dtype)


@pytest.mark.parametrize("fmt", [*FORMATS, "fp32"])
@pytest.mark.parametrize("num_seqs", [1, 9])
def test_decode_kernels_read_every_format_as_float64_would(
    native_kernels: NativeKernels, portable: NativeKernels, fmt: str, num_seqs: int
) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    generator = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 300, (num_seqs,), generator=generator)
    max_blocks = int(-(-lens.max() // block_size))
    cache = _paged_cache(fmt, (num_seqs * max_blocks + 3) * block_size, num_kv_heads, head_dim, num_seqs)
    tables = torch.randperm(num_seqs * max_blocks + 3, generator=generator)[: num_seqs * max_blocks]
    tables = tables.view(num_seqs, max_blocks).contiguous()
    q = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    expected = []
    for row, (table, context_len) in enumerate(zip(tables.tolist(), lens.tolist())):
        positions = torch.arange(context_len)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        keys, values = _dequantize64(cache[0, slots], head_dim), _dequantize64(cache[1, slots], head_dim)
        expected.append(_attention64(q[row : row + 1], keys, values, torch.tensor([context_len - 1]))[0])
    for kernels in (native_kernels, portable):
        out = kernels.paged_decode(
            q, cache[0], cache[1], tables, lens, max_blocks * block_size, block_size, head_dim**-0.5
        )
        torch.testing.assert_close(out, torch.stack(expected), rtol=1e-5, atol=2e-6)


def _prefill_through(backend: AttentionBackend, fmt: str, query_len: int, cached: int) -> tuple[torch.Tensor, ...]:
    """One chunk of query_len tokens after `cached` ones, through the public entry point with keys read from the
    cache: the output and the float64 reference over what the cache then holds."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    context_len = query_len + cached
    num_blocks = 2 * -(-context_len // block_size) + 1
    generator = torch.Generator().manual_seed(query_len * 131 + cached)
    table = torch.randperm(num_blocks, generator=generator)[: -(-context_len // block_size)].tolist()
    positions = torch.arange(context_len)
    slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    cache = _paged_cache(fmt, num_blocks * block_size, num_kv_heads, head_dim, cached)
    q = torch.randn(query_len, num_heads, head_dim, generator=generator)
    k, v = torch.randn(2, query_len, num_kv_heads, head_dim, generator=generator)
    meta = build_attention_metadata(
        backend, [table], [context_len], [query_len], block_size, torch.float32, CPU, keys_from_cache=True
    )
    out = paged_attention(q, k, v, cache, meta, head_dim**-0.5)
    keys, values = _dequantize64(cache[0, slots], head_dim), _dequantize64(cache[1, slots], head_dim)
    return out, _attention64(q, keys, values, positions[cached:])


@pytest.mark.parametrize("fmt", [*FORMATS, "fp32"])
@pytest.mark.parametrize(("query_len", "cached"), [(5, 0), (70, 0), (30, 37), (1, 200)])
def test_prefill_reads_every_format_as_float64_would(
    native_kernels: NativeKernels, portable: NativeKernels, fmt: str, query_len: int, cached: int
) -> None:
    for backend in (CPUNativeBackend(native_kernels), CPUNativeBackend(portable), TorchSDPABackend()):
        out, expected = _prefill_through(backend, fmt, query_len, cached)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


def test_the_kernels_refuse_a_cache_whose_rows_do_not_fit_the_format(native_kernels: NativeKernels) -> None:
    q = torch.randn(1, 4, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    no_scale = torch.zeros(2, 16, 2, 64, dtype=torch.uint8)  # int8 values without room for their scales
    with pytest.raises(ValueError, match="rows of 68 for head_dim 64"):
        native_kernels.paged_decode(q, no_scale[0], no_scale[1], tables, lens, 16, 16, 0.125)
    doubles = torch.zeros(2, 16, 2, 64, dtype=torch.float64)
    with pytest.raises(TypeError, match="not one the kernels read"):
        native_kernels.store_kv(doubles[0], doubles[1], torch.zeros(1, dtype=torch.long), q[:, :2], q[:, 2:])


# Mean |prompt logprob - fp32's| on the tiny Llama (head_dim 16) was measured at 0.0005, 0.0045 and 0.011 (max
# 0.002, 0.024, 0.074): the bounds are about three times that. A wrong scale or a misread row moves it by whole
# nats.
MEAN_LOGPROB_DRIFT = {"fp16": 0.002, "bf16": 0.015, "int8": 0.035}
SCORED = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(9)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (7, 33, 90)]


def _serve(llama_dir: Path, **options: object) -> list[tuple[list[int], list[float]]]:
    with LLM(str(llama_dir), block_size=16, max_num_batched_tokens=32, **options) as llm:
        outputs = llm.generate(_prompts(), SCORED)
    return [(out.token_ids, [p.logprob for p in out.prompt_logprobs[1:]]) for out in outputs]  # type: ignore[index,union-attr]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_serves_close_to_fp32_on_both_backends(llama_dir: Path, fmt: str) -> None:
    reference = _serve(llama_dir)
    by_backend = {
        backend: _serve(llama_dir, kv_cache_dtype=fmt, attention_backend=backend) for backend in ("native", "torch")
    }
    for (_, logprobs), (native_tokens, native_logprobs), (torch_tokens, torch_logprobs) in zip(
        reference, by_backend["native"], by_backend["torch"]
    ):
        assert native_tokens == torch_tokens
        # The backends store the same bytes for the same values, but their fp32 arithmetic differs in the last
        # bits, which can tip a value across a rounding boundary of the format: a step of 2^-8 in bf16.
        torch.testing.assert_close(native_logprobs, torch_logprobs, rtol=0, atol=1e-3)
        # The format is in effect, and costs little. (Greedy tokens are not compared with fp32's: this random
        # model's top logits are close enough that int8 rounding picks another one now and then.)
        drift = [abs(a - b) for a, b in zip(native_logprobs, logprobs)]
        assert 0 < sum(drift) / len(drift) < MEAN_LOGPROB_DRIFT[fmt]


def test_a_smaller_format_holds_more_blocks_and_is_keyed_apart(llama_dir: Path) -> None:
    engines = {
        fmt: LLM(str(llama_dir), kv_cache_dtype=fmt, kv_cache_memory_gb=0.01, max_num_seqs=1024).engine
        for fmt in ("auto", "fp16", "int8")
    }
    head_dim = engines["auto"].model_config.head_dim
    fp32_blocks = engines["auto"].num_kv_blocks
    assert engines["fp16"].num_kv_blocks / fp32_blocks == pytest.approx(2, rel=1e-3)
    assert engines["int8"].num_kv_blocks / fp32_blocks == pytest.approx(4 * head_dim / (head_dim + 4), rel=1e-3)
    assert [engine.namespace.dtype for engine in engines.values()] == ["float32", "float32+kv-fp16", "float32+kv-int8"]
    assert len({engine.namespace.root_key() for engine in engines.values()}) == 3
    assert engines["int8"].device_blocks.format.dtype == "int8-rowscale"
    assert engines["int8"].device_blocks.format.shape[-1] == head_dim + 4
    for engine in engines.values():
        engine.close()


def _stored_blocks(llm: LLM, prompt: list[int]) -> list[bytes]:
    """The bytes of the device blocks cached for the prompt's full blocks."""
    engine = llm.engine
    keys = chain_block_keys(engine.root_key(None), prompt, engine.engine_config.block_size)
    block_ids = [engine.block_pool.lookup(key) for key in keys]
    assert None not in block_ids
    return [bytes(block) for block in engine.device_blocks.read(block_ids)]  # type: ignore[arg-type]


def test_int8_blocks_round_trip_through_the_disk_tier(llama_dir: Path, tmp_path: Path) -> None:
    tier = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path / "blocks"), load_deadline_s=60)
    prompt = _prompts()[2]
    with LLM(str(llama_dir), kv_cache_dtype="int8", kv_tier=tier) as writer:
        first = writer.generate([prompt], GREEDY)[0]
        written = _stored_blocks(writer, prompt)
    with LLM(str(llama_dir), kv_cache_dtype="int8", kv_tier=tier) as reader:
        second = reader.generate([prompt], GREEDY)[0]
        loaded = _stored_blocks(reader, prompt)
    assert second.num_cached_tokens == len(prompt) // 16 * 16  # every full block came from disk
    assert second.token_ids == first.token_ids
    assert loaded == written
    with LLM(str(llama_dir), kv_cache_dtype="fp16", kv_tier=tier) as other_format:
        assert other_format.generate([prompt], GREEDY)[0].num_cached_tokens == 0  # another namespace
