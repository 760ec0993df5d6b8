"""kvyard: an open LLM serving stack."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvyard.engine.config import EngineConfig
    from kvyard.engine.llm import LLM
    from kvyard.engine.llm_engine import LLMEngine, RequestOutput
    from kvyard.engine.pooling.params import PoolingParams
    from kvyard.engine.sampling.params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "PoolingParams", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

# Imported on first use, so that processes that never run the engine (router, simulated replicas,
# benchmark clients) do not pay for importing torch.
_LAZY = {
    "LLM": "kvyard.engine.llm",
    "EngineConfig": "kvyard.engine.config",
    "LLMEngine": "kvyard.engine.llm_engine",
    "RequestOutput": "kvyard.engine.llm_engine",
    "PoolingParams": "kvyard.engine.pooling.params",
    "SamplingParams": "kvyard.engine.sampling.params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvyard' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
