"""Quality of converted weights: next-token distributions of each weight scheme against the fp32 model's, on the
same prompts and positions, kvyard's int8, fp16 and bf16 beside llama.cpp's q8_0 and f16 conversions of the same
checkpoint.

For every position of 16 prompts of 128 random token ids: mean KL(fp32 || scheme) of the next-token
distribution, and how often the scheme's most likely token is fp32's. fp32 is Hugging Face transformers on the
checkpoint. Each kvyard scheme is transformers on the weights kvyard's loader computes with (converted and back
to fp32: tests/test_quantization.py checks kvyard's converted engines equal to exactly that model, greedy tokens
and logprobs to 1e-4), so its logits are kvyard's. The "bf16 matmul" rows are kvyard with --matmul-dtype
bfloat16 on a prompt: every converted linear computes `bf16_linear` (kvyard's own function) on its weight in bf16
(tests/test_quantization.py checks the engine's layers round as it does). The "decode kernel" row is int8 as
kvyard's native kernel of few rows computes a decode step: activations rounded to int16 per group of 32 first.
llama.cpp runs its own GGUF
conversions in its peer venv (`bash benchmarks/setup_peers.sh llamacpp`) with its default f16 KV cache, through
runners/llamacpp_logits.py.

    .venv/bin/python benchmarks/weight_quality.py --out benchmarks/results/weight_quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from bench_args import parser_with_work_dir
from offline_throughput import LLAMA_CPP_VERSION, PEERS_DIR, RUNNERS, ensure_gguf

from kvyard.testing.create_model import cached_model

if TYPE_CHECKING:
    import torch
    from torch import nn

REPO = Path(__file__).resolve().parents[1]
PEERS = PEERS_DIR


def parse_args() -> argparse.Namespace:
    parser = parser_with_work_dir(__doc__, "models, packages and logs")
    parser.add_argument("--prompts", type=int, default=16, help="random prompts scored at every position")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--gguf-types", default="q8_0,f16", help="llama.cpp conversions compared ('' none)")
    parser.add_argument(
        "--llamacpp-no-repack",
        action="store_true",
        help="llama.cpp without its weight repacking and AMX path (it crashed on an Intel Xeon VM with AMX)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "weight_quality.json", help="JSON result file"
    )
    return parser.parse_args()


def hf_logits(model: nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    import torch  # 1 s to import, as transformers below: not before --help has had its chance

    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0].float() for p in prompts])


def converted_reference(model_dir: Path, scheme: str) -> nn.Module:
    import torch
    from transformers import AutoModelForCausalLM

    from kvyard.models.quantization import round_trip_linears

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if scheme != "none":
        round_trip_linears(model, scheme)
    return model


def bf16_matmul_reference(model_dir: Path, scheme: str) -> nn.Module:
    """The converted reference whose converted linears multiply as kvyard's do with --matmul-dtype bfloat16 on
    many rows (every position of a prompt at once): `bf16_linear` on the converted weight in bf16."""
    import torch
    from torch import nn

    from kvyard.models.layers import bf16_linear, onednn_runs_bf16
    from kvyard.models.quantization import converts

    model = converted_reference(model_dir, scheme)
    onednn = torch.backends.mkldnn.is_available() and onednn_runs_bf16()
    for module in model.modules():
        if isinstance(module, nn.Linear) and converts(module, scheme):
            weight16 = module.weight.detach().to(torch.bfloat16)  # the converted weight, exactly (int8: as widened)

            def forward(x: torch.Tensor, weight16: torch.Tensor = weight16, bias: Any = module.bias) -> torch.Tensor:
                rows = x.reshape(-1, x.shape[-1])
                return bf16_linear(rows, weight16, bias, onednn).reshape(*x.shape[:-1], -1)

            module.forward = forward  # type: ignore[method-assign,assignment]
    return model


def int16_activation_reference(model_dir: Path) -> nn.Module:
    """The int8 reference whose converted linears see their input as the native int8 kernel of few rows (decode,
    verification) rounds it: `round_activations_int16` on each group of 32 (tests/test_quantization.py checks
    the kernel against exactly that arithmetic)."""
    from torch import nn

    from kvyard.models.quantization import converts, round_activations_int16

    model = converted_reference(model_dir, "int8")
    for module in model.modules():
        if isinstance(module, nn.Linear) and converts(module, "int8"):
            module.register_forward_pre_hook(lambda _module, args: (round_activations_int16(args[0]),))
    return model


def compare(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    ref_log = reference.double().log_softmax(-1)
    log = logits.double().log_softmax(-1)
    kl = (ref_log.exp() * (ref_log - log)).sum(-1)
    top1 = (reference.argmax(-1) == logits.argmax(-1)).double()
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "top1_agreement": float(top1.mean())}


def llamacpp_gguf(work_dir: Path, model_dir: Path, outtype: str) -> Path | str:
    """llama.cpp's own GGUF conversion of `model_dir` (made once, kept in `work_dir`), or why there is none."""
    python = PEERS / "llamacpp" / "bin" / "python"
    if not python.exists():
        return f"no llama.cpp venv at {python.parent.parent} (bash benchmarks/setup_peers.sh llamacpp)"
    try:
        return ensure_gguf(argparse.Namespace(work_dir=work_dir, peers_dir=PEERS), model_dir, outtype)
    except RuntimeError as error:
        return str(error)


