"""One single-stream decode of llama.cpp for benchmarks/offload.py, run in its memory cgroup in the llamacpp peer
venv: the GGUF memory-mapped (llama.cpp's default; weight repacking off, since a repacked copy would not be the
mapped file), a prompt prefilled, then one llama_decode a token: the tokens given with --feed (kvyard's, so both
engines route the same text) or its own argmax; prints one JSON line with per-step times and its argmax tokens.

    /opt/kvyard-peers/llamacpp/bin/python benchmarks/runners/offload_llamacpp.py MODEL.gguf --prompt 1,2,3 --tokens 64
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("gguf")
    parser.add_argument("--prompt", required=True, help="token ids, comma-separated")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-seconds", type=float, default=600, help="stop decoding after this long")
    parser.add_argument("--feed", help="tokens to feed after the prompt, comma-separated (default: its own argmax)")
    args = parser.parse_args()

    import llama_cpp as lc
    import numpy as np

    start = time.perf_counter()
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model_params.use_mmap = True
    model_params.use_extra_bufts = False
    model = lc.llama_model_load_from_file(args.gguf.encode(), model_params)
    if not model:
        raise SystemExit(f"cannot load {args.gguf}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    params = lc.llama_context_default_params()
    params.n_ctx = 512
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = args.threads
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit("llama_init_from_model failed")
    load_s = time.perf_counter() - start

    def decode(tokens: list[int]) -> int:
        array = (lc.llama_token * len(tokens))(*tokens)
        if lc.llama_decode(ctx, lc.llama_batch_get_one(array, len(tokens))) != 0:
            raise SystemExit("llama_decode failed")
        logits = lc.llama_get_logits_ith(ctx, -1)
        return int(
            np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).argmax()
        )

    given = [int(token) for token in args.feed.split(",")] if args.feed else []
    feed = [int(token) for token in args.prompt.split(",")]
    step_s: list[float] = []
    tokens: list[int] = []
    while len(tokens) < args.tokens and sum(step_s) <= args.max_seconds:
        begin = time.perf_counter()
        token = decode(feed)
        step_s.append(time.perf_counter() - begin)
        tokens.append(token)
        feed = [given[len(tokens) - 1] if len(tokens) <= len(given) else token]
    print(json.dumps({"load_s": load_s, "step_s": step_s, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
