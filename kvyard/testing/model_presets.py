"""The names `create_model` accepts, in a module without torch or transformers, so that a command line
can offer them as choices without loading either."""

from __future__ import annotations

from pathlib import Path

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# mixture-of-experts: 8 experts, 2 a token (DeepSeek-V3: also latent attention, a dense first layer, a shared expert)
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
PRESETS = ("tiny", "small", "bench", "demo", "large")
DTYPES = ("float32", "bfloat16", "float16")

# The default model: big enough to be a meaningful benchmark, still created in well under a minute.
DEFAULT_ARCH = "llama"
DEFAULT_PRESET = "bench"

# The embedded demo model: a small Llama trained on the standard library's Python by `train_demo`, committed
# (float16, ~17 MB) so that `kvyard serve` needs nothing else. The presets above stay for tests and benchmarks.
DEMO_MODEL_DIR = Path(__file__).resolve().with_name("kvyard-demo")
