"""Load a Hugging Face checkpoint directory (`config.json` + `*.safetensors`) into a `CausalLM`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvyard.models.checkpoint import FUSED_SHARDS, checkpoint_tensor_name, model_digest, safetensors_files
from kvyard.models.config import ModelConfig, load_model_config
from kvyard.models.decoder import CausalLM
from kvyard.models.latent_attention import latent_checkpoint_tensor

__all__ = ["DTYPES", "load_model", "materialize", "model_digest", "resolve_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype in (None, "auto") else str(dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {sorted(set(DTYPES))}")
    return DTYPES[name]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    config: ModelConfig | None = None,
) -> CausalLM:
    config = config or load_model_config(model_dir)
    with torch.device("meta"):
        model = CausalLM(config, max_positions)
    materialize(model, device, dtype)
    _load_weights(model, safetensors_files(model_dir), config)
    model.rotary.build(device)
    return model.eval().requires_grad_(False)


def materialize(
    model: nn.Module, device: torch.device, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
) -> None:
    """Give every parameter and buffer of a model built on the meta device uninitialised storage on `device`
    (floating-point ones in `dtype`, if given), as `nn.Module.to_empty` does, shared tensors staying shared;
    those named in `skip` (state-dict names: weights kept out of memory) get none.
    `to_empty` goes through `empty_like` on meta tensors, whose reference implementation imports sympy: about
    0.7 s of start-up."""
    made: dict[int, torch.Tensor] = {}
    for tensor_name in skip:
        module_name, _, attribute = tensor_name.rpartition(".")
        tensor = getattr(model.get_submodule(module_name), attribute)
        made[id(tensor)] = torch.empty(0, dtype=tensor.dtype, device=device)
    for module in model.modules():
        stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for store in stores:
            for name, tensor in store.items():
                if tensor is None:
                    continue
                new = made.get(id(tensor))
                if new is None:
                    new_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
                    data = torch.empty(tensor.shape, dtype=new_dtype, device=device)
                    new = nn.Parameter(data, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
                    made[id(tensor)] = new
                store[name] = new


def _load_weights(model: CausalLM, files: list[Path], config: ModelConfig) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = _load_tensor(params, checkpoint_tensor_name(name), reader.get_tensor(name), config)
                if target is not None:
                    loaded.add(target)
    if config.tie_word_embeddings or "lm_head.weight" not in loaded:
        # Tied; or an embedding checkpoint without a head, which pools and never generates (has_lm_head says so).
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def _load_tensor(
    params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor, config: ModelConfig
) -> str | None:
    """Copy one checkpoint tensor into its (possibly fused) parameter; return the parameter name."""
    if "rotary_emb" in name or _beyond_layers(name, config):
        return None
    prefix, _, leaf = name.rpartition(".")
    module_prefix, _, module = prefix.rpartition(".")
    if config.latent is not None and module_prefix.endswith(".self_attn"):  # latent attention: nothing is fused
        params[name].data.copy_(latent_checkpoint_tensor(module, tensor, config))
        return name
    if module in FUSED_SHARDS:
        fused, shard = FUSED_SHARDS[module]
        target = f"{module_prefix}.{fused}.{leaf}"
        _fused_slice(params[target], shard, fused, config).copy_(tensor)
        return target
    if name not in params:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
    params[name].data.copy_(tensor)
    return name


def _beyond_layers(name: str, config: ModelConfig) -> bool:
    """A tensor of a layer past num_hidden_layers: DeepSeek-V3's multi-token-prediction layers, which serving skips."""
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= config.num_layers


def _fused_slice(param: torch.Tensor, shard: int, fused: str, config: ModelConfig) -> torch.Tensor:
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    if fused == "qkv_proj":
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        starts = (0, q_size, q_size + kv_size)
        sizes = (q_size, kv_size, kv_size)
    else:  # a dense layer's MLP or an expert's, whose size is its own
        half = param.shape[0] // 2
        starts, sizes = (0, half), (half, half)
    return param.data.narrow(0, starts[shard], sizes[shard])
