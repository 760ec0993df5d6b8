"""Measure, on a CUDA GPU, the efficiency factors that `kvyard/sim/roofline.py` assumes for a model shape.

The simulator's GPU cost presets are roofline estimates: peak FLOP/s and memory bandwidth from a datasheet, times
efficiencies (compute 0.5, attention 0.4, bandwidth 0.75) that were guesses. This script times the pieces a step is
made of, with PyTorch on the GPU at hand, for Llama-3-8B's shape in bf16 (random weights), and writes what fraction
of the peaks each reached:

- the linear layers of one decoder layer over T prompt tokens (compute-bound): compute efficiency;
- the same over B decode rows (memory-bound: the layer's 436 MB of weights read once): bandwidth efficiency;
- causal attention of a T-token prompt (`scaled_dot_product_attention`, flash where PyTorch has it);
- decode attention of B sequences over C tokens of KV each (bandwidth).

One layer's weights are 436 MB, far above any GPU's L2, so timing one layer repeatedly streams them as a whole
model would. Timings are CUDA-event medians of 20 runs after 3 warm-ups.

Then whole steps of the 32-layer model (RMSNorm, the linears, attention, SiLU gate; no rotary embedding), to set
beside what the `h200-llama3-8b` preset predicts for them: decode steps of B sequences with C tokens of KV each,
replayed from a CUDA graph as a serving engine runs them, and prefills of T tokens.

    python3 benchmarks/gpu_roofline_calibration.py --out benchmarks/results/gpu_roofline_calibration.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
LINEAR_SHAPES = (
    (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    (HEADS * HEAD_DIM, HIDDEN),
    (HIDDEN, 2 * INTERMEDIATE),
    (INTERMEDIATE, HIDDEN),
)  # (in, out): qkv, o, gate_up, down
LAYER_PARAMETERS = sum(n_in * n_out for n_in, n_out in LINEAR_SHAPES)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak the preset assumes (H100/H200 SXM datasheet)"
    )
    parser.add_argument(
        "--bandwidth-tb-s",
        type=float,
        default=None,
        help="memory bandwidth the efficiencies are against (none: 4.8 for an H200, 3.35 for any other GPU)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths of the prefill timings"
    )
    parser.add_argument(
        "--decode-rows",
        type=int,
        nargs="+",
        default=[1, 8, 32, 128],
        help="sequences per decode step of the decode timings",
    )
    parser.add_argument("--decode-context", type=int, default=4096, help="KV tokens per sequence in decode attention")
    parser.add_argument(
        "--skip-full-model",
        action="store_true",
        help="time the pieces only, not whole steps of "
        "the 32-layer model (which needs about 17 GB of weights and up to 17 GB of KV)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results" / "gpu_roofline_calibration.json",
        help="JSON result file",
    )
    return parser.parse_args()


def median_seconds(fn: Callable[[], Any], warmup: int = 3, runs: int = 20) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def linear_layers(weights: list[Any], rows: int) -> float:
    import torch

    inputs = [torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16) for n_in, _ in LINEAR_SHAPES]
    return median_seconds(lambda: [x @ w for x, w in zip(inputs, weights, strict=True)])


def prefill_attention(tokens: int) -> float:
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def decode_attention(rows: int, context: int) -> float:
    import torch
    import torch.nn.functional as F

    q = torch.randn(rows, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


class DecoderStack:
    """Llama-3-8B's 32 layers with random bf16 weights: enough to time whole steps, not to produce text."""

    def __init__(self, layers: int = 32, vocab: int = 128256) -> None:
        import torch

        def weights() -> list[Any]:
            return [
                torch.randn(n_in, n_out, device="cuda", dtype=torch.bfloat16) * 0.02 for n_in, n_out in LINEAR_SHAPES
            ]

        self.layers = [weights() for _ in range(layers)]
        self.head = torch.randn(HIDDEN, vocab, device="cuda", dtype=torch.bfloat16) * 0.02

    def forward(self, x: Any, caches: list[tuple[Any, Any]] | None, causal: bool) -> Any:
        """x [B, T, hidden]. With caches (one (K, V) of [B, kv_heads, C, head_dim] a layer) the T queries attend
        to them, else to their own keys (a prompt)."""
        import torch.nn.functional as F

        batch, tokens, _ = x.shape
        for index, (qkv_w, o_w, gate_up_w, down_w) in enumerate(self.layers):
            qkv = F.rms_norm(x, (HIDDEN,)) @ qkv_w
            q, k, v = qkv.split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=-1)
            q = q.view(batch, tokens, HEADS, HEAD_DIM).transpose(1, 2)
            if caches is None:
                k = k.view(batch, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
                v = v.view(batch, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
            else:
                k, v = caches[index]
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            x = x + attention.transpose(1, 2).reshape(batch, tokens, HEADS * HEAD_DIM) @ o_w
            gate, up = (F.rms_norm(x, (HIDDEN,)) @ gate_up_w).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ down_w
        return F.rms_norm(x[:, -1], (HIDDEN,)) @ self.head


def decode_step_seconds(stack: DecoderStack, rows: int, context: int) -> float:
    import torch

    caches = [
        tuple(torch.randn(rows, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in stack.layers
    ]
    x = torch.randn(rows, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            stack.forward(x, caches, causal=False)  # type: ignore[arg-type]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stack.forward(x, caches, causal=False)  # type: ignore[arg-type]
    seconds = median_seconds(graph.replay)
    del graph, caches
    torch.cuda.empty_cache()
    return seconds


def prefill_seconds(stack: DecoderStack, tokens: int) -> float:
    import torch

    x = torch.randn(1, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return median_seconds(lambda: stack.forward(x, None, causal=True), warmup=2, runs=5)


def full_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Whole-model steps measured, beside the preset's prediction of each."""
    from kvyard.sim.roofline import roofline_preset

    cost = roofline_preset("h200-llama3-8b").cost
    stack = DecoderStack()
    decode = []
    for rows in args.decode_rows:
        measured = decode_step_seconds(stack, rows, args.decode_context)
        predicted = cost.decode_step_seconds(rows, rows * args.decode_context)
        decode.append(
            {
                "rows": rows,
                "context": args.decode_context,
                "seconds": measured,
                "preset_seconds": predicted,
                "preset_over_measured": predicted / measured,
            }
        )
    prefill = []
    for tokens in args.prompt_tokens:
        measured = prefill_seconds(stack, tokens)
        predicted = cost.prefill_seconds(tokens)
        prefill.append(
            {
                "tokens": tokens,
                "seconds": measured,
                "preset_seconds": predicted,
                "preset_over_measured": predicted / measured,
            }
        )
    return {"decode_steps_cuda_graph": decode, "prefills": prefill}


def main() -> None:
    args = parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_roofline_calibration.py: needs a CUDA GPU (PyTorch sees none)")
    name = torch.cuda.get_device_name()
    bandwidth_tb_s = args.bandwidth_tb_s or (4.8 if "H200" in name else 3.35)
    peak, bandwidth = args.peak_tflops * 1e12, bandwidth_tb_s * 1e12
    weights = [torch.randn(n_in, n_out, device="cuda", dtype=torch.bfloat16) for n_in, n_out in LINEAR_SHAPES]
    layer_bytes = 2 * LAYER_PARAMETERS
    results: dict[str, Any] = {
        "prefill_linears": [],
        "decode_linears": [],
        "prefill_attention": [],
        "decode_attention": [],
    }
    for tokens in args.prompt_tokens:
        seconds = linear_layers(weights, tokens)
        flops = 2 * LAYER_PARAMETERS * tokens
        results["prefill_linears"].append(
            {
                "tokens": tokens,
                "seconds": seconds,
                "tflops": flops / seconds / 1e12,
                "compute_efficiency": flops / seconds / peak,
            }
        )
        seconds = prefill_attention(tokens)
        flops = 4 * HEADS * HEAD_DIM * tokens * tokens / 2  # causal: half the (query, key) pairs
        results["prefill_attention"].append(
            {
                "tokens": tokens,
                "seconds": seconds,
                "tflops": flops / seconds / 1e12,
                "attention_efficiency": flops / seconds / peak,
            }
        )
    for rows in args.decode_rows:
        seconds = linear_layers(weights, rows)
        results["decode_linears"].append(
            {
                "rows": rows,
                "seconds": seconds,
                "tb_s": layer_bytes / seconds / 1e12,
                "bandwidth_efficiency": layer_bytes / seconds / bandwidth,
            }
        )
        seconds = decode_attention(rows, args.decode_context)
        kv_bytes = rows * 2 * KV_HEADS * args.decode_context * HEAD_DIM * 2
        results["decode_attention"].append(
            {
                "rows": rows,
                "context": args.decode_context,
                "seconds": seconds,
                "tb_s": kv_bytes / seconds / 1e12,
                "bandwidth_efficiency": kv_bytes / seconds / bandwidth,
            }
        )
    if not args.skip_full_model:
        results.update(full_steps(args))
    conditions = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model_shape": "Llama-3-8B, bf16, one decoder layer's linears (436 MB) and attention (GQA 32/8)",
        "peak_tflops_assumed": args.peak_tflops,
        "bandwidth_tb_s_assumed": bandwidth_tb_s,
        "timing": "CUDA events, median of 20 after 3 warm-ups",
        "preset_assumptions": {"compute_efficiency": 0.5, "attention_efficiency": 0.4, "bandwidth_efficiency": 0.75},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=1) + "\n")
    for kind, rows in results.items():
        for row in rows:
            print(kind, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
