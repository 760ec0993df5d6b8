"""Create deterministic random-weight models with a locally trained tokenizer, in Hugging Face format.

Tests and demos use these instead of downloading a checkpoint::

    python -m kvyard.testing.create_model --arch qwen3 --preset tiny --out /tmp/qwen3-tiny

The same (arch, preset, seed, dtype) gives byte-identical files for a given Python, torch and
transformers version (the tokenizer is trained on this Python's standard-library sources).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvyard.paths import cache_root
from kvyard.testing.model_presets import (
    ARCHITECTURES,
    DEFAULT_ARCH,
    DEFAULT_PRESET,
    DTYPES,
    MOE_ARCHITECTURES,
    PRESETS,
)
from kvyard.testing.tokenizer_build import (
    CHATML,
    LLAMA3,
    ChatFormat,
    special_token_id,
    train_tokenizer,
    write_tokenizer,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FORMAT_VERSION = 1  # bump when create_model's output changes, so cached default models are rebuilt


@dataclass(frozen=True, slots=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # total tokenizer size, special tokens included
    max_position_embeddings: int
    rope_theta: float
    # Std of the N(0, std) weight init. HF's usual 0.02 leaves a random model's logits almost flat
    # (std ~ sqrt(hidden) * range ~ 0.2 for tiny), so greedy decoding flips on rounding noise and
    # soon repeats one token. Each preset uses ~1.2 / sqrt(hidden), giving logits of std ~1.2:
    # larger values made the deeper presets chaotic (bf16 and fp32 greedy paths diverge sooner),
    # smaller ones gave tiny/small models long single-token loops.
    initializer_range: float


_PRESETS = MappingProxyType(
    {
        "tiny": Preset(64, 2, 4, 2, 16, 128, 1024, 2048, 10_000.0, 0.15),
        "small": Preset(256, 4, 4, 2, 64, 704, 8000, 4096, 10_000.0, 0.08),
        "bench": Preset(512, 8, 8, 4, 64, 1408, 32000, 8192, 1_000_000.0, 0.05),
        # The starting point of train_demo: ~8.5M parameters (17 MB in float16), an 8192-token context.
        "demo": Preset(256, 6, 4, 2, 64, 704, 8000, 8192, 100_000.0, 0.02),
        # ~400M parameters, 1.4 GB of fp32 weights read per decode step: more than a CPU's last-level cache holds,
        # so decoding streams its weights from memory, as a real checkpoint's does. Benchmarks only.
        "large": Preset(1536, 12, 12, 4, 128, 4096, 32000, 8192, 1_000_000.0, 0.03),
    }
)


@dataclass(frozen=True, slots=True)
class _Arch:
    # transformers' class names: transformers (about 2 s) and torch are imported only when a model is written, so
    # a script that finds its model already cached, or only answers --help, does not wait for them
    config_class: str
    model_class: str
    chat: ChatFormat
    extra: Mapping[str, object] = field(default_factory=dict)  # config fields beyond the preset's (MoE experts)
    # MLP-size fields of an MoE model's experts, each set to the preset's MLP size divided by the number given
    expert_sizes: Mapping[str, int] = field(default_factory=dict)
    latent: bool = False  # DeepSeek-V3's latent attention: its sizes from the preset's (_latent_fields)


_ARCHS = MappingProxyType(
    {
        "llama": _Arch("LlamaConfig", "LlamaForCausalLM", LLAMA3),
        "qwen2": _Arch("Qwen2Config", "Qwen2ForCausalLM", CHATML),
        "qwen3": _Arch("Qwen3Config", "Qwen3ForCausalLM", CHATML),
        # Mixture-of-experts: 8 experts, 2 a token, each a quarter of the preset's MLP (Qwen2-MoE's shared one half).
        "qwen3_moe": _Arch(
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            CHATML,
            MappingProxyType({"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}),
            MappingProxyType({"moe_intermediate_size": 4}),
        ),
        "qwen2_moe": _Arch(
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            CHATML,
            MappingProxyType({"num_experts": 8, "num_experts_per_tok": 2}),
            MappingProxyType({"moe_intermediate_size": 4, "shared_expert_intermediate_size": 2}),
        ),
        "mixtral": _Arch(
            "MixtralConfig",
            "MixtralForCausalLM",
            LLAMA3,
            MappingProxyType({"num_local_experts": 8, "num_experts_per_tok": 2}),
            MappingProxyType({"intermediate_size": 4}),
        ),
        # DeepSeek-V3: 8 routed experts in 4 groups (2 groups a token, 2 experts), one shared, the first layer dense
        "deepseek_v3": _Arch(
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            CHATML,
            MappingProxyType(
                {
                    "n_routed_experts": 8,
                    "n_shared_experts": 1,
                    "num_experts_per_tok": 2,
                    "n_group": 4,
                    "topk_group": 2,
                    "routed_scaling_factor": 2.5,
                    "norm_topk_prob": True,
                    # As DeepSeek-V3's own config says them; vLLM builds the routing's bias only when told noaux_tc
                    "topk_method": "noaux_tc",
                    "scoring_func": "sigmoid",
                    "first_k_dense_replace": 1,
                    "num_mtp_layers": 0,
                }
            ),
            MappingProxyType({"moe_intermediate_size": 4}),
            latent=True,
        ),
    }
)


def create_model(arch: str, preset: str, out_dir: str | Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write config, generation config, random weights and tokenizer to `out_dir`; return it.

    Weights are drawn from torch's global RNG seeded with `seed` (its state is restored afterwards),
    so do not create models from several threads at once. A `dtype` other than float32 rounds the
    float32 weights, so all dtypes of one seed hold the same model.
    """
    import torch
    import transformers

    spec, preset_spec = _lookup(arch, preset)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chat = spec.chat
    tokenizer = train_tokenizer(preset_spec.vocab_size, chat)
    bos_id = special_token_id(tokenizer, chat.bos_token or chat.text_end_token)
    eos_id = special_token_id(tokenizer, chat.eos_token)
    text_end_id = special_token_id(tokenizer, chat.text_end_token)
    config = _model_config(spec, preset_spec, tokenizer.get_vocab_size(), bos_id, eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, spec.model_class)(config)
        if spec.latent:  # its norms start at ones and its selection bias at zero: a misplaced one would not show
            for name, tensor in model.state_dict().items():
                if name.endswith("norm.weight") or name.endswith("e_score_correction_bias"):
                    tensor.add_(torch.randn_like(tensor) * 0.1)
    model.to(getattr(torch, dtype))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=bos_id, eos_token_id=[eos_id, text_end_id], pad_token_id=text_end_id
    )
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(tokenizer, chat, out, preset_spec.max_position_embeddings)
    return out


