"""The screened argmax of a 16-bit LM head (kvyard.models.screened_head) is the full head's argmax, token for token,
near ties and exact ties included; a self-fp16 draft guesses through it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvyard.kernels.build import KernelsUnavailable
from kvyard.models.native_model import kernel_functions
from kvyard.models.screened_head import ScreenedHead, quantize_int8, widened


@pytest.fixture(scope="module")
def functions() -> dict[str, Any]:
    try:
        return kernel_functions()
    except KernelsUnavailable:
        pytest.skip("no C compiler here")


def _as_16_bit(weight: np.ndarray, is_bf16: bool) -> np.ndarray:
    if is_bf16:
        return (weight.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return weight.astype(np.float16)


def _full_argmax(weight16: np.ndarray, is_bf16: bool, x: np.ndarray, functions: dict[str, Any]) -> np.ndarray:
    """What a draft without screening computes: every logit by the 16-bit kernel, then the argmax kernel."""
    vocab, k = weight16.shape
    logits = np.empty((x.shape[0], vocab), dtype=np.float32)
    functions["kvyard_small_linear_half"](
        x.ctypes.data, weight16.ctypes.data, None, logits.ctypes.data, x.shape[0], vocab, k, int(is_bf16), 2
    )
    tokens = np.empty(x.shape[0], dtype=np.int64)
    functions["kvyard_argmax_rows"](logits.ctypes.data, x.shape[0], vocab, tokens.ctypes.data)
    return tokens


def _near_tie_head(vocab: int, k: int, is_bf16: bool, generator: np.random.Generator) -> np.ndarray:
    """Random rows, with pairs whose logits differ by about what int8 rounding moves a logit (rows 5 and 6: noise of
    a quarter of an int8 step on every weight), or far less (rows 7 and 8: one weight a step of 2^-9 apart), and an
    exact duplicate (rows 10 and 11: the lower id must win)."""
    weight = generator.standard_normal((vocab, k)).astype(np.float32) * 0.05
    weight[6] = weight[5] + generator.standard_normal(k).astype(np.float32) * 0.05 * 2**-7
    weight[8] = weight[7]
    weight[8, 0] += 0.05 * 2**-9
    weight[11] = weight[10]
    return _as_16_bit(weight, is_bf16)


@pytest.mark.parametrize("is_bf16", [False, True])
@pytest.mark.parametrize("k", [64, 512, 1056])  # 1056: two chains per row in the 16-bit kernel, and a last group
def test_the_screened_argmax_is_the_full_heads_even_at_near_ties(
    functions: dict[str, Any], is_bf16: bool, k: int
) -> None:
    generator = np.random.default_rng(k + is_bf16)
    weight16 = _near_tie_head(300, k, is_bf16, generator)
    head = ScreenedHead.of(weight16, is_bf16)
    assert head is not None
    rows = widened(weight16, is_bf16)
    inputs = [generator.standard_normal((3, k)).astype(np.float32)]  # random rows of x: clear winners
    for target in (5, 7, 10):  # aimed at the tied pairs, at several scales, one row with an all-zero group
        x = (rows[target] * 40 + generator.standard_normal((4, k)) * [[0.01], [0.1], [1.0], [3.0]]).astype(np.float32)
        x[0, :32] = 0.0
        inputs.append(x)
    for x in inputs:
        expected = _full_argmax(weight16, is_bf16, x, functions)
        assert np.array_equal(head.argmax(x, functions, 2), expected)
    pair = np.stack([rows[10] * 40 + generator.standard_normal(k).astype(np.float32)] * 2)
    assert list(head.argmax(pair, functions, 2)) == [10, 10]  # the exact tie: the lower token id


def test_the_bound_is_what_keeps_it_exact(functions: dict[str, Any]) -> None:
    """Near ties defeat the int8 logits alone: without the bound the screen picks the other token of a pair."""
    generator = np.random.default_rng(3)
    k = 512
    weight16 = _near_tie_head(300, k, False, generator)
    head = ScreenedHead.of(weight16, False)
    assert head is not None
    x = (widened(weight16, False)[5] * 40 + generator.standard_normal((64, k)) * 0.1).astype(np.float32)
    expected = _full_argmax(weight16, False, x, functions)
    assert np.array_equal(head.argmax(x, functions, 2), expected)
    head.error_norms[:] = 0.0
    head.row_norms[:] = 0.0
    assert not np.array_equal(head.argmax(x, functions, 2), expected)


def test_the_int8_copy_is_the_int8_schemes_quantization() -> None:
    torch = pytest.importorskip("torch")
    from kvyard.models.quantization import quantize_int8 as torch_quantize_int8

    weight = np.random.default_rng(0).standard_normal((70, 96)).astype(np.float32)
    weight[0, :32] = 0.0  # an all-zero group: scale 0
    q, scales = quantize_int8(weight)
    expected_q, expected_scales = torch_quantize_int8(torch.from_numpy(weight))
    assert np.array_equal(q, expected_q.numpy()) and np.array_equal(scales, expected_scales.numpy())


def test_a_head_of_rows_not_in_groups_of_32_is_not_screened() -> None:
    assert ScreenedHead.of(np.zeros((10, 40), dtype=np.float16), False) is None


def test_a_row_with_too_many_candidates_reads_the_whole_head(functions: dict[str, Any]) -> None:
    """Identical rows can never be ruled out: past MAX_CANDIDATES of them the full head decides, the same way."""
    generator = np.random.default_rng(5)
    weight = np.repeat(generator.standard_normal((1, 64)).astype(np.float32) * 0.05, 100, axis=0)
    weight[70] *= 1.01  # the largest logit for x along the shared row, with the other 99 tied below it
    weight16 = _as_16_bit(weight, False)
    head = ScreenedHead.of(weight16, False)
    assert head is not None
    x = np.stack([weight[0] * 40, -weight[0] * 40]).astype(np.float32)  # 70 wins; then the tie of 99: id 0
    expected = _full_argmax(weight16, False, x, functions)
    assert list(expected) == [70, 0]
    assert np.array_equal(head.argmax(x, functions, 2), expected)


def test_an_input_with_a_nan_or_an_infinity_gives_the_full_heads_token(functions: dict[str, Any]) -> None:
    """No logit can be ruled out then; the whole head decides, as it would without the screen."""
    generator = np.random.default_rng(6)
    weight16 = _as_16_bit(generator.standard_normal((200, 64)).astype(np.float32) * 0.05, False)
    head = ScreenedHead.of(weight16, False)
    assert head is not None
    x = generator.standard_normal((2, 64)).astype(np.float32)
    x[0, 3], x[1, 9] = np.nan, np.inf
    assert np.array_equal(head.argmax(x, functions, 2), _full_argmax(weight16, False, x, functions))
