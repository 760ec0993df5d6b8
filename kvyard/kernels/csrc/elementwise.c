/*
 * The per-layer elementwise work of a decoder step, fused so that a decode step pays one call
 * instead of a dozen small PyTorch ops each: residual add + RMSNorm, rotary embedding, the gated
 * MLP's SiLU-and-multiply; and the greedy sampler's row-wise argmax.
 * fp32, row-major, contiguous rows. In the norm and the rotation, products are not contracted into
 * FMAs, so each rounds exactly where the PyTorch reference rounds; SiLU uses its own exponential.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include "half_float.h"
#include "kvyard_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#endif

#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

/*
 * residual[r] += x[r] (skipped when x is NULL, x fp32 or bf16); out[r] = weight * (residual[r] * rsqrt(mean(
 * residual[r]^2) + eps)), written in fp32 or rounded to bf16.
 */
NO_CONTRACT static void add_rms_norm_rows(const void *x, int x_is_bf16, float *residual, const float *weight,
                                          void *out, int out_is_bf16, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * dim;
        if (x != NULL && x_is_bf16) {
            const uint16_t *xr = (const uint16_t *)x + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) h[i] = bits_to_float((uint32_t)xr[i] << 16) + h[i];
        } else if (x != NULL) {
            const float *xr = (const float *)x + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) h[i] = xr[i] + h[i];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += h[i] * h[i];
        const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
        if (out_is_bf16) {
            uint16_t *o = (uint16_t *)out + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) o[i] = float_to_bf16(weight[i] * (h[i] * inv_rms));
        } else {
            float *o = (float *)out + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (h[i] * inv_rms);
        }
    }
}

void kvyard_add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                         int64_t dim, float eps) {
    add_rms_norm_rows(x, 0, residual, weight, out, 0, rows, dim, eps);
}

/*
 * Rotate-half rotary embedding in place, of fp32 or bf16 rows (each value computed in fp32, rounded back to bf16).
 * Row t holds num_heads heads of head_dim at x + t * row_stride (elements); cos/sin tables are
 * [max_positions, head_dim / 2].
 */
NO_CONTRACT static void rotate_rows(void *x, int is_bf16, int64_t row_stride, int64_t num_tokens, int64_t num_heads,
                                    int64_t head_dim, const float *cos_table, const float *sin_table,
                                    const int64_t *positions) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (num_tokens * num_heads * head_dim >= 65536)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos_table + positions[t] * half;
        const float *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t offset = t * row_stride + h * head_dim;
            if (is_bf16) {
                uint16_t *first = (uint16_t *)x + offset, *second = first + half;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float a = bits_to_float((uint32_t)first[i] << 16);
                    const float b = bits_to_float((uint32_t)second[i] << 16);
                    first[i] = float_to_bf16(a * c[i] - b * s[i]);
                    second[i] = float_to_bf16(b * c[i] + a * s[i]);
                }
            } else {
                float *first = (float *)x + offset, *second = first + half;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float a = first[i], b = second[i];
                    first[i] = a * c[i] - b * s[i];
                    second[i] = b * c[i] + a * s[i];
                }
            }
        }
    }
}

void kvyard_rotary(float *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                   const float *cos_table, const float *sin_table, const int64_t *positions) {
    rotate_rows(x, 0, row_stride, num_tokens, num_heads, head_dim, cos_table, sin_table, positions);
}

/*
 * The gated MLP's activation in one pass: out[r][i] = silu(gate[r][i]) * up[r][i], where row r of gate_up
 * is [gate (dim floats) | up (dim floats)]. silu(x) = x / (1 + e^-x), with e^-|x| taken eight at a time
 * on AVX2 so the exponential never overflows.
 */
void kvyard_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t dim) {
#pragma omp parallel for if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * dim, *up = gate + dim;
        float *o = out + r * dim;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), minus_log2e = _mm256_set1_ps(-1.4426950408889634f);
        const __m256 sign_bit = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= dim; i += 8) {
            const __m256 x = _mm256_loadu_ps(gate + i);
            const __m256 e = exp2_nonpositive(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, x), minus_log2e));
            /* sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below; e = e^-|x| in both. */
            const __m256 numerator = _mm256_blendv_ps(one, e, x);
            const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < dim; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/*
 * bf16 activations between a prefill step's bf16 matmuls (the "_bf16" kernels): each computes in fp32 what its
 * fp32 kernel computes and rounds the result to bf16 once, to nearest even, as PyTorch's cast does.
 */

/*
 * As kvyard_add_rms_norm, with x given as fp32 or bf16 (x_is_bf16) and the normalised rows written in bf16; the
 * residual stays fp32.
 */
void kvyard_add_rms_norm_bf16(const void *x, int x_is_bf16, float *residual, const float *weight, uint16_t *out,
                              int64_t rows, int64_t dim, float eps) {
    add_rms_norm_rows(x, x_is_bf16, residual, weight, out, 1, rows, dim, eps);
}

/* As kvyard_rotary, on bf16 rows (row_stride in elements). */
void kvyard_rotary_bf16(uint16_t *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                        const float *cos_table, const float *sin_table, const int64_t *positions) {
    rotate_rows(x, 1, row_stride, num_tokens, num_heads, head_dim, cos_table, sin_table, positions);
}

/*
 * As kvyard_silu_mul on bf16 rows, rounding where a bf16 model rounds: silu(gate) to bf16, then its product
 * with up to bf16.
 */
void kvyard_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t dim) {
#pragma omp parallel for if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * dim, *up = gate + dim;
        uint16_t *o = out + r * dim;
        float silu[64];
        for (int64_t start = 0; start < dim; start += 64) {
            const int64_t count = dim - start < 64 ? dim - start : 64;
            int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
            const __m256 one = _mm256_set1_ps(1.0f), minus_log2e = _mm256_set1_ps(-1.4426950408889634f);
            const __m256 sign_bit = _mm256_set1_ps(-0.0f);
            for (; i + 8 <= count; i += 8) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(gate + start + i));
                const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
                const __m256 e = exp2_nonpositive(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, x), minus_log2e));
                const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, x), _mm256_add_ps(one, e));
                _mm256_storeu_ps(silu + i, _mm256_mul_ps(x, sigmoid));
            }
#endif
            for (; i < count; i++) {
                const float x = bits_to_float((uint32_t)gate[start + i] << 16);
                silu[i] = x / (1.0f + expf(-x));
            }
#pragma omp simd
            for (i = 0; i < count; i++) {
                const float rounded = bits_to_float((uint32_t)float_to_bf16(silu[i]) << 16);
                o[start + i] = float_to_bf16(rounded * bits_to_float((uint32_t)up[start + i] << 16));
            }
        }
    }
}

/* out[r] = the first index of row r's largest value (rows without NaNs), as torch.argmax gives. */
void kvyard_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for if (rows * cols >= 262144)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        float best = -INFINITY;
#pragma omp simd reduction(max : best)
        for (int64_t i = 0; i < cols; i++) best = row[i] > best ? row[i] : best;
        int64_t index = 0;
        while (index < cols - 1 && row[index] != best) index++;
        out[r] = index;
    }
}
