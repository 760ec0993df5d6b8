"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvyard.kernels.ops import ElementwiseKernels, SmallLinearKernel
from kvyard.models.config import RopeConfig
from kvyard.models.rope_tables import rope_attention_factor, rotary_tables


class Linear(nn.Linear):
    """nn.Linear with faster fp32 CPU paths, off until `use_cpu_fast_paths` turns them on.

    A handful of rows (decode) goes to a native kernel that streams the weights once at memory
    speed. More rows go to oneDNN with the weight packed once into its blocked layout: on CPUs
    where MKL does not take its best code path (AMD) that is 1.3-1.5x faster than MKL, and packing
    saves oneDNN from reordering the weight on every call (15-25% at 32-2048 rows).
    """

    # Measured on the bench preset's shapes (AMD EPYC, AVX2), all linears of the model in a row:
    # the native kernel wins up to 16 rows, packed oneDNN from 24.
    max_small_rows = 16

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.onednn = False
        self.bf16_onednn = False  # bf16 matmuls through oneDNN (where it runs bf16), else PyTorch's
        self.small_kernel: SmallLinearKernel | None = None
        self.packed_weight: torch.Tensor | None = None  # oneDNN's layout of `weight`; a second copy
        self.bf16_weight: torch.Tensor | None = None  # `weight` in bf16 (oneDNN's layout with it) for bf16 matmuls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.small_kernel is not None and rows <= self.max_small_rows:
            return self.small_kernel(x, self.weight, self.bias)
        if self.bf16_weight is not None and rows > self.max_small_rows:
            return bf16_linear(x, self.bf16_weight, self.bias, self.bf16_onednn)
        if self.onednn:
            weight = self.packed_weight if self.packed_weight is not None else self.weight
            return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def bf16_weight_for(self, rows: int) -> torch.Tensor | None:
        """The bf16 weight `rows` fp32 rows are multiplied with, for a caller that keeps them in bf16 (None: they
        are not multiplied in bf16, or a bias is added)."""
        if self.bf16_weight is None or rows <= self.max_small_rows or self.bias is not None:
            return None
        return self.bf16_weight

    def use_cpu_fast_paths(
        self, small_kernel: SmallLinearKernel | None, onednn: bool, pack: bool, bf16_matmul: bool = False
    ) -> None:
        """fp32 CPU weights only: few rows through `small_kernel` (None: not), the rest through oneDNN
        if `onednn`, with the weight packed into oneDNN's layout if `pack` (a copy, made now). `bf16_matmul`: the
        rest as bf16 matmuls instead (`bf16_linear`) on a bf16 copy of the weight, packed if `onednn`, made now
        in place of the fp32 packed copy (half its size)."""
        self.small_kernel = small_kernel
        self.onednn = onednn
        self.bf16_onednn = onednn and onednn_runs_bf16()
        self.packed_weight = onednn_layout(self.weight.detach()) if pack and not bf16_matmul else None
        weight16 = self.weight.detach().to(torch.bfloat16) if bf16_matmul else None
        self.bf16_weight = onednn_layout(weight16) if weight16 is not None and self.bf16_onednn else weight16


def onednn_runs_bf16() -> bool:
    """Whether oneDNN multiplies bf16 matrices on this CPU. It needs AVX512-BW/VL/DQ, AVX-NE-CONVERT or AMX and
    refuses otherwise; an AVX2-only CPU takes PyTorch's own bf16 matmul instead (slower than fp32 there)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_layout(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a linear layer's weight in oneDNN's blocked layout, which its matmul reads without reordering."""
    # The hint is the batch size oneDNN tunes the layout for; 64 served 1-2048 rows best.
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """x W^T + b for fp32 x and a bf16 weight, computed as a bf16 model does: x rounded to bf16, fp32 accumulation,
    the product rounded to bf16; returned in fp32, the fp32 bias added. `onednn` only where `onednn_runs_bf16()`."""
    out = bf16_product(x.to(torch.bfloat16), weight, onednn).float()
    return out if bias is None else out.add_(bias)


def bf16_product(x16: torch.Tensor, weight: torch.Tensor, onednn: bool) -> torch.Tensor:
    """x W^T in bf16 (fp32 accumulation) for bf16 x and weight, oneDNN's where `onednn` (its layout or plain)."""
    if onednn:
        return torch.ops.mkldnn._linear_pointwise(x16, weight, None, "none", [], "")
    return F.linear(x16, weight)


