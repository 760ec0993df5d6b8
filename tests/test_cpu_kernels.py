"""The native kernels compute what their PyTorch counterparts compute, and are bound only as their header says."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvyard.kernels.bindings import KernelBindingError, bind_functions
from kvyard.kernels.build import HEADER, compiled_library
from kvyard.kernels.header import HeaderSyntaxError, parse_prototypes
from kvyard.kernels.ops import NativeKernels, SmallLinearKernel, bind_kernels
from kvyard.models.attention import AttentionBackend, build_attention_metadata, paged_attention
from kvyard.models.attention_backends import CPUNativeBackend, TorchSDPABackend
from kvyard.models.layers import Linear


@pytest.fixture
def small_linear(vector_kernels: NativeKernels) -> SmallLinearKernel:
    return vector_kernels.small_linear


# Shapes cover whole 4-row tiles with k % 16 == 0 (AVX-512 or AVX2 path), k % 16 == 8 (AVX2), ragged tiles, and
# odd k (scalar path), both below and above the size where the kernel goes multi-threaded; rows: one, the AVX2
# path's block of 3 and the AVX-512 path's of 6, and remainders of them.
@pytest.mark.parametrize("rows", [1, 2, 7, 15])
@pytest.mark.parametrize(("out_features", "in_features"), [(1024, 512), (514, 256), (7, 5), (3000, 100), (64, 264)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_matches_torch(
    small_linear: SmallLinearKernel, rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
    torch.testing.assert_close(small_linear(x, weight, bias), expected, rtol=1e-5, atol=1e-4)


def test_small_linear_reads_a_non_contiguous_input(small_linear: SmallLinearKernel) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, generator=generator).t()  # [3, 64], strided
    weight = torch.randn(40, 64, generator=generator)
    torch.testing.assert_close(small_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_fused_add_rms_norm_matches_the_reference(native_kernels: NativeKernels) -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(300, 96, generator=generator)  # enough rows to take the multi-threaded path
    residual = torch.randn(300, 96, generator=generator)
    weight = torch.randn(96, generator=generator)
    total = x + residual
    expected = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = native_kernels.elementwise.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, total, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    norm_only = native_kernels.elementwise.add_rms_norm(None, total.clone(), weight, 1e-6)
    torch.testing.assert_close(norm_only, expected, rtol=1e-5, atol=1e-5)


def test_rotary_in_place_matches_the_reference(native_kernels: NativeKernels) -> None:
    generator = torch.Generator().manual_seed(3)
    num_tokens, num_heads, head_dim = 5, 3, 16
    packed = torch.randn(num_tokens, 2 * num_heads * head_dim, generator=generator)
    x = packed[:, num_heads * head_dim :].view(num_tokens, num_heads, head_dim)  # strided rows, like q/k in qkv
    positions = torch.tensor([0, 7, 3, 9, 1])
    angles = torch.randn(10, head_dim // 2, generator=generator)
    cos, sin = angles.cos()[positions][:, None], angles.sin()[positions][:, None]
    first, second = x.chunk(2, dim=-1)
    expected = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    untouched = packed[:, : num_heads * head_dim].clone()
    native_kernels.elementwise.rotary(x, angles.cos(), angles.sin(), positions)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    torch.testing.assert_close(packed[:, : num_heads * head_dim], untouched, rtol=0, atol=0)


@pytest.fixture(scope="module")
def native_backend(native_kernels: NativeKernels) -> CPUNativeBackend:
    return CPUNativeBackend(native_kernels)


@dataclass(frozen=True, slots=True)
class PrefillCase:
    """One sequence's step: the last query_len of context_len tokens, with the earlier ones cached."""

    cache: torch.Tensor  # [2, slots, Hkv, D], every context token already written
    block_table: list[int]
    q: torch.Tensor  # [query_len, Hq, D]
    new_k: torch.Tensor  # [query_len, Hkv, D]
    new_v: torch.Tensor
    context_len: int
    block_size: int


