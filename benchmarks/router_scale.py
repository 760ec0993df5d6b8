"""The router at internet scale, in one process: its cache index and `cache_aware` decisions over many replicas.

    .venv/bin/python benchmarks/router_scale.py [--replicas 8,32,128,512,1000] [--sessions 1000000]
        [--session-blocks 8] [--system-prompts 100] [--system-blocks 4] [--decisions 3000]
        [--repeats 3] [--full-scan-replicas 64] [--out FILE]

For each fleet size, builds the router's own structures (`Replica`, `CacheIndex`, the fleet's key -> holders
index, `CacheAware`) as its KV-sync tasks would: `--sessions` conversations, each a shared system prompt (one of
`--system-prompts`, held by every replica that serves a session using it) plus `--session-blocks` blocks of its
own history, spread over the replicas; every key arrives as a `stored` event line in the replicas' wire format,
parsed and applied by the router's code (`parse_event_line`, `CacheIndex.apply`). Then times `--decisions`
routing decisions (`CacheAware.choose` on the registry's list of healthy replicas, the prompt's block keys
computed as the router does; beyond `--full-scan-replicas` it scores a shortlist found through the key ->
holders index): 80 % continue a cached session with one new block, 20 % start a new session on a known system
prompt. Replicas report random queues.

Reports per fleet size: decision latency p50/p99 (µs; the round with the lowest p50 of `--repeats`), the
index's memory (resident-set growth while it is built), event-ingestion rate (events and keys per second, parse
+ apply, one thread), and the exponent of decision cost against replica count (least squares on log p50). No
HTTP: the proxy's own cost per request is not in these numbers (`router_fleet_live.py` measures that).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from kvyard.api.kv_events import parse_event_line
from kvyard.api.load import LoadReport
from kvyard.kvcache.block_key import KeyNamespace, encode_tokens, key_from_encoded
from kvyard.router.cache_index import CacheIndex
from kvyard.router.config import RouterConfig
from kvyard.router.holders import KeyHolders
from kvyard.router.policies import CacheAware, RouteRequest
from kvyard.router.replica import Replica

BLOCK_SIZE = 16
NAMESPACE = KeyNamespace("scale-model", "digest", "float32", BLOCK_SIZE)


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def chain(parent: bytes, tokens: list[int]) -> list[bytes]:
    keys, encoded = [], encode_tokens(tokens)
    width = BLOCK_SIZE * 4
    for start in range(0, len(encoded) - width + 1, width):
        parent = key_from_encoded(parent, encoded[start : start + width])
        keys.append(parent)
    return keys


class Fleet:
    """Replicas with their indexes filled as the router's KV sync fills them."""

    def __init__(self, num_replicas: int, args: argparse.Namespace, rng: random.Random) -> None:
        self.holders = KeyHolders()
        self.replicas = [
            Replica(
                f"http://10.0.{i // 250}.{i % 250}:8000", index=CacheIndex(holders=self.holders), namespace=NAMESPACE
            )
            for i in range(num_replicas)
        ]
        for replica in self.replicas:
            replica.index.owner = replica
            replica.index.reset([], 0)
            replica.load = LoadReport(
                num_waiting=rng.randrange(4), num_running=rng.randrange(16), prefill_s_per_token=1e-4
            )
        self.root = NAMESPACE.root_key()
        self.system_tokens = [
            [rng.randrange(3, 30000) for _ in range(args.system_blocks * BLOCK_SIZE)]
            for _ in range(args.system_prompts)
        ]
        self.system_keys = [chain(self.root, tokens) for tokens in self.system_tokens]
        self.sessions: list[tuple[int, int, list[int]]] = []  # (replica, system prompt, history tokens): probes
        self.ingest_seconds = 0.0
        self.ingested_events = 0
        self.ingested_keys = 0

    def fill(self, args: argparse.Namespace, rng: random.Random) -> None:
        """Every session's keys, as `stored` events (one per session, as a prefill registers its blocks)."""
        seqs = [0] * len(self.replicas)
        held_system = [set() for _ in self.replicas]  # system prompts a replica already announced
        probes = set(rng.sample(range(args.sessions), min(args.sessions, args.decisions)))
        for session in range(args.sessions):
            at, system = rng.randrange(len(self.replicas)), rng.randrange(args.system_prompts)
            history_keys: list[bytes]
            if session in probes:  # a real token history, so a request can find it
                history = [rng.randrange(3, 30000) for _ in range(args.session_blocks * BLOCK_SIZE)]
                history_keys = chain(self.system_keys[system][-1], history)
                self.sessions.append((at, system, history))
            else:  # only its keys matter to the index: random, of the same size
                history_keys = [rng.randbytes(16) for _ in range(args.session_blocks)]
            keys = history_keys if system in held_system[at] else [*self.system_keys[system], *history_keys]
            held_system[at].add(system)
            seqs[at] += 1
            line = b"data: " + orjson.dumps(
                {"seq": seqs[at], "type": "stored", "medium": "device", "block_keys": [key.hex() for key in keys]}
            )
            started = time.perf_counter()
            event = parse_event_line(line)
            assert event is not None
            self.replicas[at].index.apply(event.seq, event.kind, event.block_keys, event.medium)
            self.ingest_seconds += time.perf_counter() - started
            self.ingested_events += 1
            self.ingested_keys += len(keys)

    def request(self, rng: random.Random) -> RouteRequest:
        if rng.random() < 0.8:
            _, system, history = rng.choice(self.sessions)
            tokens = [*self.system_tokens[system], *history, *(rng.randrange(3, 30000) for _ in range(BLOCK_SIZE))]
        else:
            system = rng.randrange(len(self.system_tokens))
            tokens = [*self.system_tokens[system], *(rng.randrange(3, 30000) for _ in range(4 * BLOCK_SIZE))]
        return RouteRequest("completion", {"model": "scale-model"}, None, tokens, None)


