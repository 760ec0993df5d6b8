"""kvyard's layers inside other engines: the KV tier as a vLLM KV connector (`kvyard.integrations.vllm`)."""
