"""`kvyard sim` (also `python -m kvyard.sim`, which starts faster): arguments and entry point.

The server modules are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DESCRIPTION = "Serve N simulated replicas on ports P..P+N-1 from one process."


def add_sim_command(commands: Any) -> None:
    parser = commands.add_parser(
        "sim", help="simulated replicas: the replica API and KV events, with a cost model", description=DESCRIPTION
    )
    add_sim_arguments(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvyard.sim", description=DESCRIPTION)
    add_sim_arguments(parser)
    args = parser.parse_args(argv)
    return run_sim(args)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="first port (0: a free port per replica)")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--ports-file", type=Path, default=None, help="write {'ports': [...], 'urls': [...]} here")
    group = parser.add_argument_group("identity (block-key namespace)")
    group.add_argument("--model-name", default=None, help="served model id (default kvyard-sim)")
    group.add_argument("--model-digest", default="sim")
    group.add_argument("--namespace-from", type=Path, default=None, metavar="MODEL_DIR",
                       help="take model name and digest from a kvyard model directory, so block keys equal "
                       "those of `kvyard serve MODEL_DIR`")  # fmt: skip
    group.add_argument("--dtype", default="float32")
    group.add_argument("--block-size", type=int, default=16)
    group = parser.add_argument_group("capacity and scheduling")
    group.add_argument("--capacity-blocks", type=int, default=4096, help="prefix-cache capacity of each replica")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step "
                       "(default: the calibrated engine's, else 2048)")  # fmt: skip
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-model-len", type=int, default=131072)
    group.add_argument("--vocab-size", type=int, default=32000)
    group.add_argument("--max-queued-requests", type=int, default=1024)
    group = parser.add_argument_group("cost model")
    group.add_argument("--calibrate", type=Path, default=None, metavar="PATH",
                       help="fit the cost model to a benchmarks/offline_throughput.py result JSON")  # fmt: skip
    group.add_argument("--calibrate-engine", default="kvyard", help="which engine of that JSON to fit")
    group.add_argument("--time-scale", type=float, default=1.0,
                       help="wall seconds per simulated second (0.1: ten times faster than the engine)")  # fmt: skip
    group.add_argument("--stream-interval-ms", type=float, default=2.0, help="least time between two chunks of a "
                       "stream after its first token (longer: fewer writes, less CPU)")  # fmt: skip
    group.add_argument("--tick-ms", type=float, default=2.0, help="timing resolution: steps ending less than this "
                       "ahead run without sleeping (longer: fewer wake-ups, less CPU)")  # fmt: skip
    parser.add_argument("--log-level", default="warning")
    parser.set_defaults(handler=run_sim)


def run_sim(args: argparse.Namespace) -> int:
    import logging

    from kvyard.sim.serve import serve_forever

    logging.basicConfig(level=args.log_level.upper())
    try:
        config = sim_config(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("error: --replicas must be at least 1", file=sys.stderr)
        return 2
    return serve_forever([config] * args.replicas, args.host, args.port, args.ports_file)


def sim_config(args: argparse.Namespace) -> Any:
    from kvyard.sim.calibration import calibrate_from_json
    from kvyard.sim.cost_model import CostModel
    from kvyard.sim.replica import SimConfig

    cost, budget = CostModel(), 2048
    if args.calibrate is not None:
        calibration = calibrate_from_json(args.calibrate, args.calibrate_engine)
        cost, budget = calibration.cost, calibration.max_num_batched_tokens
        print(f"calibrated from {args.calibrate}: {cost}", file=sys.stderr)
    model_name, digest = args.model_name, args.model_digest
    if args.namespace_from is not None:
        from kvyard.models.loader import model_digest

        digest = model_digest(args.namespace_from)
        model_name = model_name or args.namespace_from.name
    return SimConfig(
        model_name=model_name or "kvyard-sim",
        model_digest=digest,
        dtype=args.dtype,
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens or budget,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        vocab_size=args.vocab_size,
        max_queued_requests=args.max_queued_requests,
        time_scale=args.time_scale,
        stream_interval_s=args.stream_interval_ms / 1000,
        tick_s=args.tick_ms / 1000,
        cost=cost,
    )
