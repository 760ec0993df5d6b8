"""llama.cpp peer through llama-cpp-python's low-level (ctypes) API.

The high-level ``Llama`` class runs one sequence at a time, so this runner
drives ``llama_decode`` itself with continuous batching: up to ``slots``
sequences (``seq_id`` = slot) share one unified KV cache. Each step packs one
decode token per running sequence plus prompt chunks of newly admitted ones,
within ``n_batch`` tokens. A finished sequence's KV cells are dropped and the
next prompt takes its slot. Sampling is greedy (argmax of the logits) and EOS
is ignored, so every sequence generates exactly its requested length.

The unified cache is the default because one KV stream per sequence
(``kv_unified`` false) measured slower here: 38 vs 114-131 output tok/s with 8
slots (under some other load); 32 unified slots were slower too (31 tok/s).

Engine options (workload ``engine_options[<label>]``): ``gguf`` (path, required),
``slots`` (default 8), ``n_batch`` (default 2048), ``n_ubatch`` (default 512),
``kv_type`` ("f16" default, or "f32"), ``kv_unified`` (default true).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from common import (
    Scenario,
    decode_result,
    load_workload,
    now,
    parse_args,
    run_scenarios,
    set_thread_env,
    throughput_result,
    write_result,
)

GGML_TYPES = {"f32": 0, "f16": 1}


@dataclass
class SeqState:
    index: int  # position in the scenario's prompt list
    prompt: list[int]
    target: int
    cursor: int = 0  # prompt tokens already fed
    output: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.cursor < len(self.prompt)

    @property
    def pos(self) -> int:
        return self.cursor + len(self.output) - 1 if not self.prefilling else self.cursor


class LlamaCppEngine:
    def __init__(self, gguf: str, threads: int, opts: dict[str, Any]) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        self.threads = threads
        self.slots = int(opts.get("slots", 8))
        self.n_batch = int(opts.get("n_batch", 2048))
        self.n_ubatch = int(opts.get("n_ubatch", 512))
        self.kv_type = str(opts.get("kv_type", "f16"))
        self.kv_unified = bool(opts.get("kv_unified", True))
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.use_extra_bufts = bool(opts.get("extra_buffer_types", True))  # False: no repacking, no AMX
        self.model = lc.llama_model_load_from_file(gguf.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"cannot load {gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.ctx: Any = None
        self.ctx_shape: tuple[int, int] = (0, 0)

    def _context(self, n_ctx: int, n_seq: int) -> Any:
        """A context for ``n_seq`` sequences and ``n_ctx`` KV cells in all (reused when the shape matches)."""
        lc = self.lc
        if self.ctx is not None and self.ctx_shape == (n_ctx, n_seq):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
            return self.ctx
        if self.ctx is not None:
            lc.llama_free(self.ctx)
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, n_seq, self.kv_unified
        params.n_batch, params.n_ubatch = self.n_batch, self.n_ubatch
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k = params.type_v = GGML_TYPES[self.kv_type]
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx={n_ctx}, n_seq={n_seq})")
        self.ctx_shape = (n_ctx, n_seq)
        return self.ctx

    def _argmax(self, ctx: Any, i: int) -> int:
        logits = self.lc.llama_get_logits_ith(ctx, i)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def _fill(self, batch: Any, running: dict[int, SeqState]) -> list[tuple[int, int]]:
        """Pack decode tokens, then prompt chunks; returns (batch index, slot) pairs that need logits."""
        n, wanted = 0, []

        def add(token: int, pos: int, slot: int, logits: bool) -> None:
            nonlocal n
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
            batch.seq_id[n][0], batch.logits[n] = slot, int(logits)
            if logits:
                wanted.append((n, slot))
            n += 1

        for slot, seq in running.items():
            if not seq.prefilling:
                add(seq.output[-1], seq.pos, slot, True)
        for slot, seq in running.items():
            while seq.prefilling and n < self.n_batch:
                add(seq.prompt[seq.cursor], seq.cursor, slot, seq.cursor == len(seq.prompt) - 1)
                seq.cursor += 1
        batch.n_tokens = n
        return wanted

    def generate(
        self, prompts: list[list[int]], output_lens: list[int], slots: int, max_len: int = 0
    ) -> tuple[list[list[int]], float]:
        """Continuous batching over all prompts; returns outputs and the time of the first sampled token.

        ``max_len`` (cells per sequence) defaults to the longest prompt + output.
        """
        lc = self.lc
        max_len = max(max_len, max(len(p) + n for p, n in zip(prompts, output_lens, strict=True)))
        ctx = self._context(slots * max_len, slots)
        mem = lc.llama_get_memory(ctx)
        batch = lc.llama_batch_init(self.n_batch, 0, 1)
        pending = deque(SeqState(i, p, n) for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True)))
        running: dict[int, SeqState] = {}
        outputs: list[list[int]] = [[] for _ in prompts]
        t0, first_token = now(), 0.0
        try:
            while pending or running:
                for slot in range(slots):
                    if slot not in running and pending:
                        running[slot] = pending.popleft()
                wanted = self._fill(batch, running)
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for i, slot in wanted:
                    seq = running[slot]
                    seq.output.append(self._argmax(ctx, i))
                    first_token = first_token or now() - t0
                    if len(seq.output) == seq.target:
                        outputs[seq.index] = seq.output
                        lc.llama_memory_seq_rm(mem, slot, -1, -1)
                        del running[slot]
        finally:
            lc.llama_batch_free(batch)
        return outputs, first_token


def run_one(engine: LlamaCppEngine, scenario: Scenario) -> dict[str, Any]:
    slots = min(engine.slots if scenario.name == "batch" else 1, len(scenario.prompts))
    max_len = max(len(p) + n for p, n in zip(scenario.prompts, scenario.output_lens, strict=True))
    # Allocate (and warm) a context of this scenario's shape before timing.
    engine.generate(scenario.prompts[:slots], [2] * slots, slots, max_len)
    t0 = now()
    outputs, ttft = engine.generate(scenario.prompts, scenario.output_lens, slots)
    wall = now() - t0
    if scenario.name == "decode":
        return decode_result(scenario, ttft, wall, outputs, "time of first sampled token (own decode loop)")
    return throughput_result(scenario, wall, outputs, batch_size=slots)


def main() -> None:
    args = parse_args(__doc__ or "")
    workload = load_workload(args.workload)
    set_thread_env(workload.threads)
    label = args.engine or "llamacpp"
    opts = workload.options(label)
    engine = LlamaCppEngine(opts["gguf"], workload.threads, opts)
    engine.generate(workload.warmup.prompts, workload.warmup.output_lens, engine.slots)
    results = run_scenarios(workload, args.scenarios, lambda s: run_one(engine, s))

    import llama_cpp

    info = {
        "version": f"llama-cpp-python {llama_cpp.__version__}",
        "dtype": str(opts.get("dtype", "unknown")),
        "gguf": opts["gguf"],
        "threads": workload.threads,
        "batch_size": engine.slots,
        "kv_cache_type": engine.kv_type,
        "notes": [
            f"low-level API, continuous batching over {engine.slots} slots "
            f"({'unified KV cache' if engine.kv_unified else 'one KV stream per slot'}), "
            f"n_batch={engine.n_batch}, n_ubatch={engine.n_ubatch}, flash_attn=auto, greedy argmax in numpy",
            "system: " + llama_cpp.llama_print_system_info().decode().strip(),
            "extra buffer types (weight repacking, AMX): " + ("on" if opts.get("extra_buffer_types", True) else "off"),
        ],
    }
    write_result(args.out, label, info, results)


if __name__ == "__main__":
    main()
