"""Model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF architecture name -> kvyard family. All share one decoder implementation; the family only switches on QKV
# bias (Qwen2) or per-head Q/K RMSNorm (Qwen3), and mixture-of-experts architectures (MOE_ARCHITECTURES) replace
# the MLP of their sparse layers with experts.
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # latent attention (kvyard.models.latent_attention) and experts
    # base models, as embedding checkpoints are saved: no LM head (they pool, kvyard.engine.pooling.params)
    "LlamaModel": "llama",
    "MistralModel": "llama",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
MODEL_TYPE_FAMILIES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
MOE_ARCHITECTURES = frozenset(
    {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"}
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The model directory describes an architecture or feature kvyard cannot run."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between interpolated and kept frequencies, and the factor cos and sin are scaled by
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: from mscale and mscale_all_dim, else 0.1 ln(factor) + 1
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True, slots=True)
class LatentConfig:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3; kvyard.models.latent_attention)."""

    q_lora_rank: int  # 0: queries straight from the hidden state (q_proj), else through a normalized low rank
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float

    @property
    def row_width(self) -> int:
        """Values cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def scale_of(qk_head_dim: int, rope_type: str, factor: float, mscale_all_dim: float) -> float:
        """1/sqrt(qk head size), times yarn's mscale(factor, mscale_all_dim) squared where the rope is scaled."""
        scale = qk_head_dim**-0.5
        if rope_type != "default" and mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The expert layers of a mixture-of-experts model: each token's MLP is the weighted sum of the
    `experts_per_token` experts its router scores highest (softmax over all experts' logits, then the top ones)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    normalize_top_k: bool  # the chosen experts' weights are divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    sparse_layers: frozenset[int]  # the layers whose MLP is the experts; the others keep a dense MLP
    shared_expert_intermediate_size: int = 0  # an expert every token uses besides its routed ones (0: none)
    shared_expert_gated: bool = True  # Qwen2-MoE scales the shared expert's output by a sigmoid gate; DeepSeek not
    # DeepSeek-V3's routing: each expert's score a sigmoid (not a softmax over all), chosen after adding a learned
    # bias, only within the `top_groups` of `num_groups` groups whose two best scores sum highest; the chosen
    # experts' unbiased scores, normalized (normalize_top_k), times `routed_scaling`, weight their outputs.
    scoring: str = "softmax"
    selection_bias: bool = False
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(f"expert scoring {self.scoring!r} is not implemented (softmax or sigmoid)")
        per_group = self.num_experts // max(1, self.num_groups)
        grouped = self.num_groups > 1
        if grouped and (self.num_experts % self.num_groups or per_group < 2):
            raise UnsupportedModelError(
                f"{self.num_experts} experts cannot be split into {self.num_groups} groups of at least two"
            )
        if self.num_experts and not 1 <= self.experts_per_token <= self.top_groups * per_group:
            raise UnsupportedModelError(
                f"{self.experts_per_token} experts per token cannot be chosen from {self.top_groups} groups of "
                f"{per_group}"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None  # attention sees only this many tokens back (None: the whole context)
    moe: MoeConfig | None = None  # None: every layer's MLP is dense
    # Latent attention: then num_kv_heads (1) and head_dim (the latent row's width) describe the cache, not heads
    latent: LatentConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_planes(self) -> int:
        """Tensors the paged cache keeps per layer: keys and values, or latent attention's one row."""
        return 1 if self.latent is not None else 2

    @property
    def rotary_dim(self) -> int:
        return self.latent.qk_rope_head_dim if self.latent is not None else self.head_dim


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    raw = json.loads(path.read_text())
    generation_path = Path(model_dir) / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    return parse_model_config(raw, generation)


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    architecture, family = _resolve_family(raw)
    _refuse_unimplemented(architecture, raw)
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
    rope = _parse_rope(raw)
    latent = _parse_latent(raw, rope) if family == "deepseek_v3" else None
    return ModelConfig(
        architecture=architecture,
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=1 if latent else int(raw.get("num_key_value_heads") or num_heads),
        head_dim=latent.row_width if latent else int(raw.get("head_dim") or hidden_size // num_heads),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        eos_token_ids=_as_id_tuple(eos),
        bos_token_id=raw.get("bos_token_id"),
        sliding_window=_sliding_window(raw),
        moe=_parse_moe(architecture, raw),
        latent=latent,
        raw=raw,
    )


def _parse_latent(raw: dict[str, Any], rope: RopeConfig) -> LatentConfig:
    nope, rotary = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    return LatentConfig(
        q_lora_rank=int(raw.get("q_lora_rank") or 0),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rotary,
        v_head_dim=int(raw["v_head_dim"]),
        softmax_scale=LatentConfig.scale_of(nope + rotary, rope.rope_type, rope.factor, rope.mscale_all_dim),
    )


def _parse_moe(architecture: str, raw: dict[str, Any]) -> MoeConfig | None:
    if architecture not in MOE_ARCHITECTURES:
        return None
    num_layers = int(raw["num_hidden_layers"])
    if architecture == "DeepseekV3ForCausalLM":
        return _parse_deepseek_moe(raw, num_layers)
    if architecture == "MixtralForCausalLM":  # every layer sparse; the experts' size is intermediate_size
        return MoeConfig(
            int(raw.get("num_local_experts") or raw.get("num_experts") or 8),
            int(raw.get("num_experts_per_tok", 2)),
            int(raw["intermediate_size"]),
            True,
            frozenset(range(num_layers)),
        )
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 128)  # transformers 5 writes the latter
    step = int(raw.get("decoder_sparse_step", 1))
    dense = {int(layer) for layer in raw.get("mlp_only_layers") or ()}
    sparse = frozenset(
        layer for layer in range(num_layers) if layer not in dense and num_experts > 0 and (layer + 1) % step == 0
    )
    return MoeConfig(
        num_experts,
        int(raw.get("num_experts_per_tok", 8)),
        int(raw.get("moe_intermediate_size", raw["intermediate_size"])),
        bool(raw.get("norm_topk_prob", False)),
        sparse,
        int(raw.get("shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0,
    )


def _parse_deepseek_moe(raw: dict[str, Any], num_layers: int) -> MoeConfig:
    """The first `first_k_dense_replace` layers dense (intermediate_size), the others experts with DeepSeek-V3's
    grouped sigmoid routing and ungated shared experts (moe_intermediate_size x n_shared_experts)."""
    expert_size = int(raw["moe_intermediate_size"])
    return MoeConfig(
        int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 256),
        int(raw.get("num_experts_per_tok", 8)),
        expert_size,
        bool(raw.get("norm_topk_prob", True)),
        frozenset(range(int(raw.get("first_k_dense_replace", 0)), num_layers)),
        expert_size * int(raw.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        scoring="sigmoid",
        selection_bias=True,
        num_groups=int(raw.get("n_group") or 1),
        top_groups=int(raw.get("topk_group") or 1),
        routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
    )


def _refuse_unimplemented(architecture: str, raw: dict[str, Any]) -> None:
    """Config fields that change the model's math in ways kvyard does not implement: serving such a checkpoint
    would give wrong output, so it is refused at load."""
    problems = []
    activation = raw.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):
        problems.append(f"hidden_act={activation!r} (only silu is implemented)")
    if raw.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP projections without bias only)")
    shared = raw.get("shared_expert_intermediate_size") if architecture != "Qwen2MoeForCausalLM" else None
    deepseek = architecture == "DeepseekV3ForCausalLM"
    if shared or (raw.get("n_shared_experts") and not deepseek):
        problems.append("shared experts outside Qwen2-MoE and DeepSeek-V3 (experts every token uses)")
    if deepseek:
        problems += _deepseek_problems(raw)
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append(f"partial_rotary_factor={raw['partial_rotary_factor']} (rotary embedding on whole heads only)")
    if problems:
        raise UnsupportedModelError("config.json asks for what kvyard does not implement: " + "; ".join(problems))


def _deepseek_problems(raw: dict[str, Any]) -> list[str]:
    """DeepSeek-V3 configs kvyard's routing and latent attention do not compute as written."""
    problems = []
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={raw['scoring_func']!r} (DeepSeek-V3's sigmoid routing only)")
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method={raw['topk_method']!r} (DeepSeek-V3's noaux_tc routing only)")
    if raw.get("attention_bias"):
        problems.append("attention_bias=true (latent attention without biases only)")
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        problems.append(f"num_key_value_heads={kv_heads} (latent attention has one latent per head)")
    return problems


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The attention window the checkpoint was trained with, if it applies (Qwen2 and Qwen3 configs carry one
    with `use_sliding_window: false`)."""
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return None
    return int(window)


def _resolve_family(raw: dict[str, Any]) -> tuple[str, str]:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in ARCHITECTURE_FAMILIES:
            return name, ARCHITECTURE_FAMILIES[name]
    model_type = raw.get("model_type")
    if not architectures and model_type in MODEL_TYPE_FAMILIES:
        return str(model_type), MODEL_TYPE_FAMILIES[str(model_type)]
    supported = ", ".join(sorted(ARCHITECTURE_FAMILIES))
    raise UnsupportedModelError(
        f"config.json 'architectures' {architectures or model_type!r} is not supported; supported: {supported}"
    )


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    # As transformers: yarn's pretrained length defaults to the context length, and its factor to their ratio.
    yarn = rope_type == "yarn"
    default_original = int(raw.get("max_position_embeddings", 8192)) if yarn else 8192
    original = int(params.get("original_max_position_embeddings") or default_original)
    factor = params.get("factor")
    if factor is None:
        factor = int(raw.get("max_position_embeddings", original)) / original if yarn else 1.0
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor) if attention_factor is not None else None,
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
