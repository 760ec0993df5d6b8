"""What a replica is, asked of the replica itself, and the load of replicas that are other engines' servers.

kvyard's servers (and its simulator) answer `GET /load`; a vLLM server says `owned_by: vllm` in `/v1/models`, an
SGLang server `owned_by: sglang`; both answer `/version` and publish Prometheus metrics, from which their load
(running and waiting requests, KV-cache usage) and their KV-cache shape (block size, blocks, dtype) are read.
Anything else is an OpenAI-compatible server the router knows only by its health and its own counts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

KVYARD = "kvyard"
VLLM = "vllm"
SGLANG = "sglang"
OPENAI = "openai"
ENGINE_KINDS = frozenset({VLLM, SGLANG})  # other engines whose KV events and metrics the router reads

# The metric names each engine's load is read from: running, waiting, KV-cache usage (a fraction).
_LOAD_METRICS = {
    VLLM: ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    SGLANG: ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
}
_CACHE_INFO = {VLLM: "vllm:cache_config_info", SGLANG: "sglang:cache_config_info"}
# What kvyard's KV connector inside vLLM adds (kvyard.integrations.vllm_metrics): the shared store it loads from, and
# its load seconds and blocks by tier medium.
_STORE_INFO = "vllm:kvyard_shared_store_info"
_LOAD_SECONDS = "vllm:kvyard_tier_load_seconds_total"
_LOADED_BLOCKS = "vllm:kvyard_tier_loaded_blocks_total"
# A sample line of Prometheus' text format: name, optional {labels}, value (and an optional timestamp, ignored).
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def kind_from_owner(owned_by: str | None) -> str | None:
    """The engine a `/v1/models` card's `owned_by` names, if it names one the router knows."""
    owner = (owned_by or "").lower()
    return owner if owner in (VLLM, SGLANG, KVYARD) else None


def kind_from_metrics(text: str) -> str:
    """vLLM or SGLang by the prefix of its metrics; OPENAI when neither's are there."""
    if "\nvllm:" in text or text.startswith("vllm:"):
        return VLLM
    if "\nsglang:" in text or text.startswith("sglang:"):
        return SGLANG
    return OPENAI


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one scrape of an engine's `/metrics` says (summed over its data-parallel engines)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    cache_dtype: str | None = None
    started_at: float | None = None  # process_start_time_seconds: changes when the server restarts
    has_load: bool = False  # the load gauges were there (vLLM drops them with --disable-log-stats)
    shared_store: str | None = None  # kvyard's connector: the shared store's id, and its blocks' expiry
    shared_ttl_s: float | None = None
    tier_loads: tuple[tuple[str, float, float], ...] = ()  # kvyard's connector: (medium, seconds, blocks) so far

    @classmethod
    def parse(cls, kind: str, text: str) -> EngineMetrics:
        """Only the lines of the few metrics the router reads are parsed (an engine publishes hundreds)."""
        running_name, waiting_name, usage_name = _LOAD_METRICS[kind]
        info_name = _CACHE_INFO[kind]
        wanted = (running_name, waiting_name, usage_name, info_name, "process_start_time_seconds", "vllm:kvyard_")
        running = waiting = 0.0
        has_load = False
        usages: list[float] = []
        info: dict[str, str] = {}
        started_at = None
        store: dict[str, str] = {}
        loads: dict[str, list[float]] = {}
        for name, labels, value in _samples(text, wanted):
            if name == running_name:
                running += value
                has_load = True
            elif name == waiting_name:
                waiting += value
            elif name == usage_name:
                usages.append(value)
            elif name == info_name:
                info = labels
            elif name == "process_start_time_seconds":
                started_at = value
            elif name == _STORE_INFO and value > 0:
                store = labels
            elif name in (_LOAD_SECONDS, _LOADED_BLOCKS) and "medium" in labels:
                totals = loads.setdefault(labels["medium"], [0.0, 0.0])
                totals[name == _LOADED_BLOCKS] += value
        return cls(
            int(running),
            int(waiting),
            sum(usages) / len(usages) if usages else 0.0,
            _int_label(info, "block_size"),
            _int_label(info, "num_gpu_blocks"),
            info.get("cache_dtype"),
            started_at,
            has_load,
            store.get("store") or None,
            _float_label(store, "ttl_s"),
            tuple((medium, seconds, blocks) for medium, (seconds, blocks) in sorted(loads.items())),
        )


def _samples(text: str, wanted: tuple[str, ...]) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each finite sample whose name starts with one of `wanted`. Read here rather than by
    prometheus_client's parser, which took 0.3 ms a scrape on vLLM's cache_config_info line alone."""
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        sample = _SAMPLE.match(line)
        if sample is None:
            continue
        name, labels, value = sample.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isfinite(number):
            yield name, {key: _unescape(raw) for key, raw in _LABEL.findall(labels or "")}, number


def _unescape(raw: str) -> str:
    return (
        _ESCAPE.sub(lambda escaped: "\n" if escaped.group(1) == "n" else escaped.group(1), raw) if "\\" in raw else raw
    )


def _float_label(labels: dict[str, str], name: str) -> float | None:
    try:
        value = float(labels.get(name, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _int_label(labels: dict[str, str], name: str) -> int | None:
    value = labels.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else None
