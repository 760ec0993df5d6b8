"""The fast-start engine: serves from the native CPU kernels while PyTorch loads, then hands over to LLMEngine (kept
together for the one-CPU-engine work to replace)."""
