"""The rewritten turn: time to the first token and quality when a long conversation's middle is replaced by a
summary, for full recompute, prefix reuse, plain segment reuse and blending (kvyard.engine.blend).

Sessions are built from real text, the standard library's Python the demo model was trained on: a system line, a
first turn that states the task, then turns of code pasted by the user and prose answered by the assistant, about
`--history-tokens` in all. The assistant then rewrites its history the way coding assistants do when the context
runs out: the middle turns give way to a short summary (the first line of each), the first and the last
`--kept-turns` turns stay, and a new question follows. The full history was served before, so its blocks are in
the cache (and in the segment index); the rewritten prompt's start, up to the summary, is a prefix hit, the kept
turns moved to other positions.

For each method, the prompt's keys and values are built and the last token's logits computed (timed, median of
`--repeats`); then the 64 tokens full recompute greedily continues with are fed teacher-forced, and the next-token
distributions are compared with full recompute's: mean KL(full || method) and top-1 agreement over those 64
positions. Methods: `full` (every token), `prefix` (from the first changed block), `naive` (reused segments as
they are, only tokens no cache holds computed), and blending at each `--fractions` with both selections. Timings
are of kvyard's own model code on this machine (one thread unless `--threads`); ratios to `full` are what to read.

    .venv/bin/python benchmarks/history_rewrite.py --out benchmarks/results/history_rewrite.json
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_args import parser_with_work_dir

from kvyard.engine.blend.segments import SegmentIndex
from kvyard.engine.blend.settings import BlendSettings
from kvyard.engine.model_setup import load_tokenizer
from kvyard.engine.runners.blend_prefill import blend_prefill
from kvyard.engine.runners.model_runner import PagedModel
from kvyard.models.loader import load_model
from kvyard.testing.create_model import cached_model
from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.tokenizer_build import corpus_texts

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
ROOT = b"history-rewrite"
CONTINUATION = 64
SYSTEM = "You are a careful assistant for Python code. Answer with code and short explanations."


@dataclass(frozen=True, slots=True)
class Session:
    history: list[int]  # the prompt served before, now cached
    prompt: list[int]  # the rewritten one
    prefix: int  # tokens of the prompt in whole blocks equal to the history's start


def build_sessions(tokenizer: Any, count: int, history_tokens: int, kept_turns: int) -> list[Session]:
    text = "".join(corpus_texts(4 * history_tokens * (count + 1) * 6))
    pieces = [text[i : i + 1_800] for i in range(0, len(text) - 1_800, 1_800)]
    sessions, cursor = [], 0
    for _ in range(count):
        turns: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        turns.append({"role": "user", "content": "We are reviewing this module together:\n" + pieces[cursor][:600]})
        turns.append({"role": "assistant", "content": "Understood. Paste the parts you want to discuss."})
        cursor += 1
        while len(_render(tokenizer, turns)) < history_tokens:
            turns.append({"role": "user", "content": "What does this do?\n```python\n" + pieces[cursor] + "\n```"})
            turns.append({"role": "assistant", "content": pieces[cursor + 1][:900]})
            cursor += 2
        question = {"role": "user", "content": "Now combine the last two parts into one function."}
        history = _render(tokenizer, turns)
        middle = turns[3 : len(turns) - 2 * kept_turns]
        summary = "Summary of the earlier discussion:\n" + "\n".join("- " + _gist(turn) for turn in middle)
        rewritten = [*turns[:3], {"role": "user", "content": summary}, *turns[len(turns) - 2 * kept_turns :], question]
        prompt = _render(tokenizer, rewritten, generation_prompt=True)
        common = next((i for i, (a, b) in enumerate(zip(history, prompt)) if a != b), min(len(history), len(prompt)))
        sessions.append(Session(history, prompt, common // BLOCK * BLOCK))
    return sessions


def _gist(turn: dict[str, str]) -> str:
    """A turn's first line of substance: the pasted code's first line, or the answer's."""
    lines = [line for line in turn["content"].splitlines() if line.strip() and not line.startswith("```")]
    return (lines[1] if turn["role"] == "user" and len(lines) > 1 else lines[0])[:100] if lines else ""


def _render(tokenizer: Any, turns: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    return list(tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=generation_prompt))


