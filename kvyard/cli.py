"""`kvyard` command line: create-model, generate, serve, bench, sim, route."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvyard.kvcache.options import add_kv_tier_arguments, kv_tier_config
from kvyard.router.cli import add_route_command
from kvyard.sim.cli import add_sim_command

ENGINE_OPTIONS = (
    "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory_gb", "max_num_batched_tokens",
    "max_num_seqs", "max_model_len", "enable_prefix_caching",
)  # fmt: skip
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
    "logprobs", "min_tokens",
)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    result: int = args.handler(args)
    return result


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvyard", description="kvyard: an open LLM serving stack")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_create_model(commands)
    _add_generate(commands)
    _add_serve(commands)
    add_sim_command(commands).set_defaults(handler=_run_sim)
    _add_bench(commands)
    add_route_command(commands)
    return parser


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (config.json)")
    group.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help="disable prefix caching"
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in ENGINE_OPTIONS}


def resolve_model_dir(model: str | None) -> str:
    """The given model directory, or the embedded default model (created on first use)."""
    if model:
        return model
    from kvyard.models.create import ensure_default_model

    print("no model given: using the embedded default model (created on first use)", file=sys.stderr)
    return str(ensure_default_model())


# ---------------------------------------------------------------------------- create-model


def _add_create_model(commands: Any) -> None:
    from kvyard.models.create import ARCHITECTURES, DTYPES, PRESETS

    parser = commands.add_parser("create-model", help="write a random-weight model + local tokenizer (HF format)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.set_defaults(handler=_create_model)


def _create_model(args: argparse.Namespace) -> int:
    from kvyard.models.create import create_model

    print(create_model(args.arch, args.preset, args.out, seed=args.seed, dtype=args.dtype))
    return 0


# ---------------------------------------------------------------------------- generate


def _add_generate(commands: Any) -> None:
    parser = commands.add_parser("generate", help="offline batch generation from a JSONL file")
    parser.add_argument("model", nargs="?", default=None, help="HF model directory (default: embedded model)")
    parser.add_argument("--input", type=Path, help="JSONL: one object per line with 'prompt' (text), "
                        "'prompt_token_ids' or 'messages', plus optional sampling fields")  # fmt: skip
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--output", type=Path, default=None, help="JSONL results (default: stdout)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    _add_engine_arguments(parser)
    add_kv_tier_arguments(parser, default_on=False)
    parser.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from kvyard import LLM, SamplingParams

    records = _read_records(args)
    if not records:
        print("error: no prompts: give --input FILE or --prompt TEXT", file=sys.stderr)
        return 2
    try:
        kv_tier = kv_tier_config(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    llm = LLM(resolve_model_dir(args.model), kv_tier=kv_tier, **engine_options(args))
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    prompts = [_record_prompt(llm, record, index) for index, record in enumerate(records)]
    params = [
        SamplingParams(**{**defaults, **{k: v for k, v in record.items() if k in SAMPLING_FIELDS}})
        for record in records
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    llm.close()
    _write_results(args.output, records, outputs)
    num_generated = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {num_generated} tokens in {elapsed:.2f}s "
          f"({num_generated / elapsed:.1f} output tok/s)", file=sys.stderr)  # fmt: skip
    return 0


def _read_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{"prompt": text} for text in args.prompt]
    if args.input is not None:
        for number, line in enumerate(args.input.read_text().splitlines(), start=1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"{args.input}:{number}: each line must be a JSON object")
                records.append(record)
    return records


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


# ---------------------------------------------------------------------------- serve


def _add_serve(commands: Any) -> None:
    parser = commands.add_parser("serve", help="OpenAI-compatible HTTP server for one replica")
    parser.add_argument("model", nargs="?", default=None, help="HF model directory (default: embedded model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: directory name)")
    parser.add_argument("--max-queued-requests", type=int, default=512,
                        help="requests accepted beyond --max-num-seqs before answering 429")  # fmt: skip
    parser.add_argument("--cache-salt-per-api-key", action="store_true",
                        help="isolate prefix caches by the request's bearer token")  # fmt: skip
    parser.add_argument("--log-level", default="info")
    _add_engine_arguments(parser)
    add_kv_tier_arguments(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from kvyard.engine.llm_engine import EngineConfig
    from kvyard.server.app import ServerOptions
    from kvyard.server.model_server import ModelServerConfig, serve_model

    try:
        kv_tier = kv_tier_config(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    engine = EngineConfig(
        model=resolve_model_dir(args.model),
        served_model_name=args.served_model_name,
        record_kv_events=True,
        kv_tier=kv_tier,
        **engine_options(args),
    )
    options = ServerOptions(args.max_queued_requests, args.cache_salt_per_api_key)
    return serve_model(ModelServerConfig(engine, options), args.host, args.port)


def _run_sim(args: argparse.Namespace) -> int:
    import logging

    from kvyard.server.serve import serve_replicas
    from kvyard.sim.cli import sim_config
    from kvyard.testing.sim_cluster import sim_replica_specs, sim_server_options

    logging.basicConfig(level=args.log_level.upper())
    try:
        config = sim_config(args)
        options = sim_server_options(args.max_queued_requests)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("error: --replicas must be at least 1", file=sys.stderr)
        return 2
    return serve_replicas(lambda: sim_replica_specs([config] * args.replicas), options, args.host, args.port,
                          args.ports_file)  # fmt: skip


# ---------------------------------------------------------------------------- bench


def _add_bench(commands: Any) -> None:
    from kvyard.bench.cli import add_parser

    add_parser(commands)


if __name__ == "__main__":
    raise SystemExit(main())