def measure(num_replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(num_replicas)
    gc.collect()
    before = resident_bytes()
    fleet = Fleet(num_replicas, args, rng)
    fleet.fill(args, rng)
    gc.collect()
    index_bytes = resident_bytes() - before
    policy = CacheAware(RouterConfig(full_scan_replicas=args.full_scan_replicas), holders=fleet.holders)
    candidates = [replica for replica in fleet.replicas if replica.routable]  # the registry keeps this list
    rounds = []
    for _ in range(args.repeats):  # this VM's speed varies run to run: the fastest round is reported
        requests = [fleet.request(rng) for _ in range(args.decisions)]
        latencies, found = [], 0
        for request in requests:
            started = time.perf_counter_ns()
            decision = policy.choose(request, candidates)
            latencies.append(time.perf_counter_ns() - started)
            found += decision.predicted_cached_tokens or 0
            decision.replica.index.note_routed(decision.keys or ())
        latencies.sort()
        rounds.append((latencies[len(latencies) // 2], latencies, found))
    _, latencies, found = min(rounds, key=lambda item: item[0])
    total_keys = sum(len(r.index.exact or ()) for r in fleet.replicas)
    result = {
        "replicas": num_replicas,
        "sessions": args.sessions,
        "index_keys": total_keys,
        "index_mb": round(index_bytes / 2**20, 1),
        "index_bytes_per_key": round(index_bytes / max(1, total_keys), 1),
        "ingest_events_per_s": round(fleet.ingested_events / fleet.ingest_seconds),
        "ingest_keys_per_s": round(fleet.ingested_keys / fleet.ingest_seconds),
        "decision_us_p50": round(latencies[len(latencies) // 2] / 1000, 1),
        "decision_us_p99": round(latencies[int(len(latencies) * 0.99)] / 1000, 1),
        "decision_us_mean": round(sum(latencies) / len(latencies) / 1000, 1),
        "mean_predicted_cached_tokens": round(found / args.decisions, 1),
        "decision_us_p50_each_round": [round(item[0] / 1000, 1) for item in rounds],
        "decision_us_p99_each_round": [round(item[1][int(len(item[1]) * 0.99)] / 1000, 1) for item in rounds],
    }
    print(json.dumps(result), file=sys.stderr, flush=True)
    del fleet, policy, rounds
    gc.collect()
    return result


def exponent(rows: list[dict[str, Any]], field: str) -> float | None:
    points = [(math.log(row["replicas"]), math.log(row[field])) for row in rows if row[field] > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    variance = sum((x - mean_x) ** 2 for x, _ in points)
    return round(covariance / variance, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="8,32,128,512,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--sessions", type=int, default=1_000_000, help="cached sessions in the index")
    parser.add_argument("--session-blocks", type=int, default=8, help="history blocks of each session")
    parser.add_argument("--system-prompts", type=int, default=100, help="distinct shared system prompts")
    parser.add_argument("--system-blocks", type=int, default=4, help="blocks of each system prompt")
    parser.add_argument("--decisions", type=int, default=3000, help="routing decisions timed per fleet size")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of decisions; the fastest is reported")
    parser.add_argument(
        "--full-scan-replicas",
        type=int,
        default=RouterConfig().full_scan_replicas,
        help="cache_aware scores every replica up to this many, a shortlist beyond",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "router_scale.json")
    args = parser.parse_args()
    rows = [measure(int(size), args) for size in args.replicas.split(",")]
    report = {
        "benchmark": "router_scale",
        "conditions": {
            "machine": f"{os.cpu_count()} CPUs (shared VM)",
            "python": sys.version.split()[0],
            "block_size": BLOCK_SIZE,
            "sessions": args.sessions,
            "session_blocks": args.session_blocks,
            "system_prompts": args.system_prompts,
            "system_blocks": args.system_blocks,
            "decisions": args.decisions,
            "policy": "cache_aware",
            "http": False,
            "full_scan_replicas": args.full_scan_replicas,
            "repeats": args.repeats,
        },
        "rows": rows,
        "decision_p50_exponent": exponent(rows, "decision_us_p50"),
        "decision_p99_exponent": exponent(rows, "decision_us_p99"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("decision_p50_exponent", "decision_p99_exponent")}))


if __name__ == "__main__":
    main()