class Bench:
    """One model with a cache holding a session's history in blocks 0.., and a work area for the prompt."""

    def __init__(self, paged: PagedModel, session: Session) -> None:
        self.paged, self.session = paged, session
        history = session.history
        self.history_blocks = list(range(-(-len(history) // BLOCK)))
        with torch.inference_mode():
            paged.run(history, list(range(len(history))), [self.history_blocks], [len(history)], [len(history)])
        self.index = SegmentIndex(BLOCK)
        for number in range(len(history) // BLOCK):
            self.index.add(number, number * BLOCK, history[number * BLOCK : (number + 1) * BLOCK], ROOT)
        first = len(self.history_blocks)
        needed = -(-(len(session.prompt) + CONTINUATION) // BLOCK)
        self.table = self.history_blocks[: session.prefix // BLOCK] + list(
            range(first, first + needed - session.prefix // BLOCK)
        )

    def prefill(self, method: str, settings: BlendSettings | None) -> tuple[torch.Tensor, dict[str, int]]:
        """The last prompt token's final hidden state, and what was reused and recomputed."""
        prompt, paged = self.session.prompt, self.paged
        start = 0 if method == "full" else self.session.prefix
        table = self.table if start else list(range(self.table[-1] + 1, self.table[-1] + 1 + len(self.table)))
        if settings is None:
            hidden = paged.run(
                prompt[start:], list(range(start, len(prompt))), [table], [len(prompt)], [len(prompt) - start]
            )
            self.last_table = table
            return hidden[-1:], {"reused_segment_tokens": 0, "recomputed_segment_tokens": 0, "prefix_tokens": start}
        matches = self.index.find(prompt, start, ROOT)
        result = blend_prefill(paged, prompt, table, start, matches, settings)
        self.last_table = table
        counts = {"prefix_tokens": start}
        counts |= {"reused_segment_tokens": result.reused_tokens, "recomputed_segment_tokens": result.recomputed_tokens}
        return result.hidden, counts

    def continuation_logits(self, last_hidden: torch.Tensor, continuation: list[int]) -> torch.Tensor:
        """log-softmax [CONTINUATION, vocab]: the prompt's next token, then each teacher-forced one's."""
        paged, n = self.paged, len(self.session.prompt)
        fed = continuation[:-1]
        total = n + len(fed)
        hidden = paged.run(fed, list(range(n, total)), [self.last_table], [total], [len(fed)])
        return paged.model.compute_logits(torch.cat([last_hidden, hidden])).log_softmax(-1)


def greedy_continuation(bench: Bench, last_hidden: torch.Tensor) -> list[int]:
    paged, n = bench.paged, len(bench.session.prompt)
    tokens = [int(paged.model.compute_logits(last_hidden).argmax())]
    while len(tokens) < CONTINUATION:
        position = n + len(tokens) - 1
        hidden = paged.run([tokens[-1]], [position], [bench.last_table], [position + 1], [1])
        tokens.append(int(paged.model.compute_logits(hidden).argmax()))
    return tokens


def timed(work: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    times, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - began)
    return result, statistics.median(times)


def methods(fractions: list[float]) -> list[tuple[str, BlendSettings | None]]:
    listed: list[tuple[str, BlendSettings | None]] = [("full", None), ("prefix", None)]
    listed.append(("naive", BlendSettings(0.0, "leading", 0)))
    for selection in ("deviation", "leading"):
        listed += [(f"blend {selection} {f:g}", BlendSettings(f, selection)) for f in fractions]
    return listed


def run_model(name: str, model_dir: Path, args: Any) -> dict[str, Any]:
    tokenizer = load_tokenizer(str(model_dir))
    sessions = build_sessions(tokenizer, args.sessions, args.history_tokens, args.kept_turns)
    longest = max(max(len(s.history), len(s.prompt)) for s in sessions) + CONTINUATION
    model = load_model(model_dir, torch.float32, torch.device("cpu"), longest + BLOCK)
    paged = PagedModel(model, 3 * (-(-longest // BLOCK)) + 8, BLOCK, torch.float32, torch.device("cpu"))
    rows: dict[str, list[dict[str, float]]] = {}
    shapes = []
    with torch.inference_mode():
        for number, session in enumerate(sessions):
            bench = Bench(paged, session)
            reference, full_s = timed(partial(bench.prefill, "full", None), args.repeats)
            continuation = greedy_continuation(bench, reference[0])
            expected = bench.continuation_logits(reference[0], continuation)
            shapes.append({"history": len(session.history), "prompt": len(session.prompt), "prefix": session.prefix})
            for method, settings in methods(args.fractions):
                kind = "full" if method == "full" else ("prefix" if settings is None else "blend")
                (hidden, counts), seconds = timed(partial(bench.prefill, kind, settings), args.repeats)
                observed = bench.continuation_logits(hidden, continuation)
                kl = torch.sum(expected.exp() * (expected - observed), dim=-1)
                agree = (observed.argmax(-1) == expected.argmax(-1)).float().mean().item()
                row = {"ttft_s": seconds, "ttft_over_full": seconds / full_s, "kl": kl.mean().item(), "top1": agree}
                reusable = counts["prefix_tokens"] + counts["reused_segment_tokens"]
                row |= {**counts, "reusable_fraction": reusable / len(session.prompt)}
                rows.setdefault(method, []).append(row)
            print(json.dumps({"model": name, "session": number, **shapes[-1]}), flush=True)
    summary = {method: {key: statistics.mean(r[key] for r in runs) for key in runs[0]} for method, runs in rows.items()}
    for method, values in summary.items():
        print(json.dumps({"model": name, "method": method, **{k: round(v, 4) for k, v in values.items()}}), flush=True)
    return {"sessions": shapes, "mean": summary, "per_session": rows}


def main() -> int:
    parser = parser_with_work_dir(__doc__, "where the bench-preset model is created")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--history-tokens", type=int, default=7_000, help="each served history's length, at least")
    parser.add_argument("--kept-turns", type=int, default=4, help="user/assistant pairs kept after the summary")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.2, 0.3])
    parser.add_argument("--repeats", type=int, default=3, help="timings per method; the median is kept")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=["demo", "bench"], choices=["demo", "bench"])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "history_rewrite.json")
    args = parser.parse_args()
    if args.sessions <= 0 or args.repeats <= 0 or args.kept_turns <= 0:
        parser.error("--sessions, --repeats and --kept-turns must be > 0")
    torch.set_num_threads(args.threads)
    dirs = {"demo": DEMO_MODEL_DIR, "bench": cached_model(args.work_dir)}
    results = {name: run_model(name, dirs[name], args) for name in args.models}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "kvyard"], capture_output=True, text=True, cwd=REPO)
    conditions = {
        "cpu": _cpu_name(),
        "kvyard_tree_dirty": bool(dirty.stdout.strip()),
        "threads": args.threads,
        "torch": torch.__version__,
        "block_size": BLOCK,
        "kvyard_commit": commit.stdout.strip(),
        **{key: getattr(args, key) for key in ("sessions", "history_tokens", "kept_turns", "repeats")},
    }
    args.out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    return 0


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def plot(results: dict[str, Any], path: Path) -> None:
    """Per model: each method's KL from full recompute against its time to first token, both as ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for axis, (name, result) in zip(axes[0], results.items()):
        means = result["mean"]
        naive_kl = means["naive"]["kl"]
        for selection, marker in (("leading", "o-"), ("deviation", "s-")):
            chosen = [m for m in means if m.startswith(f"blend {selection}")]
            chosen.sort(key=lambda m: float(m.split()[-1]))
            xs = [means["naive"]["ttft_over_full"], *(means[m]["ttft_over_full"] for m in chosen)]
            ys = [1.0, *(means[m]["kl"] / naive_kl for m in chosen)]
            axis.plot(xs, ys, marker, label=f"blend, {selection} (from naive: fraction 0 ... {chosen[-1].split()[-1]})")
        axis.axvline(means["prefix"]["ttft_over_full"], color="grey", linestyle=":", label="prefix reuse only (exact)")
        axis.axvline(0.3, color="red", linewidth=0.6, label="TTFT bar 0.3x")
        axis.axhline(0.1, color="red", linewidth=0.6, linestyle="--", label="KL bar 0.1x naive")
        axis.set_xlabel("time to first token / full recompute")
        axis.set_ylabel("mean KL from full recompute / naive reuse's")
        prompts = [session["prompt"] for session in result["sessions"]]
        axis.set_title(f"{name} model: {len(prompts)} rewritten histories, {min(prompts)}-{max(prompts)}-token prompts")
        axis.set_yscale("log")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
