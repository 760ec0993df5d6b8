"""What the server under test offers: its models, kvyard's extra endpoints, and the request fields it accepts.

Anything missing is recorded by name, so a result against a plain OpenAI-compatible server says which
numbers it could not have (no `/metrics` snapshot, no cached-token counts, outputs not forced to length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvyard.api import metrics
from kvyard.net.http_client import HttpClient, HttpError

# Counters whose before/after difference a result reports as "what the server counted".
# kvyard first; vLLM and SGLang names so the same comparison works against them.
SERVER_COUNTERS = {
    "requests": (f"{metrics.REQUESTS}_total", "vllm:request_success_total", "sglang:num_requests_total"),
    "prompt_tokens": (f"{metrics.PROMPT_TOKENS}_total", "vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
    "generation_tokens": (
        f"{metrics.GENERATION_TOKENS}_total",
        "vllm:generation_tokens_total",
        "sglang:generation_tokens_total",
    ),
    "cached_prompt_tokens": (
        f"{metrics.CACHED_PROMPT_TOKENS}_total",
        "vllm:prefix_cache_hits_total",
        "sglang:cached_tokens_total",
    ),
    "spec_proposed_tokens": (f"{metrics.SPEC_PROPOSED}_total", "vllm:spec_decode_num_draft_tokens_total"),
    "spec_accepted_tokens": (f"{metrics.SPEC_ACCEPTED}_total", "vllm:spec_decode_num_accepted_tokens_total"),
    "spec_verifications": (f"{metrics.SPEC_VERIFICATIONS}_total", "vllm:spec_decode_num_drafts_total"),
}
# kvyard's count of requests it turned away, whatever else labels it (model_name, or nothing on older replicas).
NOT_SERVED = (f"{metrics.REQUESTS}_total", f"outcome={metrics.REJECTED_OVERLOAD}")


@dataclass(slots=True)
class ServerInfo:
    models: dict[str, Any] | None = None
    model: str | None = None  # the id requests name
    max_model_len: int | None = None
    load: dict[str, Any] | None = None
    ignore_eos: bool = True
    missing: list[str] = field(default_factory=list)  # endpoints and features the server lacks

    def to_json(self) -> dict[str, Any]:
        return {
            "models": self.models,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "load_before": self.load,
            "ignore_eos": self.ignore_eos,
            "missing": self.missing,
        }


async def probe_server(http: HttpClient, model: str | None) -> ServerInfo:
    info = ServerInfo(model=model)
    info.models = await get_json(http, "/v1/models")
    cards = (info.models or {}).get("data") or []
    if info.models is None or not cards:
        info.missing.append("/v1/models")
    else:
        card = next((c for c in cards if c.get("id") == model), cards[0])
        info.model = model or card.get("id")
        info.max_model_len = card.get("max_model_len") or card.get("max_context_length")
    info.load = await get_json(http, "/load")
    if info.load is None:
        info.missing.append("/load")
    if await metrics_snapshot(http) is None:
        info.missing.append("/metrics")
    await _probe_completion(http, info)
    return info


async def _probe_completion(http: HttpClient, info: ServerInfo) -> None:
    """One two-token request: does the server take `ignore_eos`, and does its stream end with usage?"""
    body: dict[str, Any] = {
        "prompt": [1, 2, 3, 4],
        "max_tokens": 2,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if info.model is not None:
        body["model"] = info.model
    status, text = await _post(http, "/v1/completions", body)
    if status == 400 and "ignore_eos" in text:
        info.ignore_eos = False
        info.missing.append("ignore_eos")
        body.pop("ignore_eos")
        status, text = await _post(http, "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"probe request to {http.base_url}/v1/completions failed with HTTP {status}: {text[:500]}")
    usage = _last_usage(text)
    if usage is None:
        info.missing.append("usage")
    elif (usage.get("prompt_tokens_details") or {}).get("cached_tokens") is None:
        info.missing.append("cached_tokens")


def _last_usage(sse_text: str) -> dict[str, Any] | None:
    usage = None
    for line in sse_text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            usage = json.loads(line[5:]).get("usage") or usage
    return usage


async def metrics_snapshot(http: HttpClient) -> dict[str, float] | None:
    """Every Prometheus sample as `name{label=value,…}` -> value; None when there is no /metrics."""
    try:
        response = await http.get("/metrics")
        if response.status != 200:
            return None
        return {
            _sample_key(sample.name, sample.labels): sample.value
            for family in text_string_to_metric_families(response.body.decode(errors="replace"))
            for sample in family.samples
            if not sample.name.endswith("_created")
        }
    except (HttpError, TimeoutError, ValueError):
        return None


def counted_by_server(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """Differences of the known counters, summed over their labels (every model a server names in `model_name`),
    excluding requests the server turned away."""
    if before is None or after is None:
        return {}
    counted = {}
    for quantity, names in SERVER_COUNTERS.items():
        for name in names:
            keys = [k for k in after if k == name or k.startswith(name + "{")]
            if keys:
                keys = [k for k in keys if not _not_served(k)]
                counted[quantity] = sum(after[k] - before.get(k, 0.0) for k in keys)
                break
    return counted


def _not_served(key: str) -> bool:
    name, _, labels = key.partition("{")
    return name == NOT_SERVED[0] and NOT_SERVED[1] in labels.removesuffix("}").split(",")


def _sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


async def get_json(http: HttpClient, path: str) -> dict[str, Any] | None:
    try:
        response = await http.get(path)
        if response.status != 200:
            return None
        data = json.loads(response.body)
        return data if isinstance(data, dict) else None
    except (HttpError, TimeoutError, ValueError):
        return None


async def _post(http: HttpClient, path: str, body: dict[str, Any]) -> tuple[int, str]:
    response = await http.request("POST", path, json.dumps(body).encode(), timeout=120.0)
    return response.status, response.body.decode(errors="replace")
