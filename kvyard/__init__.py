"""kvyard: an open LLM serving stack."""

from kvyard.engine.llm import LLM
from kvyard.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from kvyard.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
