"""The names `create_model` accepts, in a module without torch or transformers, so that a command line
can offer them as choices without loading either."""

from __future__ import annotations

ARCHITECTURES = ("llama", "qwen2", "qwen3")
PRESETS = ("tiny", "small", "bench", "demo")
DTYPES = ("float32", "bfloat16", "float16")

# The default model: big enough to be a meaningful benchmark, still created in well under a minute.
DEFAULT_ARCH = "llama"
DEFAULT_PRESET = "bench"
