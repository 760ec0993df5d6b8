/*
 * The per-layer elementwise work of a decoder step, fused so that a decode step pays one call
 * instead of a dozen small PyTorch ops each: residual add + RMSNorm, and rotary embedding.
 * fp32, row-major, contiguous rows. Products are not contracted into FMAs, so each rounds
 * exactly where the PyTorch reference rounds.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

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
