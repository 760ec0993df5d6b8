"""`kvyard sim`: N simulated replicas in one process, on ports P..P+N-1.

Each is the engine's own core with a cost model in place of the model, served over the same replica API
as `kvyard serve` (KV events included), for routing experiments at a scale one machine cannot run models.
With `--prefill-replicas K` the first K replicas are prefill replicas and the rest decode replicas: with an admin
key (`--admin-key` or $KVYARD_ADMIN_KEY, which every replica shares) they move a request's blocks over HTTP as
real replicas do, each pull charged the modeled transfer time (--kv-bytes-per-token, --transfer-gb-per-s,
--transfer-latency-s). With --host-tier-blocks each replica keeps blocks in a host-memory tier below its device cache,
and with --shared-store-blocks all replicas of the process share one store, as `kvyard serve --kv-tier` does with
memory and Redis; each load is charged its modeled time (see kvyard/sim/tier.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from kvyard.api.auth import admin_key_of
from kvyard.cli import fail
from kvyard.cli.options import add_config_options, add_log_level_option, config_from_args, configure_logging
from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.server.options import ServerOptions
from kvyard.sim.config import SimConfig
from kvyard.sim.roofline import ROOFLINE_PRESETS, roofline_preset

DESCRIPTION = "Serve N simulated replicas on ports P..P+N-1 from one process."
SIM_SERVER_DEFAULTS = {"max_queued_seqs": 1024, "shutdown_grace_s": 5.0}


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "sim", help="simulated replicas: the replica API and KV events, with a cost model", description=DESCRIPTION
    )
    add_sim_arguments(parser)
    parser.set_defaults(handler=run)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8100, help="first port; 0: a free port per replica (default: 8100)")
    parser.add_argument("--replicas", type=int, default=1, help="simulated replicas (default: 1)")
    parser.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        metavar="K",
        help="prefill/decode disaggregation: the first K replicas report role prefill, the others "
        "decode (overrides --role); 0: every replica has --role (default: 0)",
    )
    parser.add_argument("--ports-file", type=Path, default=None, help="write {'ports': [...], 'urls': [...]} here")
    parser.add_argument(
        "--namespace-from",
        type=Path,
        default=None,
        metavar="MODEL_DIR",
        help="take model name, digest and dtype from a kvyard model directory, so block keys "
        "equal those of `kvyard serve MODEL_DIR`",
    )
    parser.add_argument(
        "--calibrate",
        type=Path,
        default=None,
        metavar="PATH",
        help="fit the cost model to a benchmarks/offline_throughput.py result JSON",
    )
    parser.add_argument("--calibrate-engine", default="kvyard", help="which engine of that JSON to fit")
    parser.add_argument(
        "--cost-preset",
        default=None,
        choices=[p.name for p in ROOFLINE_PRESETS],
        help="a roofline cost model of a GPU and model this machine lacks (kvyard/sim/roofline.py: "
        "h100 from public specifications, h200 fitted to steps timed on an H200; neither a serving "
        "engine measured); it also sets the KV bytes per token and transfer bandwidth unless "
        "given",
    )
    add_log_level_option(parser)
    add_config_options(
        parser,
        SimConfig,
        defaults={
            "model_name": None,
            "dtype": None,
            "max_num_batched_tokens": None,
            "kv_bytes_per_token": None,
            "transfer_gb_per_s": None,
        },
        shown_defaults={
            "model_name": "kvyard-sim, or the --namespace-from directory's name",
            "dtype": "float32, or the --namespace-from model's",
            "max_num_batched_tokens": "the --calibrate engine's, else 2048",
            "kv_bytes_per_token": "the --cost-preset model's, else 16384",
            "transfer_gb_per_s": "the --cost-preset's, else 1.25",
        },
    )
    add_config_options(parser, ServerOptions, defaults=SIM_SERVER_DEFAULTS, exclude={"cache_salt_per_api_key"})


def sim_config(args: argparse.Namespace) -> SimConfig:
    """The replicas' config from the parsed options (a ValueError names a bad one)."""
    from kvyard.sim.calibration import calibrate_from_json

    fixed: dict[str, Any] = {}
    budget = args.max_num_batched_tokens
    if args.calibrate is not None and args.cost_preset is not None:
        raise ValueError("--calibrate and --cost-preset both choose the cost model: give one")
    default = SimConfig()
    fixed.update(kv_bytes_per_token=default.kv_bytes_per_token, transfer_gb_per_s=default.transfer_gb_per_s)
    if args.cost_preset is not None:
        preset = roofline_preset(args.cost_preset)
        fixed.update(
            cost=preset.cost,
            kv_bytes_per_token=preset.model.kv_bytes_per_token,
            transfer_gb_per_s=preset.transfer_gb_per_s,
        )
    fixed.update(
        {
            name: getattr(args, name)
            for name in ("kv_bytes_per_token", "transfer_gb_per_s")
            if getattr(args, name) is not None
        }
    )
    if args.calibrate is not None:
        calibration = calibrate_from_json(args.calibrate, args.calibrate_engine)
        fixed["cost"] = calibration.cost
        budget = budget or calibration.max_num_batched_tokens
        print(f"calibrated from {args.calibrate}: {calibration.cost}", file=sys.stderr)
    scheduler = SchedulerConfig(
        budget or SchedulerConfig().max_num_batched_tokens,
        args.max_num_seqs,
        args.prefill_only_step_tokens,
        args.prefill_order,
        args.scheduling_policy,
    )
    config = config_from_args(
        SimConfig,
        args,
        scheduler=scheduler,
        model_name=args.model_name or "kvyard-sim",
        dtype=args.dtype or "float32",
        **fixed,
    )
    return _with_namespace_of(config, args) if args.namespace_from is not None else config


def _with_namespace_of(config: SimConfig, args: argparse.Namespace) -> SimConfig:
    from kvyard.models.config import load_model_config
    from kvyard.models.loader import model_digest, resolve_dtype

    engine_dtype = resolve_dtype(args.dtype or "auto", load_model_config(args.namespace_from))
    return dataclasses.replace(
        config,
        model_name=args.model_name or args.namespace_from.name,
        model_digest=model_digest(args.namespace_from),
        dtype=str(engine_dtype).removeprefix("torch."),
    )


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if args.replicas < 1:
        return fail("--replicas must be at least 1")
    from kvyard.testing.sim_cluster import pd_roles, sim_replica_specs

    try:
        config = sim_config(args)
        options = config_from_args(ServerOptions, args, owned_by="kvyard-sim")
        roles = pd_roles(args.replicas, args.prefill_replicas) if args.prefill_replicas else []
    except (ValueError, TypeError, OSError) as error:
        return fail(str(error))
    if roles and admin_key_of(options.access.admin_key) is None:
        print(
            "kvyard sim: warning: without an admin key (--admin-key or $KVYARD_ADMIN_KEY) replicas move no KV: "
            "every decode replica computes its prompts itself",
            file=sys.stderr,
        )
    from kvyard.server.serve import serve_replicas

    return serve_replicas(
        lambda: sim_replica_specs([config] * args.replicas, options, roles),
        options,
        args.host,
        args.port,
        args.ports_file,
    )
