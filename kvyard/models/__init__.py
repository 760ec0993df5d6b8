"""Model definitions (Llama, Qwen2, Qwen3 dense families) and Hugging Face checkpoint loading."""

# The attention backends a model can run with (kvyard.models.attention_backends), named here, without torch,
# so that settings can offer them.
ATTENTION_BACKENDS = ("auto", "native", "torch")
# The weight schemes a model can be loaded in (kvyard.models.quantization), for the same reason.
QUANTIZATION_SCHEMES = ("none", "int8", "fp16", "bf16")
PACKAGE_SCHEMES = ("int8", "fp16", "bf16")  # what `kvyard convert` writes: every scheme but the stored weights
# The formats the paged KV cache can store keys and values in (kvyard.models.kv_format); auto: the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8")
# What the matmuls of many rows (prefill, large batches) over fp32, int8 or bf16 weights compute in
# (kvyard.models.quantization.matmul_in_bf16): float32, bfloat16, or auto (bfloat16 where the CPU has AMX or
# AVX512-BF16).
MATMUL_DTYPES = ("float32", "bfloat16", "auto")
