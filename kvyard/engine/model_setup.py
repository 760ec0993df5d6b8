"""Setting up an engine for a model directory, the parts that need no PyTorch: the context window check, the
tokenizer, the end-of-sequence tokens, the engine's core configuration and KV block count. Both engines use
them: LLMEngine (PyTorch) and the fast-start engine that serves a package before PyTorch has loaded."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvyard.api.checks import ContextLimits
from kvyard.engine.blend.settings import BlendSettings
from kvyard.engine.config import EngineConfig
from kvyard.engine.core import CoreConfig, EngineCore
from kvyard.engine.kv_links.pull_link import KVPullLink
from kvyard.engine.kv_links.tier_link import KVTierLink, TierDevice
from kvyard.kvcache.pd_stream import PullLimits
from kvyard.models.config import ModelConfig, UnsupportedModelError
from kvyard.models.tokenizer import GENERIC_TOKENIZER_CLASSES, PlainTokenizer

_LOG = logging.getLogger(__name__)


def max_model_len_of(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence served: the option, capped by the model's positions; the window checked."""
    positions = model_config.max_position_embeddings
    max_model_len = min(config.max_model_len or positions, positions)
    check_window(model_config, max_model_len)
    return max_model_len


def num_kv_blocks_of(config: EngineConfig, max_model_len: int, block_bytes: int) -> int:
    """KV blocks for the engine: the option, else what --kv-cache-memory-gb holds, at most enough for every
    sequence at full length."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    blocks_per_seq = -(-max_model_len // config.block_size)
    by_memory = int(config.kv_cache_memory_gb * (1 << 30)) // block_bytes
    return max(1, min(by_memory, blocks_per_seq * config.scheduler.max_num_seqs))


def attach_kv_tier(core: EngineCore, config: EngineConfig, device: TierDevice) -> KVTierLink | None:
    """The engine's persistent KV tier over `device` (its KV memory), attached below its prefix cache; None when
    the tier or prefix caching is off."""
    tier = config.kv_tier
    if tier is None or not config.enable_prefix_caching:
        return None
    link = KVTierLink(tier.build(), device, tier.load_deadline_s, tier.load_min_speedup)
    core.attach_tier(link)
    return link


def enable_pulls(core: EngineCore, config: EngineConfig, device: TierDevice, headers: dict[str, str]) -> KVPullLink:
    """Let the engine's requests pull their prompts' blocks from prefill replicas into `device` (its KV memory),
    calling them with `headers`."""
    transfer = config.kv_transfer
    limits = PullLimits(transfer.kv_transfer_timeout_s, transfer.kv_transfer_idle_s, headers)
    puller = KVPullLink(device, limits)
    core.attach_puller(puller)
    return puller


def close_links(core: EngineCore, tier: KVTierLink | None, puller: KVPullLink | None) -> None:
    """Detach and close an engine's puller and KV tier (queued tier writes finish first)."""
    if puller is not None:
        core.attach_puller(None)
        puller.close()
    if tier is not None:
        core.attach_tier(None)
        tier.close()


def core_config_of(config: EngineConfig, limits: ContextLimits) -> CoreConfig:
    return CoreConfig(
        limits=limits,
        scheduler=config.scheduler,
        enable_prefix_caching=config.enable_prefix_caching,
        record_kv_events=config.record_kv_events,
        kv_lease_s=config.kv_transfer.kv_lease_s,
        speculative=config.speculative,
        non_prefix_reuse=config.non_prefix_reuse,
        blend=BlendSettings(config.blend_recompute_fraction, config.blend_selection),
    )


def check_window(model_config: ModelConfig, max_model_len: int) -> None:
    """kvyard's attention sees the whole context: serving a sliding-window model past its window would be wrong."""
    window = model_config.sliding_window
    if window is not None and max_model_len > window:
        raise UnsupportedModelError(
            f"config.json sliding_window={window}: sliding-window attention is not implemented, so output past "
            f"{window} tokens would differ from the model's; serve it with --max-model-len {window} (or less)"
        )


def eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> set[int]:
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def load_tokenizer(model_dir: str) -> Any:
    if not any((Path(model_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    loaded = PlainTokenizer.load(model_dir)
    if loaded.tokenizer is not None:
        return loaded.tokenizer
    _LOG.info("tokenizer loads through transformers: %s", loaded.reason)
    if tokenizer_class(model_dir) in GENERIC_TOKENIZER_CLASSES and (Path(model_dir) / "tokenizer.json").is_file():
        # The class AutoTokenizer would pick, without the model config and modeling imports it loads first
        # (about 2 s of start-up).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def tokenizer_class(model_dir: str) -> str | None:
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        name = json.loads(path.read_text()).get("tokenizer_class") if path.is_file() else None
    except (OSError, ValueError):
        return None  # AutoTokenizer reads it again and says what is wrong
    return name if isinstance(name, str) else None
