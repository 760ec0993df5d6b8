"""HF transformers peer: batched ``generate`` in fp32 with left padding.

Runs in the ``hf`` peer venv (torch + transformers). The offline batch is cut
into consecutive batches of ``batch_size`` prompts (workload order); each batch
generates up to its largest requested output length and only the requested
tokens are counted, so padding and over-generation are HF's own cost.
"""

from __future__ import annotations

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

DEFAULT_BATCH_SIZE = 8


class TimingStreamer:
    """Records a timestamp per ``put``: the first is the prompt, then one per new token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(now())

    def end(self) -> None:
        pass


class HFEngine:
    def __init__(self, model_dir: str, threads: int, batch_size: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.batch_size = batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        gen = self.model.generation_config
        gen.eos_token_id = None  # ignore EOS: generate exactly max_new_tokens, greedy stays unbiased
        gen.pad_token_id = 0
        gen.do_sample = False
        for attr in ("temperature", "top_p", "top_k"):
            setattr(gen, attr, None)

    def _pad_left(self, prompts: list[list[int]]) -> tuple[Any, Any]:
        width = max(len(p) for p in prompts)
        ids = [[0] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        return self.torch.tensor(ids), self.torch.tensor(mask)

    def generate(self, prompts: list[list[int]], max_new: int, streamer: Any = None) -> list[list[int]]:
        ids, mask = self._pad_left(prompts)
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                streamer=streamer,
            )
        return out[:, ids.shape[1] :].tolist()

    def run_batched(self, scenario: Scenario) -> tuple[list[list[int]], list[int]]:
        """Generate in consecutive batches; returns outputs cut to requested lengths, and each batch's max."""
        outputs: list[list[int]] = []
        batch_max: list[int] = []
        for start in range(0, len(scenario.prompts), self.batch_size):
            prompts = scenario.prompts[start : start + self.batch_size]
            lens = scenario.output_lens[start : start + self.batch_size]
            batch_max.append(max(lens))
            generated = self.generate(prompts, max(lens))
            outputs.extend(g[:n] for g, n in zip(generated, lens, strict=True))
        return outputs, batch_max


def run_one(engine: HFEngine, scenario: Scenario) -> dict[str, Any]:
    if scenario.name == "decode":
        streamer = TimingStreamer()
        t0 = now()
        outputs = engine.generate(scenario.prompts, scenario.output_lens[0], streamer=streamer)
        total = now() - t0
        return decode_result(scenario, streamer.stamps[1] - t0, total, outputs, "streamer timestamp of first token")
    t0 = now()
    outputs, batch_max = engine.run_batched(scenario)
    wall = now() - t0
    generated = sum(
        m * min(engine.batch_size, len(scenario.prompts) - i * engine.batch_size) for i, m in enumerate(batch_max)
    )
    return throughput_result(
        scenario,
        wall,
        outputs,
        batch_size=engine.batch_size,
        per_batch_max_output=batch_max,
        tokens_generated_incl_padding=generated,
    )


def main() -> None:
    args = parse_args(__doc__ or "")
    workload = load_workload(args.workload)
    set_thread_env(workload.threads)
    opts = workload.options("hf")
    engine = HFEngine(workload.model_dir, workload.threads, int(opts.get("batch_size", DEFAULT_BATCH_SIZE)))
    engine.run_batched(workload.warmup)
    results = run_scenarios(workload, args.scenarios, lambda s: run_one(engine, s))

    import torch
    import transformers

    info = {
        "version": f"transformers {transformers.__version__}",
        "torch": torch.__version__,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "batch_size": engine.batch_size,
        "notes": [
            f"batched generate, batches of {engine.batch_size} in workload order, left padding, "
            f"attention={engine.model.config._attn_implementation}",
            "each batch runs to its largest requested output; only requested tokens are counted",
        ],
    }
    write_result(args.out, "hf", info, results)


if __name__ == "__main__":
    main()
