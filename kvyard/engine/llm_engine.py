"""The engine on a real model: an `EngineCore` whose runner is a `ModelRunner`, built from a model directory."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvyard.api.checks import ContextLimits
from kvyard.engine.config import EngineConfig
from kvyard.engine.core import EngineCore, RequestOutput, RequestTimes
from kvyard.engine.fast_start.engine import NativeStartEngine
from kvyard.engine.kv_links.device_blocks import DeviceBlocks
from kvyard.engine.kv_links.pull_link import KVPullLink
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
from kvyard.engine.runners.model_runner import ModelRunner, kv_block_bytes
from kvyard.engine.speculative.draft_proposer import DraftModelProposer, load_draft_model
from kvyard.engine.speculative.policy import MODEL_METHODS
from kvyard.engine.speculative.self_draft import SelfDraftProposer
from kvyard.kernels.threads import use_engine_threads
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.stats import StoreSnapshot
from kvyard.models.checkpoint import has_lm_head
from kvyard.models.config import ModelConfig, load_model_config
from kvyard.models.decoder import CausalLM
from kvyard.models.expert_residency import ResidencySnapshot
from kvyard.models.kv_format import KVFormat
from kvyard.models.loader import load_model, model_digest, resolve_dtype
from kvyard.models.package import is_package, load_package, read_info
from kvyard.models.package_info import scheme_suffix
from kvyard.models.quantization import (
    BF16_MATMUL_SUFFIX,
    cpu_has_fast_bf16,
    matmul_in_bf16,
    quantize_model,
)

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "RequestTimes"]

_LOG = logging.getLogger(__name__)


class LLMEngine(EngineCore):
    tokenizer: Any  # a PlainTokenizer or a Hugging Face tokenizer (encode, chat template); None without tokenizer files

    def __init__(self, config: EngineConfig, kv_buffers: Sequence[Any] | None = None) -> None:
        """`kv_buffers`: memory for the layers' KV caches, one buffer each, as a fast-start engine's runner holds
        them (`take_over`); by default the runner allocates its own."""
        use_engine_threads()  # a server's loading thread loads with the engine's threads (kvyard.kernels.threads)
        self.engine_config = config
        self.model_config: ModelConfig = load_model_config(config.model)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        max_model_len = max_model_len_of(config, self.model_config)
        tokenizer = load_tokenizer(config.model)
        model, digest, scheme = self._load_weights(config, max_model_len)
        self.expert_residency = model.expert_residency
        self.generates = is_package(config.model) or has_lm_head(config.model)
        # Only the fp32 CPU fast paths have bf16 matmuls (quantization.matmul_in_bf16 checks the option's value).
        fast_paths_possible = self.dtype == torch.float32 and self.device.type == "cpu"
        bf16_matmul = matmul_in_bf16(config.matmul_dtype, scheme) and fast_paths_possible
        if bf16_matmul and not cpu_has_fast_bf16():
            _LOG.warning(
                "--matmul-dtype bfloat16 on a CPU without AMX or AVX512-BF16: bf16 matmuls are emulated "
                "here (by oneDNN, or by PyTorch where oneDNN has no bf16 path), likely slower than "
                "float32"
            )
        if bf16_matmul and model.expert_residency is not None:
            model.expert_residency.close()
            raise ValueError(
                "--weights-memory-gb pages experts that multiply in float32 only for now: serve it with "
                "--matmul-dtype float32"
            )
        digest += BF16_MATMUL_SUFFIX if bf16_matmul else ""
        self.kv_format = KVFormat.resolve(config.kv_cache_dtype, self.dtype)
        block_bytes = kv_block_bytes(self.model_config, config.block_size, self.kv_format)
        num_kv_blocks = num_kv_blocks_of(config, max_model_len, block_bytes)
        limits = ContextLimits(max_model_len, self.model_config.vocab_size, config.block_size, num_kv_blocks)
        namespace = KeyNamespace(
            model_name=config.served_model_name or Path(config.model).name,
            model_digest=digest,
            dtype=self.kv_format.namespace_dtype(self.dtype),
            block_size=config.block_size,
        )
        self.runner: ModelRunner = ModelRunner(
            model,
            num_kv_blocks,
            config.block_size,
            self.dtype,
            self.device,
            config.attention_backend,
            config.kv_cache_dtype,
            bf16_matmul,
            kv_buffers,
        )
        proposer = self._model_proposer(max_model_len, num_kv_blocks, tokenizer)
        super().__init__(
            core_config_of(config, limits),
            namespace,
            self.runner,
            tokenizer,
            eos_token_ids(self.model_config, tokenizer),
            proposer,
        )
        if isinstance(proposer, SelfDraftProposer):
            proposer.use_block_pool(self.block_pool)
        self.device_blocks = DeviceBlocks(self.runner.kv_caches, config.block_size, self.kv_format.codec_name)
        self.block_reader = self.device_blocks
        # Taking over from a fast-start engine (kv_buffers given), this engine adopts its tier instead.
        self.kv_tier = attach_kv_tier(self, config, self.device_blocks) if kv_buffers is None else None
        self.kv_puller: KVPullLink | None = None

    def use_compute_threads(self) -> None:
        use_engine_threads()

    def take_over(self, started: NativeStartEngine) -> None:
        """Continue the requests, blocks, prefix cache and KV tier of a fast-start engine whose KV memory this
        engine's runner was built on (`kv_buffers`), from its next step on; call it on the engine thread, between
        steps. The two must agree on everything a block key or a block id means."""
        if (started.namespace, started.limits) != (self.namespace, self.limits):
            raise RuntimeError(
                f"the PyTorch engine cannot take over: its namespace and limits "
                f"{self.namespace}, {self.limits} differ from the fast-start engine's "
                f"{started.namespace}, {started.limits}"
            )
        self.adopt_core_state(started)
        # Its tier and puller move over with its KV manager; their device sides read and write the same memory.
        self.kv_tier, started.kv_tier = started.kv_tier, None
        self.kv_puller, started.kv_puller = started.kv_puller, None

    def _load_weights(self, config: EngineConfig, max_model_len: int) -> tuple[CausalLM, str, str]:
        """The model, converted as `quantization` asks, the digest naming its weights in block keys and their
        scheme. A weight package (kvyard convert) is already converted: its digest is the one converting its
        source gives."""
        if is_package(config.model):
            info = read_info(config.model)
            if config.quantization not in ("none", info.weights):
                raise ValueError(
                    f"{config.model} is a package of {info.weights} weights; quantization "
                    f"{config.quantization!r} cannot apply to it"
                )
            model = load_package(config.model, self.dtype, self.device, max_model_len, config.weights_memory_gb)
            return model, info.weights_digest, info.weights
        if config.weights_memory_gb is not None:
            raise ValueError(
                f"--weights-memory-gb pages weights from a weight package; {config.model} is a checkpoint: "
                f"convert it first (kvyard convert {config.model} --weights int8 --out PACKAGE)"
            )
        model = load_model(config.model, self.dtype, self.device, max_model_len, self.model_config)
        quantize_model(model, config.quantization)
        return model, weights_digest(config.model, config.quantization), config.quantization

    def _model_proposer(
        self, max_model_len: int, num_kv_blocks: int, tokenizer: Any
    ) -> DraftModelProposer | SelfDraftProposer | None:
        """The speculative proposer that runs a model: a draft with as many KV blocks of its own as the model, or
        the model's own converted weights over its cache (self-int8, self-fp16)."""
        config = self.engine_config
        spec = config.speculative
        if spec.method not in MODEL_METHODS:
            return None
        draft_tokenizer = load_tokenizer(spec.draft_model) if spec.draft_model else None
        model = load_draft_model(
            spec.method,
            spec.draft_model,
            config.model,
            self.model_config,
            config.quantization,
            max_model_len,
            self.dtype,
            self.device,
            (tokenizer, draft_tokenizer),
        )
        if spec.method != "draft":
            return SelfDraftProposer(model, self.runner)
        return DraftModelProposer(
            model,
            num_kv_blocks,
            config.block_size,
            self.device,
            config.attention_backend,
            spec.max_draft_catch_up,
            config.kv_cache_dtype,
        )

    @property
    def num_kv_blocks(self) -> int:
        return self.limits.num_kv_blocks

    def enable_pulls(self, headers: dict[str, str]) -> KVPullLink:
        """Let requests pull their prompts' blocks from prefill replicas, calling them with `headers`."""
        self.kv_puller = enable_pulls(self, self.engine_config, self.device_blocks, headers)
        return self.kv_puller

    def kv_tier_snapshot(self) -> StoreSnapshot | None:
        """The KV tier's counters (thread-safe); None when the tier is off."""
        tier = self.kv_tier
        return tier.store.snapshot() if tier is not None else None

    def close(self) -> None:
        """Finish queued KV-tier writes and release the tier; the engine must not step afterwards."""
        close_links(self, self.kv_tier, self.kv_puller)
        self.kv_tier = self.kv_puller = None
        if self.expert_residency is not None:
            self.expert_residency.close()

    def expert_residency_snapshot(self) -> ResidencySnapshot | None:
        """The paged experts' cache and counters (readable from any thread); None when no weight is paged."""
        return self.expert_residency.snapshot() if self.expert_residency is not None else None


def weights_digest(model_dir: str, quantization: str) -> str:
    """The checkpoint's digest, with the weight scheme when it is not the stored one: KV computed with other
    weights lands under other block keys."""
    return model_digest(model_dir) + scheme_suffix(quantization)
