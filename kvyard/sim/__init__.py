"""Simulated replicas: the replica HTTP API and KV events, with a calibrated cost model instead of a model.

`kvyard sim --port P --replicas N` serves N independent replicas on ports P..P+N-1 from one process.
Each keeps a real, bounded prefix cache (chained block keys, LRU eviction, `stored`/`removed` events)
and runs a token-budget continuous-batching scheduler whose step times come from `CostModel`.
"""
