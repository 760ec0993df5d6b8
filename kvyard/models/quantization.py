"""Weights converted for speed: int8 with a scale per group of 32, or 16-bit floats (fp16, bf16); activations fp32.

int8: each linear layer's weight as int8 with one fp32 scale per 32 consecutive weights of a row.

Symmetric, round to nearest: scale = max |w| over the group / 127. A scale per group of 32 (llama.cpp's q8_0
groups the same way) rather than per output row keeps one large weight from costing its whole row precision;
it adds 4 bytes per 32 weights, 1.125 bytes a weight against fp32's 4. Decode reads every weight once per step,
a quarter of fp32's bytes. The native kernel for few rows (decode, verification) rounds each group of 32
activations to int16 steps of the group's max / 32767 (`round_activations_int16`), so that a group's products
sum exactly in integer units; many rows (prefill) multiply fp32 activations by the dequantized weight.

fp16 / bf16: each linear layer's weight rounded to 16 bits (2 bytes a weight), widened back to fp32 in the
kernel's registers: fp16 keeps 11 significant bits within its range (|w| < 65504, far above trained weights),
bf16 keeps fp32's range with 8.

Matmuls of many rows in bf16 (`matmul_dtype` bfloat16, opt-in): on CPUs with AMX or AVX512-BF16, oneDNN multiplies
bf16 matrices 3-5x faster than fp32 ones. With it, an int8, bf16 or fp32 layer given more than a few rows (prefill,
large batches) rounds its input rows to bf16, multiplies them by its weight in bf16 (int8 widened to bf16 first,
fp32 from a bf16 copy kept for it), accumulates in fp32 and rounds the output to bf16, as a bf16 model computes;
few rows (decode of small batches) keep the exact fp32 kernels. The results then differ from the fp32 model's
given the same weights, so the KV they make is cached under other block keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvyard.kernels.ops import Int8ToBf16Kernel, SmallLinearHalfKernel, SmallLinearInt8Kernel
from kvyard.models import MATMUL_DTYPES, QUANTIZATION_SCHEMES
from kvyard.models.layers import bf16_linear, onednn_layout, onednn_runs_bf16
from kvyard.models.package_info import GROUP_SIZE

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# "none": an fp32 checkpoint's layers keep a bf16 copy of their weights for it. fp16 weights would lose 3
# significant bits to bf16.
BF16_MATMUL_SCHEMES = ("none", "int8", "bf16")
BF16_MATMUL_SUFFIX = "+mm-bf16"
# Fewest rows that go to the bf16 matmul; fewer keep the native fp32 kernels. Measured on the bench preset's
# linears (2-core Xeon with AMX): the bf16 kernel costs 1.5x oneDNN's bf16 matmul at 8 rows; int8 also pays for
# widening its weight to bf16 on every call, which 16 rows recoup (with a widened copy kept, int8 goes as bf16).
BF16_MATMUL_FROM_ROWS = {"int8": 16, "bf16": 8}  # fp32 layers: from Linear.max_small_rows + 1 (17)


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN has native bf16 matmul instructions here (AMX tiles or AVX512-BF16), not an emulation."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def matmul_in_bf16(matmul_dtype: str, scheme: str) -> bool:
    """Whether a model with weights in `scheme` multiplies many rows in bf16, as `matmul_dtype` asks."""
    if matmul_dtype not in MATMUL_DTYPES:
        raise ValueError(f"matmul_dtype must be one of {', '.join(MATMUL_DTYPES)}, got {matmul_dtype!r}")
    if scheme not in BF16_MATMUL_SCHEMES:
        return False
    return matmul_dtype == "bfloat16" or (matmul_dtype == "auto" and cpu_has_fast_bf16())


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], scales fp32 [n, k / 32]) for a weight [n, k] whose k is a multiple of 32."""
    rows, columns = weight.shape
    if columns % GROUP_SIZE:
        raise ValueError(f"int8 weights need in_features divisible by {GROUP_SIZE}, got {columns}")
    groups = weight.detach().float().reshape(rows, columns // GROUP_SIZE, GROUP_SIZE)
    scales = groups.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(rows, columns).contiguous(), scales.contiguous()


def round_activations_int16(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] as the int8 kernel multiplies it (kernels/csrc/small_linear_int8.c): each group of 32 rounded
    to nearest even on a step of the group's max |x| / 32767, back in fp32 (tests, quality benchmarks)."""
    groups = x.float().reshape(*x.shape[:-1], -1, GROUP_SIZE)
    max_abs = groups.abs().amax(dim=-1, keepdim=True)
    # tensor / tensor: `32767.0 / max_abs` multiplies by a reciprocal, which rounds differently from the kernel
    inverse = torch.where(max_abs > 0, torch.full_like(max_abs, 32767.0) / max_abs, torch.zeros_like(max_abs))
    return (torch.round(groups * inverse) * (max_abs / 32767.0)).reshape(x.shape)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, columns = q.shape
    groups = q.float().reshape(rows, columns // GROUP_SIZE, GROUP_SIZE) * scales[..., None]
    return groups.reshape(rows, columns)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights: few rows (decode) through the native int8 kernel, which reads the int8
    weights directly and rounds its input to int16 per group of 32 (`round_activations_int16`); more rows
    (prefill, large batches) dequantize the weight for one fp32 matmul, through oneDNN where PyTorch has it (as
    fp32 `Linear`: on AMD CPUs MKL's matmul was 2.1-2.2x slower at 512-2048 rows), or widen it for one bf16 matmul
    (`use_native_kernel`'s `to_bf16`)."""

    # Up to 64 rows the kernel beats dequantizing for one matmul, MKL's or oneDNN's, once the dequantization of
    # every weight (lm_head too) is counted: a step's worth is 4 bytes written per weight.
    max_small_rows = 64
    qweight: torch.Tensor  # int8 [out_features, in_features], a buffer
    scales: torch.Tensor  # fp32 [out_features, in_features / 32], a buffer

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.kernel: SmallLinearInt8Kernel | None = None
        self.onednn = False
        self.bf16_onednn = False  # bf16 matmuls through oneDNN (where it runs bf16), else PyTorch's
        self.to_bf16: Int8ToBf16Kernel | None = None
        self.bf16_weight: torch.Tensor | None = None  # the weight widened once, in oneDNN's layout if it has one

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        q, scales = quantize_int8(linear.weight)
        return cls(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.shape[0] <= self.max_small_rows and x.dtype == torch.float32:
            return self.kernel(x, self.qweight, self.scales, self.bias)
        if self.to_bf16 is not None and x.dtype == torch.float32:
            weight16 = self.bf16_weight if self.bf16_weight is not None else self.to_bf16(self.qweight, self.scales)
            return bf16_linear(x, weight16, self.bias, self.bf16_onednn)
        weight = dequantize_int8(self.qweight, self.scales).to(x.dtype)
        return widened_linear(x, weight, self.bias, self.onednn)

    def bf16_weight_for(self, rows: int) -> torch.Tensor | None:
        """As Linear.bf16_weight_for: the kept bf16 copy, or the weight widened now."""
        small = self.kernel is not None and rows <= self.max_small_rows
        if self.to_bf16 is None or small or self.bias is not None:
            return None
        return self.bf16_weight if self.bf16_weight is not None else self.to_bf16(self.qweight, self.scales)

    def use_native_kernel(
        self,
        kernel: SmallLinearInt8Kernel | None,
        onednn: bool = False,
        to_bf16: Int8ToBf16Kernel | None = None,
        keep_bf16_copy: bool = False,
    ) -> None:
        """fp32 CPU activations: few rows through `kernel` (None: not), the rest through oneDNN if `onednn`; given
        `to_bf16`, from BF16_MATMUL_FROM_ROWS rows on as one bf16 matmul over the weight it widens, on every call,
        or once, now, with `keep_bf16_copy` (2 more bytes a weight; then from as few rows as bf16 weights)."""
        self.kernel = kernel
        self.onednn = onednn
        self.bf16_onednn = onednn and to_bf16 is not None and onednn_runs_bf16()
        self.to_bf16 = to_bf16
        self.bf16_weight = None
        if to_bf16 is not None and keep_bf16_copy:
            weight16 = to_bf16(self.qweight, self.scales)
            self.bf16_weight = onednn_layout(weight16) if self.bf16_onednn else weight16
        if to_bf16 is None:
            self.max_small_rows = Int8Linear.max_small_rows
        else:
            self.max_small_rows = BF16_MATMUL_FROM_ROWS["bf16" if keep_bf16_copy else "int8"] - 1


class HalfLinear(nn.Module):
    """A linear layer with fp16 or bf16 weights: few rows through the native kernel, which widens them in
    registers; more rows (prefill, large batches) widen the whole weight for one fp32 matmul (oneDNN's, as
    Int8Linear)."""

    max_small_rows = 64
    weight16: torch.Tensor  # float16 or bfloat16 [out_features, in_features], a buffer

    def __init__(self, weight16: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight16", weight16)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None
        self.in_features, self.out_features = weight16.shape[1], weight16.shape[0]
        self.kernel: SmallLinearHalfKernel | None = None
        self.onednn = False
        self.bf16_onednn = False  # bf16 matmuls through oneDNN (where it runs bf16), else PyTorch's
        self.bf16_matmul = False
        self.packed_weight: torch.Tensor | None = None  # weight16 in oneDNN's layout, for many-row bf16 matmuls

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> HalfLinear:
        return cls(linear.weight.detach().to(dtype).contiguous(), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.shape[0] <= self.max_small_rows and x.dtype == torch.float32:
            return self.kernel(x, self.weight16, self.bias)
        if self.bf16_matmul and x.dtype == torch.float32:
            weight = self.weight16 if self.packed_weight is None else self.packed_weight
            return bf16_linear(x, weight, self.bias, self.bf16_onednn)
        return widened_linear(x, self.weight16.to(x.dtype), self.bias, self.onednn)

    def bf16_weight_for(self, rows: int) -> torch.Tensor | None:
        """As Linear.bf16_weight_for."""
        small = self.kernel is not None and rows <= self.max_small_rows
        if not self.bf16_matmul or small or self.bias is not None:
            return None
        return self.weight16 if self.packed_weight is None else self.packed_weight

    def use_native_kernel(
        self,
        kernel: SmallLinearHalfKernel | None,
        onednn: bool = False,
        bf16_matmul: bool = False,
        pack: bool = False,
    ) -> None:
        """fp32 CPU activations: few rows through `kernel` (None: not), the rest through oneDNN if `onednn`; with
        `bf16_matmul` (bf16 weights only), from BF16_MATMUL_FROM_ROWS rows on as one bf16 matmul, from a copy of
        the weight in oneDNN's layout with `pack` (2 more bytes a weight; without it oneDNN reorders the weight on
        every call, which about doubles a decode step's matmul time)."""
        if bf16_matmul and self.weight16.dtype != torch.bfloat16:
            raise ValueError(f"a bf16 matmul needs bf16 weights, not {self.weight16.dtype}")
        self.kernel = kernel
        self.onednn = onednn
        self.bf16_onednn = onednn and bf16_matmul and onednn_runs_bf16()
        self.bf16_matmul = bf16_matmul
        self.packed_weight = onednn_layout(self.weight16) if self.bf16_onednn and pack else None
        self.max_small_rows = BF16_MATMUL_FROM_ROWS["bf16"] - 1 if bf16_matmul else HalfLinear.max_small_rows


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """x W^T + b for a weight just widened to x's dtype; oneDNN only for fp32 (where `use_native_kernel` set it)."""
    if onednn and x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def quantize_model(model: nn.Module, scheme: str, *, empty: bool = False) -> int:
    """Replace every linear layer the scheme can convert (int8: input size a multiple of 32; fp16, bf16: all)
    with its converted form; returns how many were. `empty`: the converted layers get uninitialised tensors of
    their shapes and dtypes instead (a package's loader fills them), and no weight is read."""
    if scheme == "none":
        return 0
    if scheme not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, got {scheme!r}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and converts(child, scheme):
                setattr(parent, name, _converted(child, scheme, empty))
                replaced += 1
    return replaced


def converts(linear: nn.Linear, scheme: str) -> bool:
    """Whether `quantize_model` converts this layer to `scheme` (int8: input size a multiple of 32)."""
    return linear.in_features % GROUP_SIZE == 0 if scheme == "int8" else True


def _converted(linear: nn.Linear, scheme: str, empty: bool) -> nn.Module:
    rows, columns = linear.out_features, linear.in_features
    if scheme == "int8":
        if empty:
            q = torch.empty(rows, columns, dtype=torch.int8)
            return Int8Linear(q, torch.empty(rows, columns // GROUP_SIZE), linear.bias)
        return Int8Linear.from_linear(linear)
    dtype = HALF_DTYPES[scheme]
    if empty:
        return HalfLinear(torch.empty(rows, columns, dtype=dtype), linear.bias)
    return HalfLinear.from_linear(linear, dtype)


def round_trip_linears(model: nn.Module, scheme: str = "int8") -> None:
    """Give every linear layer `quantize_model` would convert the weight it would compute with (converted, then
    back to fp32), in place: a float model that a converted model should equal (tests, quality benchmarks)."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and converts(module, scheme):
            if scheme == "int8":
                module.weight.data = dequantize_int8(*quantize_int8(module.weight.data))
            else:
                module.weight.data = module.weight.data.to(HALF_DTYPES[scheme]).float()
