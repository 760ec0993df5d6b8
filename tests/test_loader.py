"""Materializing a model built on the meta device: what `to_empty` gives, without its start-up cost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from kvyard.models.loader import materialize


def test_materialize_allocates_every_tensor_and_keeps_shared_ones_shared() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=True))
        model[1].weight = model[0].weight  # tied, as an LM head and its embedding can be
        model.register_buffer("steps", torch.zeros(3, dtype=torch.long))
    materialize(model, torch.device("cpu"), torch.bfloat16)
    embedding, head = model[0], model[1]
    assert isinstance(embedding.weight, nn.Parameter) and embedding.weight.device.type == "cpu"
    assert head.weight is embedding.weight
    assert embedding.weight.dtype == torch.bfloat16 and head.bias.dtype == torch.bfloat16
    assert model.steps.dtype == torch.long and model.steps.device.type == "cpu"
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "1.bias"]


def test_loading_a_model_does_not_import_sympy(llama_dir: Path) -> None:
    # nn.Module.to_empty on meta tensors imports sympy through torch's reference ops: 0.7 s of every start.
    code = (
        "import sys, torch; from kvyard.models.loader import load_model; "
        f"load_model({str(llama_dir)!r}, torch.float32, torch.device('cpu'), 64); "
        "print('sympy' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
