"""Train the demo model: a small Llama that writes Python, on this Python's standard library.

    python -m kvyard.testing.train_demo --out models/demo --minutes 60

Corpus: every top-level function and class of the standard library's `.py` files (found with `ast`), each
one document `<begin_of_text> source <end_of_text>`, and for those with a docstring also a chat (user: the
docstring's first line; assistant: the source), so the model learns to end what it writes. Files whose
path hash falls in the held-out tenth never reach training; their perplexity is measured at the end (and
serves quantization and speculative-decoding measurements later). Documents are shuffled (seeded) and
packed into rows of `--seq-len` tokens. AdamW with warm-up and cosine decay over the time budget, fp32 on
CPU. The result is a Hugging Face checkpoint with float16 weights, the tokenizer of `create_model`'s
`demo` preset, and `train_info.json` (steps, tokens, losses, held-out perplexity, versions).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from kvyard.testing.create_model import create_model
from kvyard.testing.tokenizer_build import LLAMA3

HELD_OUT_PERCENT = 10


@dataclass(frozen=True, slots=True)
class TrainSettings:
    minutes: float = 60.0
    seq_len: int = 512
    batch_size: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    max_files: int | None = None  # a smoke run reads fewer files


def stdlib_sources(max_files: int | None = None) -> list[Path]:
    """The standard library's Python files, in a fixed order (tests and site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [
        p
        for p in sorted(root.rglob("*.py"))
        if not {"test", "tests", "site-packages", "idle_test"} & set(p.relative_to(root).parts)
    ]
    return paths[:max_files] if max_files is not None else paths


