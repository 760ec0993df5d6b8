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
#include "kvyard_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#endif

#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

/*
 * residual[r] += x[r] (skipped when x is NULL); out[r] = weight * (residual[r] * rsqrt(mean(residual[r]^2) + eps)).
 */
NO_CONTRACT void kvyard_add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                                     int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * dim;
        if (x != NULL) {
            const float *xr = x + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) h[i] = xr[i] + h[i];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += h[i] * h[i];
        const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (h[i] * inv_rms);
    }
}

/*
 * Rotate-half rotary embedding in place. Row t holds num_heads heads of head_dim at x + t * row_stride;
 * cos/sin tables are [max_positions, head_dim / 2].
 */
NO_CONTRACT void kvyard_rotary(float *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                               const float *cos_table, const float *sin_table, const int64_t *positions) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (num_tokens * num_heads * head_dim >= 65536)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos_table + positions[t] * half;
        const float *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            float *first = x + t * row_stride + h * head_dim;
            float *second = first + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = first[i], b = second[i];
                first[i] = a * c[i] - b * s[i];
                second[i] = b * c[i] + a * s[i];
            }
        }
    }
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
