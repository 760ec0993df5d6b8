"""llama.cpp's prompt-lookup speculative decoding (llama-cpp-python's LlamaPromptLookupDecoding), single stream.

Runs in the ``llamacpp`` peer venv:

    python llamacpp_spec.py --gguf MODEL.gguf --prompts PROMPTS.json --num-pred-tokens 4 --out OUT.json

For each prompt: greedy generation without a draft, with prompt lookup, and without again (this machine is noisy),
EOS banned so every answer is `--output-tokens` long; the outputs with and without lookup are compared. Writes
tokens/s of both and whether the outputs were equal.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

from common import compare_speculation


def generate(llm: Any, prompt: list[int], output_tokens: int, eos: int) -> tuple[list[int], float]:
    llm.reset()
    started = time.perf_counter()
    tokens: list[int] = []
    from llama_cpp import LogitsProcessorList

    for token in llm.generate(prompt, temp=0.0, top_k=1, logits_processor=LogitsProcessorList([ban(eos)])):
        tokens.append(int(token))
        if len(tokens) == output_tokens:
            break
    return tokens, time.perf_counter() - started


def ban(token_id: int) -> Any:
    def processor(input_ids: Any, scores: Any) -> Any:
        scores[token_id] = -float("inf")
        return scores

    return processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--num-pred-tokens", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    prompts = json.loads(Path(args.prompts).read_text())
    # Room for the longest prompt, its output and a step's guesses beyond it (llama-cpp-python fails past n_ctx).
    n_ctx = max(len(prompt) for prompt in prompts) + args.output_tokens + args.num_pred_tokens + 16
    common = {
        "model_path": args.gguf,
        "n_ctx": n_ctx,
        "n_threads": args.threads,
        "n_threads_batch": args.threads,
        "verbose": False,
        "logits_all": False,
    }
    plain = Llama(**common)
    # With a draft model llama-cpp-python computes logits for every position whatever logits_all says, but sizes its
    # logits array by it: False leaves n_batch (512) rows, and a sequence longer than that fails.
    lookup = Llama(
        **{**common, "logits_all": True}, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.num_pred_tokens)
    )
    eos = plain.token_eos()
    result = compare_speculation(
        prompts,
        partial(generate, plain, output_tokens=args.output_tokens, eos=eos),
        partial(generate, lookup, output_tokens=args.output_tokens, eos=eos),
        args.output_tokens,
    )
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
