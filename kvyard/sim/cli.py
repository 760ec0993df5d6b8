"""`kvyard sim` (also `python -m kvyard.sim`, which starts faster): arguments and entry point.

The server modules are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvyard.sim.config import SimConfig

DESCRIPTION = "Serve N simulated replicas on ports P..P+N-1 from one process."


def add_sim_command(commands: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        "sim", help="simulated replicas: the replica API and KV events, with a cost model", description=DESCRIPTION
    )
    add_sim_arguments(parser)
    return parser


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="first port (0: a free port per replica)")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--ports-file", type=Path, default=None, help="write {'ports': [...], 'urls': [...]} here")
    group = parser.add_argument_group("identity (block-key namespace)")
    group.add_argument("--model-name", default=None, help="served model id (default kvyard-sim)")
    group.add_argument("--model-digest", default="sim")
    group.add_argument("--namespace-from", type=Path, default=None, metavar="MODEL_DIR",
                       help="take model name, digest and dtype from a kvyard model directory, so block keys "
                       "equal those of `kvyard serve MODEL_DIR`")  # fmt: skip
    group.add_argument("--dtype", default=None, help="KV dtype in the namespace (default float32)")
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


def sim_config(args: argparse.Namespace) -> SimConfig:
    from kvyard.sim.calibration import calibrate_from_json
    from kvyard.sim.config import SimConfig
    from kvyard.sim.cost_model import CostModel

    cost, budget = CostModel(), 2048
    if args.calibrate is not None:
        calibration = calibrate_from_json(args.calibrate, args.calibrate_engine)
        cost, budget = calibration.cost, calibration.max_num_batched_tokens
        print(f"calibrated from {args.calibrate}: {cost}", file=sys.stderr)
    model_name, digest, dtype = args.model_name, args.model_digest, args.dtype
    if args.namespace_from is not None:
        from kvyard.models.config import load_model_config
        from kvyard.models.loader import model_digest, resolve_dtype

        digest = model_digest(args.namespace_from)
        model_name = model_name or args.namespace_from.name
        engine_dtype = resolve_dtype(dtype or "auto", load_model_config(args.namespace_from))
        dtype = str(engine_dtype).removeprefix("torch.")
    return SimConfig(
        model_name=model_name or "kvyard-sim",
        model_digest=digest,
        dtype=dtype or "float32",
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens or budget,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        vocab_size=args.vocab_size,
        time_scale=args.time_scale,
        stream_interval_s=args.stream_interval_ms / 1000,
        tick_s=args.tick_ms / 1000,
        cost=cost,
    )
