"""Weight packages: a model directory whose weights are already in one of kvyard's converted formats (int8, fp16,
bf16), so loading skips the conversion (`kvyard convert MODEL_DIR --weights int8 --out PACKAGE`).

A package holds the source's config and tokenizer files, `model.safetensors` with the model's own tensors (each
converted linear layer as `<layer>.qweight` int8 and `<layer>.scales` fp32, or `<layer>.weight16` in 16 bits;
everything else as stored), and
`kvyard_package.json`: format and version, the weight scheme and group size, the source model's digest and the
safetensors file's SHA-256. Loading checks all of them before it builds anything, so a corrupt, truncated or
foreign package is refused with the reason, never served.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from kvyard.models.config import load_model_config
from kvyard.models.decoder import CausalLM
from kvyard.models.expert_residency import ExpertResidency
from kvyard.models.loader import load_model, materialize, model_digest
from kvyard.models.package_info import (
    FORMAT_VERSION,
    PACKAGE_FILE,
    PACKAGE_FORMAT,
    TENSORS_FILE,
    PackageError,
    PackageInfo,
    checked_tensors_file,
    group_size,
    is_package,
    read_info,
    sha256_of,
)
from kvyard.models.paged_experts import attach_residency, plan_paging
from kvyard.models.quantization import quantize_model

__all__ = ["PackageError", "PackageInfo", "convert", "is_package", "load_package", "read_info"]

_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def convert(model_dir: str | Path, weights: str, out_dir: str | Path) -> PackageInfo:
    """Write the package of `model_dir` with `weights` (a scheme) to `out_dir` (created; must not hold files)."""
    source, out = Path(model_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise PackageError(f"{out} exists and is not empty")
    config = load_model_config(source)
    model = load_model(source, torch.float32, torch.device("cpu"), 1, config)
    if quantize_model(model, weights) == 0:
        raise PackageError(f"{source}: no linear layer could be converted to {weights}")
    out.mkdir(parents=True, exist_ok=True)
    tensors = _own_tensors(model, config.tie_word_embeddings)
    save_file(tensors, str(out / TENSORS_FILE), metadata={"format": "pt"})
    for name in _COPIED:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    info = PackageInfo(
        PACKAGE_FORMAT,
        FORMAT_VERSION,
        weights,
        group_size(weights),
        model_digest(source),
        sha256_of(out / TENSORS_FILE),
    )
    (out / PACKAGE_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def _own_tensors(model: CausalLM, tied: bool) -> dict[str, torch.Tensor]:
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if tied and "lm_head.weight" in state:  # the embedding's own tensor; safetensors stores no shared storage
        del state["lm_head.weight"]
    return state


def load_package(
    package_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    weights_memory_gb: float | None = None,
) -> CausalLM:
    """The packaged model, its tensors checked against the description before any is used. With
    `weights_memory_gb`, the routed experts of a mixture-of-experts model that does not fit in it stay in the
    package's file, read as tokens pick them (kvyard.models.paged_experts): `model.expert_residency`."""
    info = read_info(package_dir)
    tensors_path = checked_tensors_file(package_dir, info)
    config = load_model_config(package_dir)
    with torch.device("meta"):
        model = CausalLM(config, max_positions).to(dtype)
        quantize_model(model, info.weights, empty=True)  # after the dtype: converted tensors keep theirs
    plan = None
    if weights_memory_gb is not None:
        if device.type != "cpu":
            raise PackageError(f"a weights memory budget pages experts on CPU only, not on {device}")
        plan = plan_paging(model, weights_memory_gb, config.tie_word_embeddings)
    paged = plan.names if plan is not None else frozenset()
    materialize(model, device, skip=paged)
    _load_tensors(model, tensors_path, config.tie_word_embeddings, paged)
    residency: ExpertResidency | None = None
    if plan is not None:
        residency = attach_residency(model, plan, tensors_path)
    model.expert_residency = residency
    model.rotary.build(device)
    return model.eval().requires_grad_(False)


def _load_tensors(model: CausalLM, path: Path, tied: bool, paged: frozenset[str]) -> None:
    """Every tensor but the `paged` ones (which attach_residency checks and reads later) into the model."""
    targets = model.state_dict(keep_vars=True)
    loaded: set[str] = set(paged)
    try:
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in paged:
                    continue
                if name not in targets:
                    raise PackageError(f"{path}: tensor {name!r} has no place in this model")
                tensor = reader.get_tensor(name)
                if tensor.shape != targets[name].shape:
                    raise PackageError(
                        f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                        f"{tuple(targets[name].shape)}"
                    )
                targets[name].data.copy_(tensor)
                loaded.add(name)
    except SafetensorError as error:
        raise PackageError(f"{path} cannot be read: {error}") from None
    if tied and isinstance(model.lm_head, nn.Linear):  # an lm_head left in fp32 is the embedding
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(targets) - loaded)
    if missing:
        raise PackageError(f"{path} lacks tensors: {', '.join(missing[:8])}")
