"""kvyard itself, through its offline ``LLM`` API (runs in the repo's venv).

All prompts of a scenario go to one ``generate`` call. Single-stream TTFT comes
from a separate ``max_tokens=1`` run of the same prompt.

Engine options: ``dtype`` (default float32), ``max_num_batched_tokens``
(default 2048), ``num_kv_blocks`` (default 4096), ``enable_prefix_caching``
(default True), plus any extra ``LLM(...)`` keyword in ``llm_kwargs``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from common import (
    load_workload,
    parse_args,
    run_all_at_once,
    run_scenarios,
    set_thread_env,
    write_result,
)

DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "max_num_batched_tokens": 2048,
    "num_kv_blocks": 4096,
    "enable_prefix_caching": True,
}


class KvyardEngine:
    def __init__(self, model_dir: str, threads: int, opts: dict[str, Any]) -> None:
        import torch

        from kvyard import LLM

        torch.set_num_threads(threads)
        self.config = {k: opts.get(k, v) for k, v in DEFAULTS.items()}
        self.llm_kwargs: dict[str, Any] = opts.get("llm_kwargs", {})  # the variant: quantization, KV and matmul dtypes
        self.llm = LLM(model_dir, **self.config, **self.llm_kwargs)

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        from kvyard import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
        # Every timed run starts cold: a repeat must not be served from the previous run's prefix cache.
        self.llm.reset_prefix_cache()
        return [list(o.token_ids) for o in self.llm.generate(prompts, params)]


def git_commit() -> str:
    repo = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def main() -> None:
    args = parse_args(__doc__ or "")
    workload = load_workload(args.workload)
    set_thread_env(workload.threads)
    label = args.engine or "kvyard"  # kvyard-int8 has its own options (quantization)
    engine = KvyardEngine(workload.model_dir, workload.threads, workload.options(label))
    engine.generate(workload.warmup.prompts, workload.warmup.output_lens)
    results = run_scenarios(workload, args.scenarios, lambda s: run_all_at_once(engine.generate, s))

    import torch

    import kvyard

    info = {
        "version": f"kvyard {getattr(kvyard, '__version__', 'dev')} ({git_commit()[:12]})",
        "torch": torch.__version__,
        "dtype": engine.config["dtype"] + ("" if label == "kvyard" else f" ({label})"),
        "threads": torch.get_num_threads(),
        "batch_size": "all prompts in one generate call",
        "config": {**engine.config, **engine.llm_kwargs},
        "notes": ["offline LLM API, token-id prompts, ignore_eos, greedy"],
    }
    write_result(args.out, label, info, results)


if __name__ == "__main__":
    main()
