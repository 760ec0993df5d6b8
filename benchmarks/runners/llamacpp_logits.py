"""llama.cpp's next-token logits at every position of each prompt (for benchmarks/weight_quality.py).

Runs in the llamacpp peer venv: reads prompts (JSON list of token-id lists), evaluates each one in a single
batch with logits requested at every position, and writes a float32 array [sum of prompt lengths, vocab] with
numpy's .npy format.

    python llamacpp_logits.py --gguf MODEL.gguf --prompts prompts.json --out logits.npy --threads 2 \
        [--kv-type f16] [--flash-attn auto] [--no-repack]

--kv-type sets the KV cache's type for keys and values (f32, f16 or q8_0; default: llama.cpp's, f16);
--flash-attn on, off or auto (llama.cpp's default). A quantized V cache needs it on; on CPU it also rounds to
fp16 inside attention, so an f32 cache is only f32 with it off. --no-repack loads the weights without llama.cpp's
extra buffer types (weight repacking, AMX), for a machine where that path crashes.
"""

from __future__ import annotations

import argparse
import json

import llama_cpp as lc
import numpy as np

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
KV_TYPES = {"f32": lc.GGML_TYPE_F32, "f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-type", choices=KV_TYPES, default=None)
    parser.add_argument("--flash-attn", choices=FLASH_ATTN, default="auto")
    parser.add_argument("--no-repack", action="store_true")
    args = parser.parse_args()
    with open(args.prompts) as file:
        prompts: list[list[int]] = json.load(file)
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model_params.use_extra_bufts = not args.no_repack
    model = lc.llama_model_load_from_file(args.gguf.encode(), model_params)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    longest = max(len(p) for p in prompts)
    params = lc.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = longest
    params.n_threads = params.n_threads_batch = args.threads
    if args.kv_type is not None:
        params.type_k = params.type_v = KV_TYPES[args.kv_type]
    params.flash_attn_type = FLASH_ATTN[args.flash_attn]
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(longest, 0, 1)
    rows = []
    for prompt in prompts:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        for i, token in enumerate(prompt):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(prompt)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for i in range(len(prompt)):
            rows.append(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy())
    np.save(args.out, np.stack(rows).astype(np.float32))
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
