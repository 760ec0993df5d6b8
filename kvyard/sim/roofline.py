"""Cost models of accelerators this machine does not have, derived from a model's shape and a device's peak figures.

The default cost model is measured (kvyard's engine on this machine's CPU). On a CPU a decode token costs about
as much compute as a prefill token and long prompts dominate every workload; on a GPU prefill is bound by compute
and decode by memory bandwidth (every step reads all weights, every decode token reads its whole KV), which is what
prefill/decode disaggregation exploits. A roofline estimate gives the simulator that shape:

    step_base_s       = weight bytes / (bandwidth x bandwidth efficiency) + launch overhead
    prefill_token_s   = 2 x parameters / (peak FLOP/s x compute efficiency)     linear layers of one token
    attention_pair_s  = 4 x layers x query heads x head dim / (peak FLOP/s x attention efficiency)
    decode_seq_s      = prefill_token_s                                         the same linear layers
    decode_context_s  = KV bytes per token / (bandwidth x KV bandwidth efficiency, else bandwidth efficiency)

`h100-llama3-8b` is an estimate from public specifications with guessed efficiencies; `h200-llama3-8b` is fitted to
whole steps of a PyTorch Llama-3-8B stack timed on an H200 (below). Neither is a serving engine measured: results of
a simulator run on them say what the arithmetic implies, and their conditions must say so.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvyard.sim.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    parameters: float
    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_value: int  # weights and KV

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    peak_flops: float  # dense, in the model's dtype
    bandwidth_bytes_per_s: float
    compute_efficiency: float = 0.5  # linear layers of a large prefill batch
    attention_efficiency: float = 0.4
    bandwidth_efficiency: float = 0.75  # weights read by a decode step
    launch_overhead_s: float = 5e-4  # per forward pass, with graphs captured
    kv_bandwidth_efficiency: float | None = None  # KV read by decode attention; None: bandwidth_efficiency


@dataclass(frozen=True, slots=True)
class RooflinePreset:
    name: str
    model: ModelShape
    device: Device
    transfer_gb_per_s: float  # between replicas, for disaggregation
    transfer_note: str

    @property
    def cost(self) -> CostModel:
        return roofline_cost(self.model, self.device)


def roofline_cost(model: ModelShape, device: Device) -> CostModel:
    flops = device.peak_flops * device.compute_efficiency
    bandwidth = device.bandwidth_bytes_per_s * device.bandwidth_efficiency
    kv_efficiency = device.kv_bandwidth_efficiency or device.bandwidth_efficiency
    token_s = 2 * model.parameters / flops
    pair_flops = 4 * model.layers * model.query_heads * model.head_dim
    return CostModel(
        step_base_s=model.weight_bytes / bandwidth + device.launch_overhead_s,
        prefill_token_s=token_s,
        attention_pair_s=pair_flops / (device.peak_flops * device.attention_efficiency),
        decode_seq_s=token_s,
        decode_context_s=model.kv_bytes_per_token / (device.bandwidth_bytes_per_s * kv_efficiency),
    )


LLAMA3_8B_BF16 = ModelShape(
    "Llama-3-8B bf16", parameters=8.03e9, layers=32, query_heads=32, kv_heads=8, head_dim=128, bytes_per_value=2
)
H100_SXM = Device("H100 SXM", peak_flops=989e12, bandwidth_bytes_per_s=3.35e12)
H100_LLAMA3_8B = RooflinePreset(
    "h100-llama3-8b",
    LLAMA3_8B_BF16,
    H100_SXM,
    transfer_gb_per_s=25.0,
    transfer_note="one 200 Gb/s RDMA NIC per replica",
)
# Measured on an NVIDIA H200 with PyTorch 2.11 (benchmarks/gpu_roofline_calibration.py,
# results/gpu_roofline_calibration_2026-12-04_h200.json). Whole decode steps of the 32-layer model replayed from a
# CUDA graph (launches included, so no separate launch overhead) fit a weight read at 0.68 of 4.8 TB/s and KV reads
# at 0.87 (5.0 ms at 1 sequence, 21.4 ms at 128 with 4,096 tokens of KV each); one layer's linears over 2,048
# prompt tokens ran at 0.78 of the dense bf16 peak, causal attention of an 8,192-token prompt at 0.59. Only the
# link between replicas is still assumed.
H200_SXM_MEASURED = Device(
    "H200 SXM, efficiencies measured",
    peak_flops=989e12,
    bandwidth_bytes_per_s=4.8e12,
    compute_efficiency=0.78,
    attention_efficiency=0.59,
    bandwidth_efficiency=0.68,
    launch_overhead_s=0.0,
    kv_bandwidth_efficiency=0.87,
)
H200_LLAMA3_8B = RooflinePreset(
    "h200-llama3-8b",
    LLAMA3_8B_BF16,
    H200_SXM_MEASURED,
    transfer_gb_per_s=25.0,
    transfer_note="one 200 Gb/s RDMA NIC per replica (assumed, not measured)",
)
ROOFLINE_PRESETS = (H100_LLAMA3_8B, H200_LLAMA3_8B)


def roofline_preset(name: str) -> RooflinePreset:
    for preset in ROOFLINE_PRESETS:
        if preset.name == name:
            return preset
    known = ", ".join(p.name for p in ROOFLINE_PRESETS)
    raise ValueError(f"unknown cost preset {name!r} (known: {known})")
