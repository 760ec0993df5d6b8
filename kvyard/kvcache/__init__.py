"""KV-cache storage: block keys, KV events, and the persistent tier (memory → disk → Redis/Valkey)."""

from kvyard.kvcache.config import KVTierConfig

__all__ = ["KVTierConfig"]