def preset_spec(preset: str) -> Preset:
    """The shapes and initialisation of a named preset."""
    return _lookup(DEFAULT_ARCH, preset)[1]


def _lookup(arch: str, preset: str) -> tuple[_Arch, Preset]:
    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {ARCHITECTURES + MOE_ARCHITECTURES}, got {arch!r}")
    if preset not in _PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    return _ARCHS[arch], _PRESETS[preset]


def _model_config(spec: _Arch, p: Preset, vocab_size: int, bos_id: int, eos_id: int) -> PretrainedConfig:
    import transformers

    fields: dict[str, object] = {
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "max_position_embeddings": p.max_position_embeddings,
        "rope_theta": p.rope_theta,
        "rms_norm_eps": 1e-6,
        "initializer_range": p.initializer_range,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        **spec.extra,
    }
    for name, divisor in spec.expert_sizes.items():
        fields[name] = p.intermediate_size // divisor
    if spec.latent:
        fields.pop("head_dim")
        fields |= {
            "num_key_value_heads": p.num_heads,
            "q_lora_rank": p.hidden_size // 2,
            "kv_lora_rank": p.hidden_size // 4,
            "qk_nope_head_dim": p.head_dim,
            "qk_rope_head_dim": p.head_dim // 2,
            "v_head_dim": p.head_dim,
        }
    config: PretrainedConfig = getattr(transformers, spec.config_class)(**fields)
    return config


def default_model_dir(arch: str = DEFAULT_ARCH, preset: str = DEFAULT_PRESET) -> Path:
    """Where ensure_default_model keeps a model, e.g. ~/.cache/kvyard/models/llama-bench-v1."""
    _lookup(arch, preset)
    return cache_root() / "models" / f"{arch}-{preset}-v{FORMAT_VERSION}"


def ensure_default_model(arch: str = DEFAULT_ARCH, preset: str = DEFAULT_PRESET) -> Path:
    """Return the cached model directory, creating it (seed 0, float32) on first use.

    The model is written to a temporary sibling directory and renamed into place, so a reader
    never sees a half-written model; when processes race, the first rename wins and the others
    discard their copies.
    """
    target = default_model_dir(arch, preset)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        create_model(arch, preset, tmp)
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--arch", choices=ARCHITECTURES + MOE_ARCHITECTURES, default=DEFAULT_ARCH)
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args(argv)
    out = create_model(args.arch, args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def cached_model(work_dir: str | Path, arch: str = "llama", preset: str = "bench") -> Path:
    """`work_dir/models/<arch>-<preset>`, created the first time (benchmarks share it)."""
    out = Path(work_dir) / "models" / f"{arch}-{preset}"
    if not (out / "config.json").exists():
        print(f"creating the {preset} {arch} model in {out}", flush=True)
        create_model(arch, preset, out)
    return out
