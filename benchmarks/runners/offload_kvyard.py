"""One single-stream decode of kvyard's engine for benchmarks/offload.py, run in its memory cgroup: load a package
(with --weights-memory-gb when given), prefill a prompt, decode (sampled with seed 0: the same tokens under any
budget, since paged experts compute the same bits), print one JSON line with per-step times, the tokens, how often
each expert was picked, and the expert cache's counters.

    .venv/bin/python benchmarks/runners/offload_kvyard.py PACKAGE --prompt 1,2,3 --tokens 64 [--weights-memory-gb G]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("package")
    parser.add_argument("--prompt", required=True, help="token ids, comma-separated")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--weights-memory-gb", type=float, default=None)
    parser.add_argument("--max-seconds", type=float, default=600, help="stop decoding after this long")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="sampled (seed 0): a random model's greedy tokens soon loop"
    )
    args = parser.parse_args()

    from kvyard import LLM, SamplingParams
    from kvyard.models.experts import SparseMoE

    start = time.perf_counter()
    llm = LLM(
        args.package,
        dtype="float32",  # the checkpoint says bfloat16; int8 weights with fp32 activations, as llama.cpp's q8_0
        weights_memory_gb=args.weights_memory_gb,
        kv_cache_memory_gb=0.05,
        max_num_seqs=1,
    )
    load_s = time.perf_counter() - start
    engine = llm.engine
    picks: dict[int, torch.Tensor] = {}
    layers = [(i, layer.mlp) for i, layer in enumerate(engine.runner.model.model.layers)]
    for index, moe in layers:
        if isinstance(moe, SparseMoE):
            picks[index] = torch.zeros(moe.num_experts, dtype=torch.int64)
            moe.gate.register_forward_hook(_counter(picks[index], moe.top_k))
    prompt = [int(token) for token in args.prompt.split(",")]
    sampling = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    engine.add_request("0", prompt, sampling)
    step_s: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        if sum(step_s) > args.max_seconds:
            engine.abort_request("0")
            break
        begin = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - begin)
        for output in outputs:
            tokens = list(output.token_ids)
    snapshot = engine.expert_residency_snapshot()
    result: dict[str, Any] = {
        "load_s": load_s,
        "step_s": step_s,
        "tokens": tokens,
        "picks": {str(layer): counts.tolist() for layer, counts in picks.items()},
        "expert_cache": asdict(snapshot) if snapshot is not None else None,
    }
    llm.close()
    print(json.dumps(result), flush=True)


def _counter(counts: torch.Tensor, top_k: int) -> Any:
    """A forward hook on a router's gate: counts the experts its logits pick (softmax's order is the logits')."""

    def hook(module: Any, inputs: Any, logits: torch.Tensor) -> None:
        chosen = torch.topk(logits.float(), top_k, dim=-1).indices.flatten()
        counts.add_(torch.bincount(chosen, minlength=counts.numel()))

    return hook


if __name__ == "__main__":
    main()
