"""`kvyard generate`: offline batch generation from a JSONL file or prompts on the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvyard.cli import fail
from kvyard.cli.models import add_engine_options, add_model_argument, engine_config_from_args
from kvyard.cli.options import add_config_options, config_from_args
from kvyard.engine.sampling.params import SamplingParams

SAMPLING_FIELDS = frozenset(item.name for item in dataclasses.fields(SamplingParams))


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "generate",
        help="offline batch generation from a JSONL file or --prompt texts",
        description="Generate for every prompt with continuous batching; results as JSONL, in input order.",
    )
    add_model_argument(parser)
    parser.add_argument(
        "--input",
        type=Path,
        help="JSONL: one object per line with 'prompt' (text), "
        "'prompt_token_ids' or 'messages', plus optional sampling fields and an 'id'",
    )
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--output", type=Path, default=None, help="JSONL results (default: stdout)")
    add_config_options(
        parser,
        SamplingParams,
        title="sampling (a JSONL record's own fields override these)",
        defaults={"max_tokens": 64, "temperature": 0.0},
    )
    add_engine_options(parser, defaults={"tiers": ("none",)}, exclude={"served_model_name"})
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        records = _read_records(args)
        defaults = config_from_args(SamplingParams, args)
        params = [_record_params(defaults, record, index) for index, record in enumerate(records)]
        config = engine_config_from_args(args)
    except (OSError, ValueError, TypeError) as error:
        return fail(str(error))
    if not records:
        return fail("no prompts: give --input FILE or --prompt TEXT")
    from kvyard.engine.llm import LLM

    try:
        llm = LLM.from_config(config)
    except (OSError, ValueError) as error:  # no config.json, unsupported model, missing weights
        return fail(f"cannot load the model {config.model}: {error}")
    with llm:
        try:
            prompts = [_record_prompt(llm, record, index) for index, record in enumerate(records)]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=True)
        except (ValueError, TypeError) as error:
            return fail(str(error))
    elapsed = time.perf_counter() - start
    _write_results(args.output, records, outputs)
    num_generated = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {num_generated} tokens in {elapsed:.2f}s "
        f"({num_generated / elapsed:.1f} output tok/s)",
        file=sys.stderr,
    )
    return 0


def _read_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{"prompt": text} for text in args.prompt]
    if args.input is not None:
        for number, line in enumerate(args.input.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{args.input}:{number}: not JSON: {error}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{args.input}:{number}: each line must be a JSON object")
            records.append(record)
    return records


def _record_params(defaults: SamplingParams, record: dict[str, Any], index: int) -> SamplingParams:
    own = {name: value for name, value in record.items() if name in SAMPLING_FIELDS}
    try:
        return dataclasses.replace(defaults, **own)
    except (ValueError, TypeError) as error:
        raise ValueError(f"record {index}: {error}") from None


def _record_prompt(llm: Any, record: dict[str, Any], index: int) -> str | list[int]:
    if "prompt_token_ids" in record:
        return list(record["prompt_token_ids"])
    if "messages" in record:
        if llm.tokenizer is None:
            raise ValueError(f"record {index}: 'messages' needs a tokenizer with a chat template")
        text: str = llm.tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
        return text
    if "prompt" in record:
        return str(record["prompt"])
    raise ValueError(f"record {index}: needs 'prompt', 'prompt_token_ids' or 'messages'")


def _write_results(path: Path | None, records: list[dict[str, Any]], outputs: list[Any]) -> None:
    lines = []
    for index, (record, output) in enumerate(zip(records, outputs)):
        result = {
            "index": index,
            "text": output.text,
            "token_ids": output.token_ids,
            "num_prompt_tokens": len(output.prompt_token_ids),
            "num_cached_tokens": output.num_cached_tokens,
            "finish_reason": output.finish_reason,
        }
        if "id" in record:
            result["id"] = record["id"]
        lines.append(json.dumps(result))
    text = "\n".join(lines) + "\n"
    if path is None:
        sys.stdout.write(text)
    else:
        path.write_text(text)
