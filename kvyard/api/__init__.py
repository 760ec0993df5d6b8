"""The replica contract as code (docs/contracts.md §3–5).

Everything a replica promises its clients and the router, defined once: the OpenAI request models
and error shape, the input checks behind them, the load report, the KV-event wire format and the
metric names. The server, the simulator, the router and the benchmark all import it; it imports no
web framework and nothing above `kvcache`.
"""
