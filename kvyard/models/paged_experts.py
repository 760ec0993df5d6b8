"""Which of a package's weights stay on disk under a weights memory budget (`--weights-memory-gb`), and the
expert residency (kvyard.models.expert_residency) that serves them.

Every weight but the routed experts' stays resident: embeddings, attention, norms, routers, shared experts, dense
layers. The routed experts share what the budget leaves. A budget that holds the whole model pages nothing; one
that cannot hold the resident part and two experts is refused with the sizes."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvyard.models.decoder import CausalLM
from kvyard.models.expert_residency import FILE_DTYPES, ExpertResidency, PagedTensor
from kvyard.models.experts import SparseMoE
from kvyard.models.mapped_safetensors import TensorExtent, tensor_extents

_LOG = logging.getLogger(__name__)

GB = 1024**3
# How fast an expert's use count decays, in uses per expert: about as many tokens as experts per layer a token
# picks from (128 decode tokens for 128 experts, 8 a token), long enough to learn which experts are popular.
HALF_LIFE_USES_PER_EXPERT = 8


class WeightsBudgetError(ValueError):
    """A weights memory budget this model cannot run within; the message gives the sizes."""


@dataclass(frozen=True, slots=True)
class PagingPlan:
    """The routed experts' tensors by (layer, expert), as state-dict names, and the bytes left for them."""

    experts: dict[tuple[int, int], tuple[str, ...]]
    expert_budget_bytes: int
    kinds: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # each paged tensor's dtype and shape in the model

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for names in self.experts.values() for name in names)


def plan_paging(model: CausalLM, budget_gb: float, tied_head: bool) -> PagingPlan | None:
    """What to page for `model` (still on the meta device) within `budget_gb`; None when the whole model fits."""
    if not 0 < budget_gb < math.inf:
        raise WeightsBudgetError(f"the weights memory budget must be a positive number of GB, not {budget_gb}")
    state = model.state_dict(keep_vars=True)
    if tied_head:
        state.pop("lm_head.weight", None)
    experts = _routed_expert_names(model)
    if not experts:
        raise WeightsBudgetError(
            "a weights memory budget pages the routed experts of a mixture-of-experts model; this model has none"
        )
    paged = {name for names in experts.values() for name in names}
    resident = sum(_nbytes(tensor) for name, tensor in state.items() if name not in paged)
    expert_bytes = {key: sum(_nbytes(state[name]) for name in names) for key, names in experts.items()}
    budget = int(budget_gb * GB)
    if resident + sum(expert_bytes.values()) <= budget:
        _LOG.info("the whole model fits in the weights memory budget of %g GB: nothing is paged", budget_gb)
        return None
    least = 2 * max(expert_bytes.values())
    if budget - resident < least:
        raise WeightsBudgetError(
            f"a weights memory budget of {budget_gb} GB is too small: {_size(resident)} of weights stay "
            f"resident (all but the routed experts) and two experts need {_size(least)} more"
        )
    kinds = {name: (state[name].dtype, tuple(state[name].shape)) for name in paged}
    return PagingPlan(experts, budget - resident, kinds)


def attach_residency(model: CausalLM, plan: PagingPlan, tensors_path: Path) -> ExpertResidency:
    """The residency holding `plan`'s experts from the package's tensors file, each expert layer given its part."""
    extents = tensor_extents(tensors_path)
    paged: dict[tuple[int, int], tuple[PagedTensor, ...]] = {}
    for key, names in plan.experts.items():
        paged[key] = tuple(_paged_tensor(model, plan, name, extents.get(name), tensors_path) for name in names)
    residency = ExpertResidency(tensors_path, paged, plan.expert_budget_bytes, HALF_LIFE_USES_PER_EXPERT * len(paged))
    layers = [(index, layer.mlp) for index, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]
    for position, (index, moe) in enumerate(layers):
        following = layers[position + 1][1] if position + 1 < len(layers) else None
        moe.page_experts(residency, index, following)
    all_bytes = sum(tensor.extent.nbytes for tensors in paged.values() for tensor in tensors)
    start = time.perf_counter()
    filled = residency.fill()
    _LOG.info(
        "experts paged from %s: %d experts (%.3f GB) share %.3f GB, %d of them read in %.1f s to start warm; the rest "
        "of the model stays resident",
        tensors_path,
        len(paged),
        all_bytes / GB,
        plan.expert_budget_bytes / GB,
        filled,
        time.perf_counter() - start,
    )
    return residency


def _routed_expert_names(model: CausalLM) -> dict[tuple[int, int], tuple[str, ...]]:
    experts: dict[tuple[int, int], tuple[str, ...]] = {}
    for index, layer in enumerate(model.model.layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        for number, expert in enumerate(layer.mlp.experts):
            prefix = f"model.layers.{index}.mlp.experts.{number}."
            experts[(index, number)] = tuple(prefix + name for name, _ in expert.state_dict(keep_vars=True).items())
    return experts


def _paged_tensor(model: CausalLM, plan: PagingPlan, name: str, extent: TensorExtent | None, path: Path) -> PagedTensor:
    if extent is None:
        raise WeightsBudgetError(f"{path} lacks tensor {name!r}")
    dtype, shape = plan.kinds[name]
    if FILE_DTYPES.get(extent.dtype) != dtype or extent.shape != shape:
        raise WeightsBudgetError(
            f"{path}: tensor {name!r} is {extent.dtype} {extent.shape}, the model expects {dtype} {shape}"
        )
    module_name, _, attribute = name.rpartition(".")
    return PagedTensor(model.get_submodule(module_name), attribute, extent)


def _size(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB // 10 else f"{nbytes / 1024**2:.2f} MB"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
