"""The greedy tokens of a 16-bit LM head, found mostly from an int8 copy of it: exactly the head's own argmax.

A draft model guesses each token as the argmax of its LM head, whose vocabulary-sized matrix is a large share of
what a pass reads: 41% of the bench model's fp16 weights. Here an int8 copy (a scale per 32 weights, the int8
kernel's format: 1.125 bytes a weight against 2) gives every logit to within a bound, and only the tokens the
bound cannot rule out, usually one to a few, are computed again from the 16-bit rows.

The bound on |16-bit logit - int8 logit| of row i for an input x, with ŵ the dequantized row and x̂ the input as
the int8 kernel rounds it (to int16 per group of 32, so |x_j - x̂_j| <= step_g / 2):

    |w·x - ŵ·x̂| <= ||w - ŵ|| ||x|| + ||ŵ|| ||x - x̂||   (Cauchy-Schwarz on each term),

plus both kernels' fp32 rounding, at most k·2^-24 of ||w|| ||x|| each for a dot product of length k (taken 4x
over). A token whose upper bound is below the largest lower bound cannot be the argmax; the rest are rescored by
the 16-bit kernel, whose sum for a row does not depend on the other rows it computes, so each rescored logit is
the bits the full head gives it and ties go to the lowest token id as the argmax kernel's do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GROUP_SIZE = 32  # the int8 kernel's group of weights sharing a scale
MAX_CANDIDATES = 64  # past this many a row's full 16-bit logits are computed instead
BUILD_ROWS = 1024  # head rows quantized and measured at a time
_FP32_EPSILON = 2.0**-24


class ScreenedHead:
    """A 16-bit head with its int8 copy and each row's bound terms (float32, rounded up), and scratch for one pass."""

    __slots__ = ("_scratch", "_screened", "error_norms", "is_bf16", "qweight", "row_norms", "scales", "weight16")

    def __init__(
        self,
        weight16: np.ndarray,
        is_bf16: bool,
        qweight: np.ndarray,
        scales: np.ndarray,
        error_norms: np.ndarray,
        row_norms: np.ndarray,
    ) -> None:
        self.weight16 = weight16  # [vocab, k] fp16 or bf16 bit patterns (uint16 for bf16)
        self.is_bf16 = is_bf16
        self.qweight = qweight  # [vocab, k] int8
        self.scales = scales  # [vocab, k / 32] fp32
        self.error_norms = error_norms  # [vocab] ||w_i - ŵ_i||
        self.row_norms = row_norms  # [vocab] max(||w_i||, ||ŵ_i||)
        self._screened = np.empty((0, qweight.shape[0]), dtype=np.float32)  # int8 logits, grown to the rows asked
        self._scratch = np.empty((2, qweight.shape[0]), dtype=np.float32)

    @classmethod
    def of(cls, weight16: np.ndarray, is_bf16: bool) -> ScreenedHead | None:
        """For a head of fp16 (or, with is_bf16, bf16 as uint16) weights; None when its rows do not split into
        groups of 32."""
        if weight16.ndim != 2 or weight16.shape[1] % GROUP_SIZE:
            return None
        vocab, k = weight16.shape
        qweight = np.empty((vocab, k), dtype=np.int8)
        scales = np.empty((vocab, k // GROUP_SIZE), dtype=np.float32)
        error_norms, row_norms = np.empty(vocab), np.empty(vocab)
        for start in range(0, vocab, BUILD_ROWS):  # a few MB of float64 at a time, whatever the vocabulary
            rows = slice(start, start + BUILD_ROWS)
            weight = widened(weight16[rows], is_bf16)
            qweight[rows], scales[rows] = quantize_int8(weight)
            exact = weight.astype(np.float64)
            groups = qweight[rows].reshape(-1, k // GROUP_SIZE, GROUP_SIZE)
            dequantized = (groups * scales[rows, :, None].astype(np.float64)).reshape(exact.shape)
            error_norms[rows] = np.linalg.norm(exact - dequantized, axis=1)
            row_norms[rows] = np.maximum(np.linalg.norm(exact, axis=1), np.linalg.norm(dequantized, axis=1))
        return cls(weight16, is_bf16, qweight, scales, _rounded_up(error_norms), _rounded_up(row_norms))

    def argmax(self, hidden: np.ndarray, functions: dict[str, Any], num_threads: int) -> np.ndarray:
        """The head's greedy token for each row of `hidden` [rows, k] (float32), as argmax of its logits."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        rows, (vocab, k) = hidden.shape[0], self.qweight.shape
        if self._screened.shape[0] < rows:
            self._screened = np.empty((rows, vocab), dtype=np.float32)
        screened = self._screened
        functions["kvyard_small_linear_int8"](
            hidden.ctypes.data,
            self.qweight.ctypes.data,
            self.scales.ctypes.data,
            None,
            screened.ctypes.data,
            rows,
            vocab,
            k,
            num_threads,
        )
        tokens = np.empty(rows, dtype=np.int64)
        best = np.empty(1, dtype=np.int64)
        for row in range(rows):
            candidates: np.ndarray | None = self._candidates(hidden[row], screened[row])
            if candidates is not None and not 0 < candidates.shape[0] <= MAX_CANDIDATES:
                candidates = None  # every row of the head (none left: a NaN or an infinity in the input)
            logits = self._logits16(hidden[row : row + 1], candidates, functions, num_threads)
            # the argmax kernel's first maximum, as without the screen: candidates ascend
            functions["kvyard_argmax_rows"](logits.ctypes.data, 1, logits.shape[1], best.ctypes.data)
            tokens[row] = best[0] if candidates is None else candidates[best[0]]
        return tokens

    def _candidates(self, x: np.ndarray, screened: np.ndarray) -> np.ndarray:
        """The token ids (ascending) whose 16-bit logit may be the largest, from their int8 logits. The bound's
        fp32 arithmetic here rounds by far less than the kernels' allowance it carries."""
        norm = float(np.linalg.norm(x.astype(np.float64)))
        steps = np.abs(x.reshape(-1, GROUP_SIZE)).max(axis=1).astype(np.float64) / 32767.0
        rounding = float(np.sqrt(GROUP_SIZE * np.sum((steps / 2) ** 2)))  # ||x - x̂|| at most
        fp32_error = 4 * x.shape[0] * _FP32_EPSILON * (norm + rounding)
        bound, other = self._scratch
        np.multiply(self.error_norms, np.float32(norm), out=bound)
        np.multiply(self.row_norms, np.float32(rounding + fp32_error), out=other)
        np.add(bound, other, out=bound)
        np.subtract(screened, bound, out=other)
        largest_lower = other.max()
        np.add(screened, bound, out=other)
        return np.flatnonzero(other >= largest_lower)

    def _logits16(
        self, x: np.ndarray, candidates: np.ndarray | None, functions: dict[str, Any], num_threads: int
    ) -> np.ndarray:
        """The 16-bit logits [1, candidates] of x [1, k] for the candidate tokens (None: all)."""
        rows = self.weight16 if candidates is None else np.ascontiguousarray(self.weight16[candidates])
        out = np.empty((1, rows.shape[0]), dtype=np.float32)
        functions["kvyard_small_linear_half"](
            x.ctypes.data,
            rows.ctypes.data,
            None,
            out.ctypes.data,
            1,
            rows.shape[0],
            x.shape[1],
            int(self.is_bf16),
            num_threads,
        )
        return out


def _rounded_up(values: np.ndarray) -> np.ndarray:
    """float64 values as float32, none below its float64 value."""
    rounded = values.astype(np.float32)
    return np.where(rounded < values, np.nextafter(rounded, np.float32(np.inf)), rounded).astype(np.float32)


def widened(weight16: np.ndarray, is_bf16: bool) -> np.ndarray:
    """fp16 or bf16 (uint16 bit patterns) weights as float32, exactly."""
    if is_bf16:
        return (weight16.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return weight16.view(np.float16).astype(np.float32)


def quantize_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [n, k], scales fp32 [n, k / 32]) as kvyard.models.quantization.quantize_int8 makes them."""
    rows, columns = weight.shape
    groups = weight.astype(np.float32).reshape(rows, columns // GROUP_SIZE, GROUP_SIZE)
    scales = np.abs(groups).max(axis=-1) / np.float32(127.0)
    safe = np.where(scales > 0, scales, np.float32(1.0))
    q = np.clip(np.rint(groups / safe[..., None]), -127, 127).astype(np.int8)
    return q.reshape(rows, columns), scales.astype(np.float32)
