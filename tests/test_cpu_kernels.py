"""The native few-row matmul computes what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvyard.models.cpu_kernels import SmallLinearKernel, find_compiler, load_native_kernels


@pytest.fixture(scope="module")
def small_linear() -> SmallLinearKernel:
    kernels = load_native_kernels()
    if kernels is None:
        assert find_compiler() is None, "a C compiler is here but the kernels did not build"
        pytest.skip("no C compiler here")
    return kernels.small_linear


# Shapes cover whole 4-row tiles with k % 8 == 0 (vector path), ragged tiles, and odd k (scalar path),
# both below and above the size where the kernel goes multi-threaded.
@pytest.mark.parametrize("rows", [1, 2, 7, 15])
@pytest.mark.parametrize(("out_features", "in_features"), [(1024, 512), (514, 256), (7, 5), (3000, 100)])
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


def test_fused_add_rms_norm_matches_the_reference() -> None:
    kernels = load_native_kernels()
    if kernels is None:
        assert find_compiler() is None, "a C compiler is here but the kernels did not build"
        pytest.skip("no C compiler here")
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(300, 96, generator=generator)  # enough rows to take the multi-threaded path
    residual = torch.randn(300, 96, generator=generator)
    weight = torch.randn(96, generator=generator)
    total = x + residual
    expected = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = kernels.elementwise.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, total, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    norm_only = kernels.elementwise.add_rms_norm(None, total.clone(), weight, 1e-6)
    torch.testing.assert_close(norm_only, expected, rtol=1e-5, atol=1e-5)


def test_rotary_in_place_matches_the_reference() -> None:
    kernels = load_native_kernels()
    if kernels is None:
        assert find_compiler() is None, "a C compiler is here but the kernels did not build"
        pytest.skip("no C compiler here")
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
    kernels.elementwise.rotary(x, angles.cos(), angles.sin(), positions)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    torch.testing.assert_close(packed[:, : num_heads * head_dim], untouched, rtol=0, atol=0)
