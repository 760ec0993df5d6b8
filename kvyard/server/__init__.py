"""OpenAI-compatible HTTP server for one replica."""
