/*
 * y = x W^T (+ b) for a handful of rows of x, fp32: the decode-step matmul.
 *
 * With few rows the cost is reading W once from memory, so each thread streams its own slice
 * of W's rows exactly once and applies every row of x to it while it is in cache. PyTorch's
 * BLAS path for this shape reaches well under the memory bandwidth on some CPUs.
 *
 * Layout: x [m, k], w [n, k] (row-major, as nn.Linear stores it), bias [n] or NULL, y [m, n].
 */
#include <stdint.h>
#include "kvyard_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#endif

#define ROWS_PER_TILE 4

#if defined(__AVX2__) && defined(__FMA__)
/* Four rows of w against one row of x; k must be a multiple of 8. */
static void dot_4x1(const float *x, const float *w, int64_t k, float *out, int64_t out_stride) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + i), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + k + i), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 2 * k + i), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 3 * k + i), a3);
    }
    out[0] = hsum8(a0), out[1] = hsum8(a1), out[2] = hsum8(a2), out[3] = hsum8(a3);
    (void)out_stride;
}

/* Four rows of w against three rows of x: each loaded w vector feeds three FMAs. */
static void dot_4x3(const float *x, const float *w, int64_t k, float *out, int64_t out_stride) {
    __m256 acc[3][4];
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + k + i), x2 = _mm256_loadu_ps(x + 2 * k + i);
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_loadu_ps(w + j * k + i);
            acc[0][j] = _mm256_fmadd_ps(x0, wv, acc[0][j]);
            acc[1][j] = _mm256_fmadd_ps(x1, wv, acc[1][j]);
            acc[2][j] = _mm256_fmadd_ps(x2, wv, acc[2][j]);
        }
    }
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < 4; j++) out[r * out_stride + j] = hsum8(acc[r][j]);
}
#endif

static float dot1(const float *x, const float *w, int64_t k) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < k; i++) total += x[i] * w[i];
    return total;
}

static void tile(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                 int64_t row) {
    const int64_t rows = n - row < ROWS_PER_TILE ? n - row : ROWS_PER_TILE;
    for (int64_t r = 0; r < m;) {
        float out[3][ROWS_PER_TILE];
        int64_t done = 1;
#if defined(__AVX2__) && defined(__FMA__)
        if (rows == ROWS_PER_TILE && k % 8 == 0) {
            done = m - r >= 3 ? 3 : 1;
            (done == 3 ? dot_4x3 : dot_4x1)(x + r * k, w + row * k, k, &out[0][0], ROWS_PER_TILE);
        } else
#endif
        {
            for (int64_t j = 0; j < rows; j++) out[0][j] = dot1(x + r * k, w + (row + j) * k, k);
        }
        for (int64_t d = 0; d < done; d++)
            for (int64_t j = 0; j < rows; j++) y[(r + d) * n + row + j] = out[d][j] + (bias ? bias[row + j] : 0.0f);
        r += done;
    }
}

void kvyard_small_linear(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n,
                         int64_t k, int num_threads) {
    const int64_t num_tiles = (n + ROWS_PER_TILE - 1) / ROWS_PER_TILE;
    /* Below ~256 KB of weights a second thread costs more to wake than it saves. */
    const int parallel = n * k >= 65536;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t t = 0; t < num_tiles; t++) tile(x, w, bias, y, m, n, k, t * ROWS_PER_TILE);
}
