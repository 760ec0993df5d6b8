"""How a prompt whose prefix broke may reuse moved text (torch-free: the scheduler and the command line read it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

SELECTIONS = ("leading", "deviation")
NON_PREFIX_REUSE = ("off", "blend")


def fraction(text: str) -> float:
    """A number from 0 to 1, read from an option's text."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be from 0 to 1, not {text}")
    return value


@dataclass(frozen=True, slots=True)
class BlendSettings:
    """`recompute_fraction` of the reused tokens is recomputed on top of the ones always recomputed (the tokens no
    cache holds, the last one, and `leading_tokens` of each moved run), chosen by `selection`
    (kvyard.engine.runners.blend_prefill says how each chooses)."""

    recompute_fraction: float = 0.1
    selection: str = "leading"
    leading_tokens: int = 4
    # A prompt blends only when moved text is at least this share of what its cached prefix leaves: a few matched
    # blocks are not worth leaving exact caching for (a blended prompt's blocks are never cached).
    min_reused_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_fraction <= 1.0:
            raise ValueError(f"recompute_fraction must be in [0, 1], not {self.recompute_fraction}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, not {self.selection!r}")
        if self.leading_tokens < 0:
            raise ValueError(f"leading_tokens must be >= 0, not {self.leading_tokens}")
        if not 0.0 <= self.min_reused_fraction <= 1.0:
            raise ValueError(f"min_reused_fraction must be in [0, 1], not {self.min_reused_fraction}")

    def tokens_computed(self, num_new: int, num_reused: int) -> int:
        """About how many tokens blending `num_new` prompt tokens computes through every layer, `num_reused` of them
        from segments (the deviation selection also computes its first layer for all of them)."""
        return (num_new - num_reused) + math.ceil(self.recompute_fraction * num_reused)
