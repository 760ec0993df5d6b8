"""Settings of an engine on a real model (torch-free, so the command line can show them without loading torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvyard.engine.blend.settings import NON_PREFIX_REUSE, SELECTIONS, fraction
from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.engine.speculative.policy import SpeculativeConfig
from kvyard.kvcache.config import KVTierConfig, KVTransferConfig
from kvyard.models import ATTENTION_BACKENDS, KV_CACHE_DTYPES, MATMUL_DTYPES, QUANTIZATION_SCHEMES
from kvyard.settings import from_flat, setting


def positive_gb(text: str) -> float:
    """A positive number of GB, read from an option's text."""
    value = float(text)
    if not 0 < value < math.inf:
        raise ValueError(f"must be a positive number of GB, not {text}")
    return value


@dataclass(slots=True)
class EngineConfig:
    """Engine: the model, its KV cache and its kernels."""

    model: str
    dtype: str = setting(
        "auto", help="dtype of weights and KV cache: float32, bfloat16, float16, or auto (the model's config.json)"
    )
    device: str | None = setting(None, help="cpu or cuda (none: cuda when available)")
    block_size: int = setting(16, help="tokens per KV block: the unit of caching, eviction and block keys")
    num_kv_blocks: int | None = setting(
        None,
        help="KV blocks in the pool (none: as many as --kv-cache-memory-gb "
        "holds, at most enough for --max-num-seqs full contexts)",
    )
    kv_cache_memory_gb: float = setting(2.0, help="memory for the KV pool when --num-kv-blocks is not given")
    max_model_len: int | None = setting(None, help="cap on the context length (none: the model's)")
    enable_prefix_caching: bool = setting(True, flag="--prefix-caching", help="reuse the KV of repeated prefixes")
    attention_backend: str = setting(
        "auto",
        choices=ATTENTION_BACKENDS,
        help="attention kernels: native (the CPU fp32 kernels), torch (PyTorch SDPA), or auto (native where it runs)",
    )
    quantization: str = setting(
        "none",
        choices=QUANTIZATION_SCHEMES,
        help="weights as loaded: none (as stored), "
        "int8 (each linear layer's weight int8 with a scale per 32 weights), fp16 or bf16 "
        "(each linear layer's weight in 16 bits); converted at load time, activations "
        "fp32, KV computed with them cached apart",
    )
    matmul_dtype: str = setting(
        "float32",
        choices=MATMUL_DTYPES,
        help="what fp32, int8 and bf16 weights "
        "(fp16 ones stay float32) multiply many rows in (prefill, large batches) on CPU: "
        "float32 (exact: output equals the fp32 model given the weights), bfloat16 "
        "(activations and products rounded to bf16: 3-5x faster matmuls on CPUs with AMX or "
        "AVX512-BF16, a small loss of accuracy; fp32 weights get a bf16 copy), or auto "
        "(bfloat16 where the CPU has those); KV computed in bf16 is cached apart",
    )
    kv_cache_dtype: str = setting(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="how the KV cache stores keys and values: "
        "auto (the model's dtype), fp32, fp16, bf16, or int8 (a scale per token and KV "
        "head); smaller formats hold more tokens in --kv-cache-memory-gb and read fewer "
        "bytes per decode step, at a small cost in accuracy; cached apart",
    )
    served_model_name: str | None = setting(
        None, help="model id in the API and in block keys (none: the model directory's name)"
    )
    non_prefix_reuse: str = setting(
        "off",
        choices=NON_PREFIX_REUSE,
        help="what a prompt whose prefix is not cached may reuse: off (nothing: exact, as every prefix cache), or "
        "blend (keys and values of its text cached at other positions, moved there, a fraction of its tokens "
        "recomputed: a shorter time to first token after a history rewrite, output close to but not exactly "
        "the exact one's); a request's non_prefix_reuse field overrides it",
    )
    blend_recompute_fraction: float = setting(
        0.1,
        parse=fraction,
        help="blend: the fraction of reused tokens recomputed, 0 to 1 (more: closer to exact, slower)",
    )
    blend_selection: str = setting(
        "leading",
        choices=SELECTIONS,
        help="blend: which reused tokens are recomputed: leading (the first ones of each moved stretch of text) or "
        "deviation (those whose keys and values change most at the second layer; computes the first layer for all)",
    )
    weights_memory_gb: float | None = setting(
        None,
        parse=positive_gb,
        help="keep at most this many GB of weights in memory: the routed experts of a mixture-of-experts weight "
        "package (kvyard convert) that does not fit stay in its file on disk, the most used ones cached within "
        "what the rest of the model leaves, read as tokens pick them (none: load every weight)",
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    record_kv_events: bool = False  # publish `stored`/`removed` events (a server does, for routers)
    kv_tier: KVTierConfig | None = None  # persistent KV tier below the device cache; None: off

    @classmethod
    def create(cls, model: str, **options: Any) -> EngineConfig:
        """From flat keyword options (`max_num_seqs=8`, `kv_tier=KVTierConfig(...)`), as `LLM(model, ...)`
        takes them."""
        return from_flat(cls, options, model=str(model))
