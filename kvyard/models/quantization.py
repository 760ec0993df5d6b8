"""int8 weights: each linear layer's weight as int8 with one fp32 scale per 32 consecutive weights of a row.

Symmetric, round to nearest: scale = max |w| over the group / 127. A scale per group of 32 (llama.cpp's q8_0
groups the same way) rather than per output row keeps one large weight from costing its whole row precision;
it adds 4 bytes per 32 weights, 1.125 bytes a weight against fp32's 4. Decode reads every weight once per step
and is bound by memory bandwidth, which is the point of the smaller format. Activations stay fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvyard.kernels.ops import SmallLinearInt8Kernel
from kvyard.models import QUANTIZATION_SCHEMES

GROUP_SIZE = 32


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


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, columns = q.shape
    groups = q.float().reshape(rows, columns // GROUP_SIZE, GROUP_SIZE) * scales[..., None]
    return groups.reshape(rows, columns)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights: few rows (decode) through the native int8 kernel, which reads the int8
    weights directly; more rows (prefill, large batches) dequantize the weight for one fp32 matmul."""

    max_small_rows = 64  # the kernel beats dequantizing for one matmul up to about 64 rows (bench shapes, AVX2)
    qweight: torch.Tensor  # int8 [out_features, in_features], a buffer
    scales: torch.Tensor  # fp32 [out_features, in_features / 32], a buffer

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.kernel: SmallLinearInt8Kernel | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        q, scales = quantize_int8(linear.weight)
        return cls(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.shape[0] <= self.max_small_rows and x.dtype == torch.float32:
            return self.kernel(x, self.qweight, self.scales, self.bias)
        weight = dequantize_int8(self.qweight, self.scales).to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def use_native_kernel(self, kernel: SmallLinearInt8Kernel | None) -> None:
        self.kernel = kernel


def quantize_model(model: nn.Module, scheme: str) -> int:
    """Replace every linear layer whose input size allows it with its int8 form; returns how many were."""
    if scheme == "none":
        return 0
    if scheme != "int8":
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, got {scheme!r}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % GROUP_SIZE == 0:
                setattr(parent, name, Int8Linear.from_linear(child))
                replaced += 1
    return replaced


def round_trip_linears(model: nn.Module) -> None:
    """Give every linear layer `quantize_model` would convert the weight it would compute with (quantized, then
    dequantized), in place: a float model that an int8 model should equal (tests, quality benchmarks)."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.in_features % GROUP_SIZE == 0:
            module.weight.data = dequantize_int8(*quantize_int8(module.weight.data))