def held_out(path: Path) -> bool:
    digest = hashlib.sha256(path.name.encode() + str(path.parent.name).encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def definitions(path: Path) -> Iterator[tuple[str, str | None]]:
    """(source, docstring's first line or None) of every top-level function and class of a file."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            source = ast.get_source_segment(text, node)
            if source and len(source) < 6000:
                docstring = ast.get_docstring(node)
                yield source, docstring.strip().splitlines()[0] if docstring and docstring.strip() else None


def documents(tokenizer: PreTrainedTokenizerBase, paths: Sequence[Path]) -> list[list[int]]:
    """Token ids of every document of `paths`: plain sources and, where there is a docstring, chats."""
    text_end = int(tokenizer.convert_tokens_to_ids(LLAMA3.text_end_token))  # type: ignore[arg-type]
    docs: list[list[int]] = []
    for path in paths:
        for source, summary in definitions(path):
            docs.append([*tokenizer.encode(source), text_end])  # encode adds <|begin_of_text|>
            if summary is not None:
                chat = [{"role": "user", "content": summary}, {"role": "assistant", "content": source}]
                rendered: Any = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
                docs.append([int(token) for token in rendered])
    return docs


def packed_rows(docs: list[list[int]], seq_len: int, rng: random.Random) -> torch.Tensor:
    """The documents shuffled and concatenated, cut into rows of `seq_len` tokens (the tail dropped)."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    stream = [token for index in order for token in docs[index]]
    rows = len(stream) // seq_len
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


def learning_rate(settings: TrainSettings, step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to a tenth as the time budget runs out."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    return settings.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, rows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [float(model(input_ids=batch, labels=batch).loss) for batch in rows.split(batch_size)]
    model.train()
    return math.exp(sum(losses) / max(1, len(losses)))


def train(out: Path, settings: TrainSettings) -> dict[str, Any]:
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    with tempfile.TemporaryDirectory() as scratch:
        start_dir = create_model("llama", "demo", Path(scratch) / "init", seed=settings.seed)
        tokenizer = AutoTokenizer.from_pretrained(start_dir)
        model = LlamaForCausalLM.from_pretrained(start_dir, dtype=torch.float32)
        paths = stdlib_sources(settings.max_files)
        train_paths = [p for p in paths if not held_out(p)]
        say(f"tokenizing {len(train_paths)} training and {len(paths) - len(train_paths)} held-out files ...")
        train_rows = packed_rows(documents(tokenizer, train_paths), settings.seq_len, rng)
        held_rows = packed_rows(documents(tokenizer, [p for p in paths if held_out(p)]), settings.seq_len, rng)
        held_rows = held_rows[:64]
        say(
            f"{train_rows.numel():,} training tokens, {held_rows.numel():,} held-out tokens; "
            f"{sum(p.numel() for p in model.parameters()):,} parameters"
        )
        info = _run(model, train_rows, held_rows, settings)
        model.half().save_pretrained(out, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (start_dir / name).is_file():
                (out / name).write_bytes((start_dir / name).read_bytes())
        end_on_both_ends(out, tokenizer)
    info = {
        **info,
        "settings": asdict(settings),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def end_on_both_ends(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """The model ends a chat answer with the end-of-turn token and plain code with the end-of-text token it was
    trained on: make both end generation (config.json and generation_config.json list both)."""
    ends = [int(tokenizer.convert_tokens_to_ids(token)) for token in (LLAMA3.eos_token, LLAMA3.text_end_token)]  # type: ignore[arg-type]
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            config = json.loads(path.read_text())
            config["eos_token_id"] = ends
            path.write_text(json.dumps(config, indent=2) + "\n")


def _run(model: LlamaForCausalLM, rows: torch.Tensor, held: torch.Tensor, settings: TrainSettings) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    budget_s = settings.minutes * 60
    started = time.monotonic()
    step = epoch_row = 0
    losses: list[float] = []
    initial_ppl = perplexity(model, held, settings.batch_size)
    model.train()
    while (elapsed := time.monotonic() - started) < budget_s:
        if epoch_row + settings.batch_size > len(rows):
            epoch_row = 0
        batch = rows[epoch_row : epoch_row + settings.batch_size]
        epoch_row += settings.batch_size
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step, elapsed / budget_s)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % 20 == 0:
            _report(step, losses, settings, time.monotonic() - started)
    recent = losses[-20:]
    return {
        "steps": step,
        "tokens": step * settings.batch_size * settings.seq_len,
        "seconds": round(time.monotonic() - started, 1),
        "final_loss": sum(recent) / max(1, len(recent)),
        "held_out_perplexity_before": initial_ppl,
        "held_out_perplexity": perplexity(model, held, settings.batch_size),
    }


def _report(step: int, losses: list[float], settings: TrainSettings, elapsed: float) -> None:
    tokens = step * settings.batch_size * settings.seq_len
    say(
        f"step {step}: loss {sum(losses[-20:]) / 20:.3f}, {tokens:,} tokens, {tokens / elapsed:,.0f} tokens/s, "
        f"{elapsed / 60:.1f} of {settings.minutes:g} min"
    )


_HELP = {
    "minutes": "training time budget; the learning rate decays over it",
    "seq_len": "tokens per training row",
    "batch_size": "rows per optimizer step",
    "learning_rate": "peak AdamW learning rate",
    "warmup_steps": "steps of linear warm-up",
    "weight_decay": "AdamW weight decay",
    "seed": "seed of the initial weights and the document order",
    "max_files": "read only the first N standard-library files (a smoke run)",
}


def say(message: str) -> None:
    print(f"train_demo: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (Hugging Face format)")
    defaults = TrainSettings()
    for name, value in asdict(defaults).items():
        kind = int if name in ("max_files", "seq_len", "batch_size", "warmup_steps", "seed") else float
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=value,
            help=f"{_HELP[name]} (default: {value if value is not None else 'all'})",
        )
    args = parser.parse_args(argv)
    settings = TrainSettings(**{name: getattr(args, name) for name in asdict(defaults)})
    torch.set_num_threads(max(1, torch.get_num_threads()))
    info = train(args.out, settings)
    say(
        f"done: {info['steps']} steps, {info['tokens']:,} tokens, held-out perplexity "
        f"{info['held_out_perplexity_before']:.1f} -> {info['held_out_perplexity']:.1f}; saved to {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
