"""The rotary embedding's cos/sin tables, computed once per model in numpy (float32).

Both the PyTorch model (kvyard.models.layers.RotaryEmbedding) and the native fast-start model
(kvyard.models.native_model) take their tables from here, so keys they compute are bit-identical and either can
continue a cache the other filled. (PyTorch's CPU cos and sin differ from numpy's in the last bit of about one
entry in ten.)"""

from __future__ import annotations

import math

import numpy as np

from kvyard.models.config import RopeConfig


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 [head_dim / 2]: theta^(-2i / head_dim), scaled as the rope type says."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(rope.theta) ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama 3.1 long-context scaling: slow down low frequencies, keep high ones, blend between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    factor = np.float32(rope.factor)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (np.float32(old_len) / wavelen - np.float32(rope.low_freq_factor)) / np.float32(
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def rotary_tables(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [max_positions, head_dim / 2] of the angles position * inverse frequency (both halves of a
    head share the table)."""
    angles = np.outer(np.arange(max_positions, dtype=np.float32), rope_inverse_frequencies(rope, head_dim))
    return np.ascontiguousarray(np.cos(angles)), np.ascontiguousarray(np.sin(angles))
