"""`kvyard bench`: a load client for any OpenAI-compatible endpoint, with workloads, metrics, provenance and plots."""
