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
    if rope.rope_type == "yarn":
        return _yarn_scaled(inv_freq, rope, head_dim)
    return inv_freq


def rope_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (yarn's attention factor; 1 for the other types)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaled(inv_freq: np.ndarray, rope: RopeConfig, head_dim: int) -> np.ndarray:
    """YaRN: frequencies that turn fewer than beta_slow times over the pretrained length are interpolated
    (divided by the factor), those that turn more than beta_fast times kept, a linear ramp between."""
    original, theta = rope.original_max_position_embeddings, rope.theta

    def dimension_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(rope.beta_fast), dimension_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = np.float32(1) - ramp.astype(np.float32)
    interpolated = inv_freq / np.float32(rope.factor)
    return (interpolated * (np.float32(1) - kept) + inv_freq * kept).astype(np.float32)


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
    head share the table), times the rope type's attention factor (yarn's; else 1)."""
    angles = np.outer(np.arange(max_positions, dtype=np.float32), rope_inverse_frequencies(rope, head_dim))
    scale = np.float32(rope_attention_factor(rope))
    return np.ascontiguousarray(np.cos(angles) * scale), np.ascontiguousarray(np.sin(angles) * scale)