def _prefill_case(
    query_len: int, context_len: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> PrefillCase:
    generator = torch.Generator().manual_seed(query_len * 7919 + context_len * 31 + block_size + head_dim)
    used_blocks = -(-context_len // block_size)
    num_blocks = 2 * used_blocks + 3
    cache = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=generator)
    table = torch.randperm(num_blocks, generator=generator)[:used_blocks].tolist()  # scattered blocks
    positions = torch.arange(context_len)
    slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    q = torch.randn(query_len, num_heads, head_dim, generator=generator)
    new = slots[context_len - query_len :]
    return PrefillCase(cache, table, q, cache[0][new].clone(), cache[1][new].clone(), context_len, block_size)


def _paged_attention_of(case: PrefillCase, backend: AttentionBackend) -> torch.Tensor:
    """The step through the public attention entry point; TorchSDPABackend is the reference."""
    query_len = case.q.shape[0]
    meta = build_attention_metadata(
        backend,
        [case.block_table],
        [case.context_len],
        [query_len],
        case.block_size,
        torch.float32,
        torch.device("cpu"),
    )
    scale = case.q.shape[-1] ** -0.5
    return paged_attention(case.q, case.new_k, case.new_v, case.cache.clone(), meta, scale)


# query_len 1 and 5 fill one tile of query rows partly; 130 spans several, with a ragged last one.
# Extra context 0 is a whole-prompt chunk (keys from this step's rows), the others a cached prefix:
# 37 ends mid-block, 300 crosses several 64-key tiles.
@pytest.mark.parametrize("query_len", [1, 5, 130])
@pytest.mark.parametrize("cached", [0, 37, 300])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_prefill_matches_the_pytorch_path(
    native_backend: CPUNativeBackend, query_len: int, cached: int, block_size: int, group: int, head_dim: int
) -> None:
    num_kv_heads = 2
    case = _prefill_case(query_len, query_len + cached, block_size, num_kv_heads * group, num_kv_heads, head_dim)
    expected = _paged_attention_of(case, TorchSDPABackend())
    torch.testing.assert_close(_paged_attention_of(case, native_backend), expected, rtol=1e-5, atol=1e-5)


def test_paged_prefill_handles_a_head_dim_off_the_vector_width(native_backend: CPUNativeBackend) -> None:
    case = _prefill_case(query_len=9, context_len=50, block_size=16, num_heads=3, num_kv_heads=1, head_dim=13)
    expected = _paged_attention_of(case, TorchSDPABackend())
    torch.testing.assert_close(_paged_attention_of(case, native_backend), expected, rtol=1e-5, atol=1e-5)


def test_paged_prefill_reads_strided_rows_of_a_fused_projection(native_backend: CPUNativeBackend) -> None:
    """q, k, v as the model hands them over: views into one [T, (Hq + 2 Hkv) * D] qkv matrix."""
    generator = torch.Generator().manual_seed(5)
    num_tokens, num_heads, num_kv_heads, head_dim = 70, 4, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    out = native_backend.kernels.paged_prefill.causal(q, k, v, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_portable_prefill_path_matches_too(portable: NativeKernels) -> None:
    for query_len, context_len, head_dim in ((130, 400, 64), (9, 50, 13), (40, 40, 64)):
        case = _prefill_case(query_len, context_len, 16, num_heads=4, num_kv_heads=2, head_dim=head_dim)
        expected = _paged_attention_of(case, TorchSDPABackend())
        torch.testing.assert_close(
            _paged_attention_of(case, CPUNativeBackend(portable)), expected, rtol=1e-5, atol=1e-5
        )


def _decode_reference(
    q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Per sequence: gather its keys and values through the block table, attend in float64."""
    num_heads, num_kv_heads = q.shape[1], cache.shape[2]
    outs = []
    for row, (table, context_len) in enumerate(zip(tables.tolist(), lens.tolist())):
        positions = torch.arange(context_len)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        keys = cache[0, slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        values = cache[1, slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        query = q[row].double()[:, None, :]
        outs.append(F.scaled_dot_product_attention(query, keys, values)[:, 0, :].float())
    return torch.stack(outs)


def _decode_case(
    num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    generator = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 600, (num_seqs,), generator=generator)
    lens[0] = 7  # shorter than one vector of scores: all scalar tail
    max_blocks = int(-(-lens.max() // block_size))
    num_blocks = num_seqs * max_blocks + 5
    cache = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    return q, cache, tables.contiguous(), lens, max_blocks


@pytest.mark.parametrize("num_seqs", [1, 3, 40])  # one head per task, and whole sequences per task
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 4, 64), (4, 4, 128), (8, 2, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_matches_dense_attention(
    native_kernels: NativeKernels, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    q, cache, tables, lens, max_blocks = _decode_case(num_seqs, num_heads, num_kv_heads, head_dim, block_size, 11)
    out = native_kernels.paged_decode(
        q, cache[0], cache[1], tables, lens, max_blocks * block_size, block_size, head_dim**-0.5
    )
    torch.testing.assert_close(out, _decode_reference(q, cache, tables, lens, block_size), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 4, 64), (4, 4, 128), (6, 2, 40)])
def test_a_16_bit_cache_attends_exactly_as_an_fp32_cache_of_the_same_values(
    native_kernels: NativeKernels, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """16-bit rows are widened in registers where head_dim allows (multiples of 64), into a buffer elsewhere
    (40): either way, the same operations as on fp32 rows holding those values."""
    q, cache, tables, lens, max_blocks = _decode_case(9, num_heads, num_kv_heads, head_dim, 16, 13)
    half = cache.to(dtype)
    out = native_kernels.paged_decode(q, half[0], half[1], tables, lens, max_blocks * 16, 16, head_dim**-0.5)
    wide = half.float()
    expected = native_kernels.paged_decode(q, wide[0], wide[1], tables, lens, max_blocks * 16, 16, head_dim**-0.5)
    assert torch.equal(out, expected)


def test_portable_decode_path_matches_too(portable: NativeKernels) -> None:
    q, cache, tables, lens, max_blocks = _decode_case(6, 8, 4, 64, 16, 12)
    out = portable.paged_decode(q, cache[0], cache[1], tables, lens, max_blocks * 16, 16, 64**-0.5)
    torch.testing.assert_close(out, _decode_reference(q, cache, tables, lens, 16), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_fast_paths_match_torch(native_kernels: NativeKernels, with_bias: bool) -> None:
    """Every row count takes one of the fast paths (native kernel, packed oneDNN) and agrees with F.linear."""
    torch.manual_seed(5)
    layer = Linear(96, 200, bias=with_bias)
    onednn = torch.backends.mkldnn.is_available()
    layer.use_cpu_fast_paths(native_kernels.small_linear, onednn=onednn, pack=onednn)
    assert (layer.packed_weight is not None) == onednn
    for rows in (1, layer.max_small_rows, layer.max_small_rows + 1, 64, 300):
        x = torch.randn(rows, 96)
        expected = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
        torch.testing.assert_close(layer(x), expected.float(), rtol=1e-5, atol=1e-4)


def test_silu_mul_matches_the_reference(native_kernels: NativeKernels) -> None:
    generator = torch.Generator().manual_seed(4)
    for rows, dim in ((3, 13), (200, 1408)):  # scalar tail only; vector path over enough rows to go parallel
        gate_up = torch.randn(rows, 2 * dim, generator=generator) * 8  # reaches far into both tails of silu
        gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
        gate, up = gate_up.double().split(dim, dim=-1)
        expected = (F.silu(gate) * up).float()
        torch.testing.assert_close(native_kernels.elementwise.silu_mul(gate_up), expected, rtol=2e-6, atol=1e-6)


def test_argmax_rows_picks_the_first_maximum(native_kernels: NativeKernels) -> None:
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(70, 32000, generator=generator)
    logits[1, 5] = logits[1, 900] = 50.0  # a tie: the first index wins, as in torch
    logits[2] = float("-inf")
    logits[2, 31999] = 0.0  # the maximum in the last column
    logits[3] = float("-inf")  # nothing but -inf: index 0
    assert torch.equal(native_kernels.elementwise.argmax(logits), logits.argmax(dim=-1))
    assert native_kernels.elementwise.argmax(logits)[1] == 5


# ---------------------------------------------------------------- the header and the bindings


def _header_with(old: str, new: str) -> str:
    text = HEADER.read_text()
    assert old in text, f"{old!r} is not in the header any more: update this test"
    return text.replace(old, new)


@pytest.fixture(scope="module")
def library(native_kernels: NativeKernels) -> ctypes.CDLL:
    """The library load_native_kernels bound (a fresh handle, so argtypes set here stay here)."""
    return ctypes.CDLL(str(compiled_library()))


def test_argtypes_come_from_the_header(library: ctypes.CDLL) -> None:
    functions = bind_functions(library, HEADER.read_text(), HEADER.read_text())
    assert set(functions) == set(parse_prototypes(HEADER.read_text()))
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    assert functions["kvyard_rotary"].argtypes == [pointer, int64, int64, int64, int64, pointer, pointer, pointer]
    assert functions["kvyard_paged_prefill_attention"].restype is ctypes.c_int
    assert functions["kvyard_paged_prefill_attention"].argtypes[13] is ctypes.c_float  # scale
    assert functions["kvyard_silu_mul"].restype is None


# Each edit makes the header disagree with what the Python wrappers call, in one way.
HEADER_EDITS = {
    "narrower integer": ("float *out, int64_t rows, int64_t dim);", "float *out, int rows, int64_t dim);"),
    "swapped names": ("int64_t rows, int64_t cols, int64_t *out", "int64_t cols, int64_t rows, int64_t *out"),
    "dropped const": ("void kvyard_silu_mul(const float *gate_up", "void kvyard_silu_mul(float *gate_up"),
    "return type": ("int kvyard_paged_prefill_attention(", "void kvyard_paged_prefill_attention("),
    "extra parameter": ("int64_t k, int num_threads);", "int64_t k, int num_threads, int chunk);"),
    "undeclared": ("void kvyard_rotary(", "void kvyard_rotate("),
}
EDITED_FUNCTION = {
    "narrower integer": "kvyard_silu_mul",
    "swapped names": "kvyard_argmax_rows",
    "dropped const": "kvyard_silu_mul",
    "return type": "kvyard_paged_prefill_attention",
    "extra parameter": "kvyard_small_linear",
    "undeclared": "kvyard_rotary",
}


@pytest.mark.parametrize("edit", list(HEADER_EDITS))
def test_a_header_that_disagrees_with_the_bindings_is_refused(library: ctypes.CDLL, edit: str) -> None:
    header = _header_with(*HEADER_EDITS[edit])
    with pytest.raises(KernelBindingError, match=EDITED_FUNCTION[edit]):
        bind_kernels(library, 1, header_text=header)


def test_a_mismatch_names_the_parameter() -> None:
    header = _header_with(*HEADER_EDITS["narrower integer"])
    with pytest.raises(KernelBindingError) as error:
        bind_kernels(ctypes.CDLL(None), 1, header_text=header)  # refused before any symbol is looked up
    assert "kvyard_silu_mul: parameter 3 is `int rows` in the header, `int64_t rows` in the bindings" in str(
        error.value
    )


def test_a_function_missing_from_the_library_is_an_error_not_a_crash(library: ctypes.CDLL) -> None:
    prototype = "void kvyard_not_built(const float *x, int64_t rows);"
    with pytest.raises(KernelBindingError, match="kvyard_not_built: declared in the kernel header, but the library"):
        bind_functions(library, prototype, prototype)


@pytest.mark.parametrize(
    "declaration",
    [
        "void f(double x);",  # a type the bindings cannot map
        "void f(int x)",  # no semicolon
        "void f(int);",  # unnamed parameter
        "void f(int **x);",  # pointer to pointer
        "void f(const int x);",  # const value: only pointees may be const
        "void f(int x[4]);",  # array syntax
        "void f(void x);",
        "void f(int x); void f(int x);",  # declared twice
    ],
)
def test_the_header_reader_refuses_what_it_does_not_understand(declaration: str) -> None:
    with pytest.raises(HeaderSyntaxError):
        parse_prototypes(declaration)


def test_the_header_reader_reports_where() -> None:
    with pytest.raises(HeaderSyntaxError, match=r"line 3: 'void g\(size_t n\)': type 'size_t'"):
        parse_prototypes("/* two\n lines */ void f(void);\nvoid g(size_t n);\n")


def test_prototypes_print_as_they_parse() -> None:
    prototypes = parse_prototypes(HEADER.read_text())
    assert parse_prototypes("".join(f"{p};\n" for p in prototypes.values())) == prototypes


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm here")
def test_the_library_exports_exactly_what_the_header_declares(portable_library: Path) -> None:
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", str(portable_library)], check=True, capture_output=True, text=True
    ).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if line.split()[1:2] == ["T"]}
    assert exported == set(parse_prototypes(HEADER.read_text()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_portable_half_linear_widens_every_16_bit_value_exactly(portable: NativeKernels, dtype: torch.dtype) -> None:
    """The portable path converts each 16-bit weight itself: normals, subnormals, zeros of both signs and
    infinities must come out as torch converts them (x is one-hot, so each output is one weight, exactly)."""
    special = [0.0, -0.0, 1.0, -2.5, 65504.0, 6.1e-5, 5.96e-8, -3.0e-6, float("inf"), float("-inf"), 1e-30, 3e38]
    values = torch.tensor(special).to(dtype)
    weight = torch.zeros(64, 8, dtype=dtype)  # zeros beside column 3: no 0 * inf anywhere
    weight[:, 3] = torch.cat([values, torch.randn(64 - len(special)).to(dtype)])
    x = torch.zeros(1, 8)
    x[0, 3] = 1.0
    out = portable.small_linear_half(x, weight, None)
    assert torch.equal(out[0], weight[:, 3].float())
