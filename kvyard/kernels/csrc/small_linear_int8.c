/*
 * y = x W^T (+ b) for a handful of rows of x, with W stored as int8: the decode-step matmul of an int8 model.
 *
 * Each group of 32 consecutive weights of a row has its own fp32 scale: w[j][i] = q[j][i] * scales[j][i / 32]
 * (as llama.cpp's q8_0 groups them, so one outlier costs precision to 31 neighbours only). Decode reads W once
 * per step and is bound by memory bandwidth; int8 with a scale per 32 is 1.125 bytes a weight against fp32's 4.
 * The int8 values are widened to fp32 in registers and accumulated in fp32: x is not quantized.
 *
 * Layout: x [m, k] fp32, q [n, k] int8, scales [n, k / 32] fp32, bias [n] or NULL, y [m, n]; k % 32 == 0.
 */
#include <stdint.h>
#include "kvyard_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#endif

#define GROUP 32
#define ROWS_PER_TILE 4

#if defined(__AVX2__) && defined(__FMA__)
/* Eight int8 weights widened to fp32. */
static inline __m256 widen8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* One row of x against four rows of q. */
static void dot_4x1(const float *x, const int8_t *q, const float *scales, int64_t k, float *out) {
    const int64_t groups = k / GROUP;
    __m256 acc[ROWS_PER_TILE];
    for (int j = 0; j < ROWS_PER_TILE; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * GROUP;
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8), x2 = _mm256_loadu_ps(xg + 16),
                     x3 = _mm256_loadu_ps(xg + 24);
        for (int j = 0; j < ROWS_PER_TILE; j++) {
            const int8_t *qg = q + j * k + g * GROUP;
            __m256 part = _mm256_mul_ps(x0, widen8(qg));
            part = _mm256_fmadd_ps(x1, widen8(qg + 8), part);
            part = _mm256_fmadd_ps(x2, widen8(qg + 16), part);
            part = _mm256_fmadd_ps(x3, widen8(qg + 24), part);
            acc[j] = _mm256_fmadd_ps(part, _mm256_set1_ps(scales[j * groups + g]), acc[j]);
        }
    }
    for (int j = 0; j < ROWS_PER_TILE; j++) out[j] = hsum8(acc[j]);
}
#endif

static float dot1(const float *x, const int8_t *q, const float *scales, int64_t k) {
    float total = 0.0f;
    for (int64_t g = 0; g < k / GROUP; g++) {
        float part = 0.0f;
        for (int i = 0; i < GROUP; i++) part += x[g * GROUP + i] * (float)q[g * GROUP + i];
        total += part * scales[g];
    }
    return total;
}

static void tile(const float *x, const int8_t *q, const float *scales, const float *bias, float *y, int64_t m,
                 int64_t n, int64_t k, int64_t row) {
    const int64_t rows = n - row < ROWS_PER_TILE ? n - row : ROWS_PER_TILE;
    const int64_t groups = k / GROUP;
    for (int64_t r = 0; r < m; r++) {
        float out[ROWS_PER_TILE];
#if defined(__AVX2__) && defined(__FMA__)
        if (rows == ROWS_PER_TILE) {
            dot_4x1(x + r * k, q + row * k, scales + row * groups, k, out);
        } else
#endif
        {
            for (int64_t j = 0; j < rows; j++) out[j] = dot1(x + r * k, q + (row + j) * k, scales + (row + j) * groups, k);
        }
        for (int64_t j = 0; j < rows; j++) y[r * n + row + j] = out[j] + (bias ? bias[row + j] : 0.0f);
    }
}

void kvyard_small_linear_int8(const float *x, const int8_t *q, const float *scales, const float *bias, float *y,
                              int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t num_tiles = (n + ROWS_PER_TILE - 1) / ROWS_PER_TILE;
    const int parallel = n * k >= 4 * 65536; /* as small_linear.c: ~256 KB of weights before a second thread pays */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t t = 0; t < num_tiles; t++) tile(x, q, scales, bias, y, m, n, k, t * ROWS_PER_TILE);
}
