"""Prompt-only requests that return a vector: pooling parameters (no PyTorch) and the pooler the PyTorch runner
uses."""
