"""The PyTorch model runner: a scheduled batch through the model, then sampled tokens (or pooled results)."""
