"""Serve a model before PyTorch has loaded.

Importing PyTorch takes 1.5-2 s on a small CPU machine, longer than reading a model. So `kvyard serve MODEL` (a
weight package, or an fp32 checkpoint served as stored) first builds this engine: the same scheduler, block pool,
prefix cache and block keys as LLMEngine, with a runner that computes on the native CPU kernels over the model's
memory-mapped tensors (numpy, no PyTorch; a checkpoint's q/k/v and gate/up concatenated as LLMEngine fuses them).
It answers while LLMEngine loads in the background on the same KV memory; LLMEngine then takes over its requests
and blocks between two steps (LLMEngine.take_over) and serves everything from there: the PyTorch runner's
large-batch matmuls and speculative decoding; the KV tier and the pulls of prefilled prompts pass over to it.
Requests whose sampling the native runner does not reproduce wait for it (native_runner.runs_natively).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvyard.api.checks import ContextLimits
from kvyard.engine.config import EngineConfig
from kvyard.engine.core import EngineCore
from kvyard.engine.fast_start.native_blocks import NumpyBlocks
from kvyard.engine.fast_start.native_runner import NativeRunner, runs_natively
from kvyard.engine.kv_links.pull_link import KVPullLink
from kvyard.engine.kv_links.tier_link import KVTierLink
from kvyard.engine.model_setup import (
    attach_kv_tier,
    close_links,
    core_config_of,
    enable_pulls,
    eos_token_ids,
    load_tokenizer,
    max_model_len_of,
    num_kv_blocks_of,
)
from kvyard.engine.sampling.params import SamplingParams
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.stats import StoreSnapshot
from kvyard.models.checkpoint import fused_tensors, has_lm_head, model_digest
from kvyard.models.config import ModelConfig, load_model_config
from kvyard.models.native_model import KV_STORAGE, NativeModel, default_num_threads, kernel_functions
from kvyard.models.package_info import is_package, read_info


def fast_start_blocker(config: EngineConfig) -> str | None:
    """Why this configuration cannot be served before PyTorch loads (None: it can). It can when it is a weight
    package, or a checkpoint served as stored, computed in fp32 on this CPU through the native kernels as LLMEngine
    would run it on its fast paths, without what only PyTorch runs (speculative decoding, bf16 matmuls)."""
    package = is_package(config.model)
    if not package and config.quantization != "none":
        return f"--quantization {config.quantization} converts at load time (a package from kvyard convert starts fast)"
    if config.device not in (None, "cpu") or (config.device is None and Path("/proc/driver/nvidia/gpus").is_dir()):
        return "the engine may run on a GPU"
    model_config = load_model_config(config.model)
    dtype = model_config.torch_dtype if config.dtype in (None, "auto") else config.dtype
    reasons = {
        f"computes in {dtype}, not float32": dtype != "float32",
        "attention backend torch": config.attention_backend == "torch",
        "speculative decoding": config.speculative.method is not None,
        "blending moved text (--non-prefix-reuse blend), which only PyTorch runs": config.non_prefix_reuse == "blend",
        f"matmul dtype {config.matmul_dtype}": config.matmul_dtype != "float32",
        "an embedding checkpoint (no LM head), which only PyTorch pools": not package and not has_lm_head(config.model),
        "a mixture-of-experts model, which only PyTorch runs": model_config.moe is not None,
        "a weights memory budget, which only PyTorch keeps": config.weights_memory_gb is not None,
        f"quantization {config.quantization} of a package": package
        and config.quantization not in ("none", read_info(config.model).weights),
    }
    return next((reason for reason, applies in reasons.items() if applies), None)


def kv_block_bytes_native(model_config: ModelConfig, block_size: int, kv_name: str) -> int:
    """Bytes of one KV block in format `kv_name`, as kvyard.engine.runners.model_runner.kv_block_bytes counts them."""
    storage, _, extra = KV_STORAGE[kv_name]
    row_bytes = model_config.head_dim * np.dtype(storage).itemsize + extra
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * row_bytes


class NativeStartEngine(EngineCore):
    """The engine LLMEngine takes over once PyTorch has loaded (see the module's docstring)."""

    dtype = "float32"

    def __init__(self, config: EngineConfig) -> None:
        blocker = fast_start_blocker(config)
        if blocker is not None:
            raise ValueError(f"{config.model} cannot start before PyTorch: {blocker}")
        self.engine_config = config
        self.model_config = load_model_config(config.model)
        max_model_len = max_model_len_of(config, self.model_config)
        tokenizer = load_tokenizer(config.model)
        kv_name = "fp32" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        functions, num_threads = kernel_functions(), default_num_threads()
        if is_package(config.model):
            model = NativeModel.from_package(config.model, max_model_len, functions, num_threads)
            digest = read_info(config.model).weights_digest
        else:
            tensors = fused_tensors(config.model, self.model_config)
            model = NativeModel(self.model_config, tensors, "none", max_model_len, functions, num_threads)
            digest = model_digest(config.model)
        block_bytes = kv_block_bytes_native(self.model_config, config.block_size, kv_name)
        num_kv_blocks = num_kv_blocks_of(config, max_model_len, block_bytes)
        limits = ContextLimits(max_model_len, self.model_config.vocab_size, config.block_size, num_kv_blocks)
        namespace = KeyNamespace(
            model_name=config.served_model_name or Path(config.model).name,
            model_digest=digest,
            dtype="float32" if kv_name == "fp32" else f"float32+kv-{kv_name}",  # as KVFormat.namespace_dtype
            block_size=config.block_size,
        )
        self.native_runner = NativeRunner(model, num_kv_blocks, config.block_size, kv_name)
        super().__init__(
            core_config_of(config, limits),
            namespace,
            self.native_runner,
            tokenizer,
            eos_token_ids(self.model_config, tokenizer),
        )
        self.device_blocks = NumpyBlocks(self.native_runner.kv_caches, config.block_size, kv_name)
        self.block_reader = self.device_blocks  # its blocks can be exported to decode replicas
        self.kv_tier: KVTierLink | None = attach_kv_tier(self, config, self.device_blocks)
        self.kv_puller: KVPullLink | None = None

    def enable_pulls(self, headers: dict[str, str]) -> KVPullLink:
        """Let requests pull their prompts' blocks from prefill replicas, calling them with `headers`."""
        self.kv_puller = enable_pulls(self, self.engine_config, self.device_blocks, headers)
        return self.kv_puller

    @property
    def kv_buffers(self) -> list[Any]:
        """The layers' KV memory, which the engine taking over builds its caches on."""
        return list(self.native_runner.kv_buffers)

    @property
    def num_kv_blocks(self) -> int:
        return self.limits.num_kv_blocks

    @staticmethod
    def runs_natively(params: SamplingParams) -> bool:
        return runs_natively(params)

    def kv_tier_snapshot(self) -> StoreSnapshot | None:
        """The KV tier's counters (thread-safe); None when the tier is off (or passed to the engine taking over)."""
        tier = self.kv_tier
        return tier.store.snapshot() if tier is not None else None

    def close(self) -> None:
        """Finish queued KV-tier writes and release the tier and puller, unless an engine took them over with the
        KV memory."""
        close_links(self, self.kv_tier, self.kv_puller)
        self.kv_tier = self.kv_puller = None
