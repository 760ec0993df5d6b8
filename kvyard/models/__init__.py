"""Model definitions (Llama, Qwen2, Qwen3 dense families) and Hugging Face checkpoint loading."""
