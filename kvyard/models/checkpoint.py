"""A Hugging Face checkpoint directory's files without PyTorch: its safetensors files, the digest that names its
weights in block keys, and its tensors under the names of kvyard's fused model, as numpy arrays (for the fast
start, kvyard.engine.fast_start.engine). kvyard.models.loader loads the same files into the PyTorch model."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from kvyard.models.config import ModelConfig
from kvyard.models.mapped_safetensors import map_tensors

# checkpoint tensor suffix -> (fused parameter suffix, shard index)
FUSED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FULL_HASH_LIMIT = 256 << 20
_SAMPLE_BYTES = 1 << 20
_NUM_SAMPLES = 64


def safetensors_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    return files


BACKBONE_ROOTS = ("embed_tokens.", "layers.", "norm.")  # a base model's tensors, saved without the `model.` prefix


# Mixtral's original expert names (block_sparse_moe.experts.E.w1: gate, w3: up, w2: down), as Qwen-MoE names them.
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def checkpoint_tensor_name(name: str) -> str:
    """A checkpoint tensor's name as kvyard's causal LM names it: a base model (`Qwen3Model`, as embedding
    checkpoints such as Qwen3-Embedding ship) stores `layers.0....` where the causal LM stores `model.layers.0....`;
    Mixtral names its router and experts `block_sparse_moe.gate` and `block_sparse_moe.experts.E.w1/w2/w3`;
    DeepSeek-V3 its shared experts `shared_experts` and its selection bias `gate.e_score_correction_bias`."""
    name = f"model.{name}" if name.startswith(BACKBONE_ROOTS) else name
    if ".mlp.shared_experts." in name or ".mlp.gate.e_score_correction_bias" in name:  # DeepSeek-V3's names
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.").replace(".mlp.gate.e_score", ".mlp.e_score")
    if ".block_sparse_moe." not in name:
        return name
    name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_MIXTRAL_PROJECTIONS[m.group(2)]}.", name)
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def has_lm_head(model_dir: str | Path) -> bool:
    """Whether the checkpoint can generate: it stores an LM head, or ties it to the embedding (read from the
    safetensors headers only)."""
    if json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings", False):
        return True
    return any("lm_head.weight" in _header_names(path) for path in safetensors_files(model_dir))


def _header_names(path: Path) -> set[str]:
    with path.open("rb") as file:
        size = int.from_bytes(file.read(8), "little")
        return set(json.loads(file.read(size)))


def model_digest(model_dir: str | Path) -> str:
    """A stable digest of the model's config and weights, used in the KV cache namespace.

    Small files are hashed whole; large ones by their safetensors header plus evenly spaced
    samples, which tells apart checkpoints that share a config but not weights without reading
    gigabytes at start-up.
    """
    digest = hashlib.sha256()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in safetensors_files(model_dir):
        digest.update(path.name.encode())
        digest.update(_file_fingerprint(path))
    return digest.hexdigest()[:32]


def _file_fingerprint(path: Path) -> bytes:
    size = path.stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            digest.update(f.read())
            return digest.digest()
        for i in range(_NUM_SAMPLES):
            f.seek(i * (size - _SAMPLE_BYTES) // (_NUM_SAMPLES - 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.digest()


def fused_tensors(model_dir: str | Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by the fused model's parameter names, in float32 as the PyTorch loader copies them
    into an fp32 model: q/k/v and gate/up (weights and biases) concatenated in shard order (copies), every other
    fp32 tensor a view of the mapped file, fp16 and bf16 ones widened (exactly) into copies."""
    tensors: dict[str, np.ndarray] = {}
    shards: dict[str, dict[int, np.ndarray]] = {}
    for path in safetensors_files(model_dir):
        for name, tensor in map_tensors(path).items():
            if "rotary_emb" in name:
                continue
            tensor = as_float32(tensor)
            prefix, _, leaf = name.rpartition(".")
            module_prefix, _, module = prefix.rpartition(".")
            if module in FUSED_SHARDS:
                fused, shard = FUSED_SHARDS[module]
                shards.setdefault(f"{module_prefix}.{fused}.{leaf}", {})[shard] = tensor
            else:
                tensors[name] = tensor
    for name, parts in shards.items():
        expected = 3 if ".qkv_proj." in name else 2
        if sorted(parts) != list(range(expected)):
            raise ValueError(f"checkpoint is missing weights: {name} has shards {sorted(parts)} of {expected}")
        tensors[name] = np.concatenate([parts[index] for index in range(expected)], axis=0)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def as_float32(tensor: np.ndarray) -> np.ndarray:
    """A float tensor in float32 (exact for fp16 and bf16, whose 16-bit patterns map_tensors reads as uint16)."""
    if tensor.dtype == np.float32:
        return tensor
    if tensor.dtype == np.uint16:
        return (tensor.astype(np.uint32) << 16).view(np.float32)
    if tensor.dtype in (np.float16, np.float64):
        return tensor.astype(np.float32)
    raise ValueError(f"a checkpoint tensor of {tensor.dtype} cannot be read as float32")
