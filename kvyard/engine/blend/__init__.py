"""Reuse beyond a cached prefix: full blocks found by their own tokens wherever they sit (segments), and how a
request blends them (settings). The scheduler plans a blend with these; the runner computes it
(kvyard.engine.runners.blend_prefill)."""
