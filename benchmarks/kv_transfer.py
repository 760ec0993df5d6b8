"""KV transfer between replicas on loopback, next to the Redis tier moving the same blocks.

A real `kvyard serve` (the embedded default model: `create_model` llama `bench` preset, random weights, fp32,
block size 16) prefills `--prompts` prompts of `--prompt-tokens` tokens each as a prefill replica would
(`kv_transfer_params.do_remote_decode`), so their blocks are pinned under leases. Then, for each prompt:

- pull: this process pulls the whole transfer with kvyard's own pull client (`kvcache.transfer.pull_blocks`:
  HTTP on loopback, frames of the block codec, every block's CRC-32 and key verified), after prefill has
  finished, so the time is the transfer alone;
- redis: the same verified blocks are written to a local redis-server (started here) through `RedisTier`,
  then read back with `RedisTier.get_prefix` and verified with `decode_block`, timed the same way.

Both report GB/s of block bytes (codec header included) and blocks/s; the median over prompts is kept.

    .venv/bin/python benchmarks/kv_transfer.py --out benchmarks/results/kv_transfer.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvyard.testing.create_model import DEFAULT_ARCH, DEFAULT_PRESET, ensure_default_model

if TYPE_CHECKING:
    from kvyard.kvcache.codec import BlockFormat

# The rest is imported where used, not before --help has had its chance: kvyard.models.loader imports torch (1 s),
# the test helpers (redis_utils, server_utils) and kvyard.testing.sim_cluster take 0.4 to 0.5 s, httpx and the
# kvcache modules (numpy, redis) 0.1 to 0.2 s.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

BLOCK_SIZE = 16


def prompt(seed: int, length: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 30000) for _ in range(length)]


def prefill(url: str, tokens: list[int], transfer_id: str) -> None:
    import httpx

    from kvyard.testing.sim_cluster import TEST_ADMIN_KEY

    body = {
        "prompt": tokens,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id},
    }
    response = httpx.post(
        f"{url}/v1/completions", json=body, headers={"x-kvyard-admin-key": TEST_ADMIN_KEY}, timeout=600
    )
    response.raise_for_status()


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from redis_utils import start_redis
    from server_utils import start_server

    from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
    from kvyard.kvcache.codec import decode_block
    from kvyard.kvcache.pd_stream import PullLimits, TransferHandle, pull_blocks
    from kvyard.kvcache.redis_tier import RedisTier
    from kvyard.models.loader import model_digest
    from kvyard.testing.sim_cluster import TEST_ADMIN_KEY

    admin = {"authorization": f"Bearer {TEST_ADMIN_KEY}"}
    model = ensure_default_model(DEFAULT_ARCH, DEFAULT_PRESET)
    server = start_server(model, work, "--kv-tier", "none", "--kv-lease-s", "600", timeout=300)
    redis_server = start_redis(work)
    redis_tier = RedisTier(f"redis://127.0.0.1:{redis_server.port}/0", timeout_s=10.0, batch_blocks=64)
    namespace = KeyNamespace(model.name, model_digest(str(model)), "float32", BLOCK_SIZE)
    root = namespace.root_key()
    fmt = block_format(model)
    rows: list[dict[str, float]] = []
    try:
        for index in range(args.prompts):
            tokens = prompt(index, args.prompt_tokens)
            transfer_id = f"bench-transfer-{index:04d}"
            prefill(server.url, tokens, transfer_id)
            keys = chain_block_keys(root, tokens, BLOCK_SIZE)
            started = time.perf_counter()
            pulled = pull_blocks(
                TransferHandle(server.url, transfer_id), root, keys, 0, fmt, PullLimits(600, 60, admin)
            )
            pull_s = time.perf_counter() - started
            if pulled.failure is not None or len(pulled) != len(keys):
                raise RuntimeError(f"pull failed: {pulled.failure}, {len(pulled)} of {len(keys)} blocks")
            blobs = [bytes(block.blob) for block in pulled]
            started = time.perf_counter()
            redis_tier.put_many(list(zip(keys, blobs)))
            put_s = time.perf_counter() - started
            started = time.perf_counter()
            found = redis_tier.get_prefix(keys, time.monotonic() + 600)
            verified = [decode_block(blob, root, key, fmt) for blob, key in zip(found, keys)]
            get_s = time.perf_counter() - started
            if len(verified) != len(keys):
                raise RuntimeError(f"redis returned {len(found)} of {len(keys)} blocks")
            total = sum(map(len, blobs))
            rows.append(
                {"bytes": total, "blocks": len(keys), "pull_s": pull_s, "redis_put_s": put_s, "redis_get_s": get_s}
            )
            print(
                f"kv_transfer: prompt {index}: {total / 1e6:.1f} MB, pull {total / pull_s / 1e9:.2f} GB/s, "
                f"redis get {total / get_s / 1e9:.2f} GB/s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        redis_tier.close()
        redis_server.kill()
        server.stop()
    return _summary(rows)


def block_format(model: Path) -> BlockFormat:
    """The format of the server's KV blocks: [layers, 2, block size, KV heads, head dim] in float32."""
    from kvyard.kvcache.codec import BlockFormat

    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    shape = (config["num_hidden_layers"], 2, BLOCK_SIZE, config["num_key_value_heads"], head_dim)
    return BlockFormat("float32", shape)


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    def rate(seconds: str) -> float:
        return statistics.median(row["bytes"] / row[seconds] / 1e9 for row in rows)

    def blocks_per_s(seconds: str) -> float:
        return statistics.median(row["blocks"] / row[seconds] for row in rows)

    summary = {
        "pull_gb_per_s": round(rate("pull_s"), 3),
        "redis_get_gb_per_s": round(rate("redis_get_s"), 3),
        "redis_put_gb_per_s": round(rate("redis_put_s"), 3),
        "pull_blocks_per_s": round(blocks_per_s("pull_s")),
        "redis_get_blocks_per_s": round(blocks_per_s("redis_get_s")),
    }
    summary["pull_over_redis_get"] = round(summary["pull_gb_per_s"] / summary["redis_get_gb_per_s"], 2)
    return {"summary": summary, "per_prompt": rows}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--prompts", type=int, default=5, help="prompts transferred")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of each prompt")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        result = measure(args, Path(scratch))
    conditions = {
        "model": f"{DEFAULT_ARCH} {DEFAULT_PRESET} preset (random weights), float32, block size {BLOCK_SIZE}",
        "hardware": f"{platform.machine()}, {os.cpu_count()} cores, CPU only, loopback",
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "pull": "kvyard pull client (http.client) from a kvyard serve prefill replica, blocks verified",
        "redis": "RedisTier (redis-py pipelines of 64 blocks) on a local redis-server, blocks verified",
    }
    report = {"benchmark": "kv_transfer", "conditions": conditions, **result}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
