"""Which requests run each step, and where their KV lives: requests, the scheduler, the block pool and the KV cache
manager (prefix cache, tier loads, pulls)."""