def run_llamacpp_logits(gguf: Path, prompts_file: Path, out: Path, *options: str) -> np.ndarray | str:
    """runners/llamacpp_logits.py on `gguf` (with its `options`) in the llama.cpp venv: the logits, or why not."""
    command = [
        str(PEERS / "llamacpp" / "bin" / "python"),
        str(RUNNERS / "llamacpp_logits.py"),
        "--gguf",
        str(gguf),
        "--prompts",
        str(prompts_file),
        "--out",
        str(out),
        "--threads",
        str(os.cpu_count() or 1),
        *options,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return f"llama.cpp logits failed: {result.stderr[-500:]}"
    return np.load(out)


def llamacpp_logits(args: argparse.Namespace, model_dir: Path, outtype: str, prompts_file: Path) -> np.ndarray | str:
    gguf = llamacpp_gguf(args.work_dir, model_dir, outtype)
    if isinstance(gguf, str):
        return gguf
    options = ("--no-repack",) if args.llamacpp_no_repack else ()
    return run_llamacpp_logits(gguf, prompts_file, args.work_dir / f"llamacpp-logits-{outtype}.npy", *options)


def reference_logits(model_dir: Path, num_prompts: int, prompt_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Seeded prompts of random token ids, and the fp32 model's logits at every position (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    reference_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = reference_model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_tokens,), generator=generator).tolist() for _ in range(num_prompts)]
    return prompts, hf_logits(reference_model, prompts)


def write_results(out: Path, conditions: dict[str, Any], results: dict[str, Any]) -> None:
    """The JSON a quality script writes: its conditions (with kvyard's commit) and results."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    conditions = {**conditions, "kvyard_commit": commit.stdout.strip()}
    out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def main() -> int:
    args = parse_args()
    import torch

    model_dir = cached_model(args.work_dir)
    prompts, reference = reference_logits(model_dir, args.prompts, args.prompt_tokens)
    vocab = reference.shape[-1]
    results: dict[str, Any] = {}
    for scheme, name in (("int8", "kvyard int8 (group 32)"), ("fp16", "kvyard fp16"), ("bf16", "kvyard bf16")):
        results[name] = compare(reference, hf_logits(converted_reference(model_dir, scheme), prompts))
        print(json.dumps({name: results[name]}), flush=True)
    name = "kvyard int8 (group 32), decode kernel: int16 activations"
    results[name] = compare(reference, hf_logits(int16_activation_reference(model_dir), prompts))
    print(json.dumps({name: results[name]}), flush=True)
    bf16_matmul_rows = (
        ("int8", "kvyard int8 (group 32), bf16 matmul"),
        ("bf16", "kvyard bf16, bf16 matmul"),
        ("none", "kvyard fp32 weights, bf16 matmul"),
    )
    for scheme, name in bf16_matmul_rows:
        results[name] = compare(reference, hf_logits(bf16_matmul_reference(model_dir, scheme), prompts))
        print(json.dumps({name: results[name]}), flush=True)
    prompts_file = args.work_dir / "weight_quality_prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    for outtype in filter(None, args.gguf_types.split(",")):
        logits = llamacpp_logits(args, model_dir, outtype, prompts_file)
        name = f"llama.cpp {outtype}"
        results[name] = logits if isinstance(logits, str) else compare(reference, torch.from_numpy(logits)[:, :vocab])
        print(json.dumps({name: results[name]}), flush=True)
    conditions = {
        "model": "kvyard bench preset (llama, 56M, random weights, vocabulary 32000), fp32 reference (transformers)",
        "prompts": f"{args.prompts} prompts of {args.prompt_tokens} random token ids, every position",
        "llama_cpp": f"llama-cpp-python {LLAMA_CPP_VERSION}, its own GGUF conversions, default f16 KV cache",
    }
    write_results(args.out, conditions, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