class NativeElementwise:
    """A layer whose elementwise work the native kernels can fuse; plain PyTorch while `native` is None."""

    native: ElementwiseKernels | None

    def use_native_kernels(self, kernels: ElementwiseKernels | None) -> None:
        """fp32 CPU tensors only, once given kernels; None goes back to PyTorch."""
        self.native = kernels


def fits_in_memory(linears: list[Linear]) -> bool:
    """Whether packed copies of these linears' weights would fit in half of the memory available now."""
    return fits_in_half_of_memory(sum(m.weight.numel() * m.weight.element_size() for m in linears))


def fits_in_half_of_memory(extra_bytes: int) -> bool:
    """Whether copies of `extra_bytes` would fit in half of the memory available now."""
    return extra_bytes < available_memory_bytes() // 2


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo; where that is missing, physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class RMSNorm(nn.Module, NativeElementwise):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.native = None
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32:
            # One kernel call instead of six ops: Qwen3 normalises every head's query and key this way.
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self.native.add_rms_norm(None, rows, self.weight, self.eps).view(x.shape)
        # Normalise in fp32 and cast back before scaling, as the reference implementation does,
        # so bf16 models round at the same points.
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)

    def add_and_norm(self, x: torch.Tensor | None, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); x None means just norm(residual).

        The native path adds in place into `residual`, which callers own (the residual stream)."""
        if self.native is not None:
            return self.native.add_rms_norm(x, residual, self.weight, self.eps), residual
        if x is not None:
            residual = x + residual
        return self(residual), residual


class GatedMLP(nn.Module, NativeElementwise):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.native = None
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both_bf16 = self._bf16_weights(x)
        if both_bf16 is not None:
            # Kept in bf16 from one matmul to the next, as a bf16 model computes: no fp32 copies between them.
            (gate_up_weight, gate_up_onednn), (down_weight, down_onednn) = both_bf16
            gate, up = bf16_product(x.to(torch.bfloat16), gate_up_weight, gate_up_onednn).split(
                self.intermediate_size, dim=-1
            )
            return bf16_product(F.silu(gate).mul_(up), down_weight, down_onednn).float()
        gate_up = self.gate_up_proj(x)
        if self.native is not None:
            return self.down_proj(self.native.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _bf16_weights(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, bool], tuple[torch.Tensor, bool]] | None:
        """Both projections' bf16 weights and oneDNN flags, where both multiply x's rows in bf16. (The projections
        are Linear, or the Int8Linear and HalfLinear that replace it: each says which weight it would use.)"""
        if x.dtype != torch.float32 or x.dim() != 2:
            return None
        gate_up = self.gate_up_proj.bf16_weight_for(x.shape[0])
        down = self.down_proj.bf16_weight_for(x.shape[0]) if gate_up is not None else None
        if gate_up is None or down is None:
            return None
        return (gate_up, self.gate_up_proj.bf16_onednn), (down, self.down_proj.bf16_onednn)


class RotaryEmbedding(nn.Module, NativeElementwise):
    """Rotate-half rotary embedding with a precomputed cos/sin table indexed by position."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.native = None
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.cos_table = torch.empty(0)
        self.sin_table = torch.empty(0)
        self.attention_factor = rope_attention_factor(rope)  # in both tables: `shift` takes it out

    def build(self, device: torch.device) -> None:
        cos, sin = rotary_tables(self.rope, self.head_dim, self.max_positions)
        self.cos_table = torch.from_numpy(cos).to(device)
        self.sin_table = torch.from_numpy(sin).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]; positions: [T]. The native path rotates q and k in place."""
        if self.native is not None:
            self.native.rotary(q, self.cos_table, self.sin_table, positions)
            self.native.rotary(k, self.cos_table, self.sin_table, positions)
            return q, k
        cos = self.cos_table[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_table[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def shift(self, k: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Keys [T, Hkv, D] rotated for some positions, rotated `offsets` [T] positions further (negative: back).

        Rotations compose (the angle is linear in the position, with every rope type here), so this gives the
        keys at their new positions up to float rounding."""
        distance = offsets.abs()
        sign = torch.where(offsets < 0, -1.0, 1.0).to(k.dtype)[:, None, None] / self.attention_factor
        cos = self.cos_table[distance].unsqueeze(1).to(k.dtype) / self.attention_factor
        sin = self.sin_table[distance].unsqueeze(1).to(k.dtype) * sign
        return _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding, `x * cos + rotate_half(x) * sin`, without building rotate_half."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
