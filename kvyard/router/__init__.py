"""Cache-aware router across replicas: registry, cache index, policies and an OpenAI-compatible proxy."""
