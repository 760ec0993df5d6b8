"""Quality of the KV-cache formats: next-token distributions with the KV cache in each format against the fp32
model's, on the same fp32 weights, prompts and positions: kvyard's fp16, bf16 and int8 caches beside llama.cpp's
f16 and q8_0 caches.

For every position of 16 prompts of 512 random token ids: mean KL(fp32 || format) of the next-token distribution,
and how often the format's most likely token is fp32's. The reference is Hugging Face transformers on the
checkpoint. kvyard runs its own engine pieces (loader, paged model, native kernels) with the cache in each
format; each prompt is one prefill chunk whose attention reads every key and value back from the cache, as
stored, which is what decode sees too. llama.cpp runs its f32 GGUF conversion of the same checkpoint with its KV
cache in f32 and f16 without flash attention (on CPU it rounds to fp16 inside attention), f16 as it runs by default
(flash attention on) and q8_0 (flash attention on, which a quantized V cache needs), through
runners/llamacpp_logits.py in its peer venv (`bash benchmarks/setup_peers.sh llamacpp`).

    .venv/bin/python benchmarks/kv_cache_quality.py --out benchmarks/results/kv_cache_quality.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from bench_args import parser_with_work_dir
from offline_throughput import LLAMA_CPP_VERSION
from weight_quality import compare, llamacpp_gguf, reference_logits, run_llamacpp_logits, write_results

from kvyard.testing.create_model import cached_model

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
KVYARD_FORMATS = ("fp32", "fp16", "bf16", "int8")
# (KV type, flash attention): f32 and f16 without it (on CPU it rounds inside attention to fp16), f16 as llama.cpp
# runs by default (auto: on, here), q8_0 with it (a quantized V cache needs it).
LLAMACPP_RUNS = (("f32", "off"), ("f16", "off"), ("f16", "auto"), ("q8_0", "on"))


def parse_args() -> argparse.Namespace:
    parser = parser_with_work_dir(__doc__, "models, GGUF files and logs")
    parser.add_argument("--prompts", type=int, default=16, help="random prompts scored at every position")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_cache_quality.json", help="JSON result file"
    )
    return parser.parse_args()


def kvyard_logits(model_dir: Path, prompts: list[list[int]], kv_cache_dtype: str) -> torch.Tensor:
    """Logits at every position of each prompt, run as one prefill chunk over a cache in `kv_cache_dtype`."""
    import torch  # 1 s to import: not before --help has had its chance

    from kvyard.engine.runners.model_runner import PagedModel
    from kvyard.models.loader import load_model

    longest = max(len(p) for p in prompts)
    blocks = -(-longest // BLOCK_SIZE)
    model = load_model(model_dir, torch.float32, torch.device("cpu"), longest)
    paged = PagedModel(model, blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"), "auto", kv_cache_dtype)
    rows = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = paged.run(prompt, list(range(len(prompt))), [list(range(blocks))], [len(prompt)], [len(prompt)])
            rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


def llamacpp_logits(
    work_dir: Path, model_dir: Path, kv_type: str, flash_attn: str, prompts_file: Path
) -> np.ndarray | str:
    """llama.cpp's logits on its f32 conversion with the KV cache in `kv_type`, or why there are none."""
    gguf = llamacpp_gguf(work_dir, model_dir, "f32")
    if isinstance(gguf, str):
        return gguf
    out = work_dir / f"llamacpp-logits-f32-kv-{kv_type}-fa-{flash_attn}.npy"
    return run_llamacpp_logits(gguf, prompts_file, out, "--kv-type", kv_type, "--flash-attn", flash_attn)


def main() -> int:
    args = parse_args()
    import torch

    model_dir = cached_model(args.work_dir)
    prompts, reference = reference_logits(model_dir, args.prompts, args.prompt_tokens)
    vocab = reference.shape[-1]
    results: dict[str, Any] = {}
    for kv_format in KVYARD_FORMATS:
        name = f"kvyard kv {kv_format}"
        results[name] = compare(reference, kvyard_logits(model_dir, prompts, kv_format))
        print(json.dumps({name: results[name]}), flush=True)
    prompts_file = args.work_dir / "kv_cache_quality_prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    for kv_type, flash_attn in LLAMACPP_RUNS:
        logits = llamacpp_logits(args.work_dir, model_dir, kv_type, flash_attn, prompts_file)
        name = f"llama.cpp kv {kv_type}, flash attention {flash_attn}"
        results[name] = logits if isinstance(logits, str) else compare(reference, torch.from_numpy(logits)[:, :vocab])
        print(json.dumps({name: results[name]}), flush=True)
    conditions = {
        "model": "kvyard bench preset (llama, 56M, random weights, vocabulary 32000, head_dim 64), fp32 weights "
        "everywhere, fp32 reference (transformers)",
        "prompts": f"{args.prompts} prompts of {args.prompt_tokens} random token ids, every position",
        "kvyard": "int8 KV: a scale per token and KV head; every position attends to keys as stored",
        "llama_cpp": f"llama-cpp-python {LLAMA_CPP_VERSION}, its f32 GGUF conversion, KV type and flash attention "
        "as named (auto: llama.cpp's default, which turns it on here)",
    }
    write_results(args.out, conditions, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
