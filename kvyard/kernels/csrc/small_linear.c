/*
 * y = x W^T (+ b) for a handful of rows of x, fp32: the decode-step matmul.
 *
 * With few rows the cost is reading W once from memory, so each thread streams its own slice
 * of W's rows exactly once and applies every row of x to it while it is in cache. PyTorch's
 * BLAS path for this shape reaches well under the memory bandwidth on some CPUs.
 *
 * With AVX-512 (and k a multiple of 16), four rows of w go against up to six rows of x per pass, each loaded w
 * vector feeding one FMA per row of x (24 accumulators, 6 x vectors and the w vector: 31 of the 32 registers).
 * The AVX2 path takes three rows of x at most, then one at a time, and spent 1.5x the time of one row on five
 * rows of x (a verify pass of speculative decoding), weights streamed from memory on a 2-core Zen 5.
 *
 * Layout: x [m, k], w [n, k] (row-major, as nn.Linear stores it), bias [n] or NULL, y [m, n].
 */
#include <stdint.h>
#include "kvyard_kernels.h"
#include "prefetch.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#endif

#define ROWS_PER_TILE 4
#define X_ROWS_PER_PASS 6 /* AVX-512 path; the AVX2 one takes 3 */

#if defined(__AVX512F__)
/* Four rows of w against `rows` rows of x; k a multiple of 16. Inlined with a constant `rows`. */
static inline __attribute__((always_inline)) void dot_4xr(const float *x, const float *w, int64_t k, float *out,
                                                          int64_t out_stride, const int rows) {
    __m512 acc[X_ROWS_PER_PASS][ROWS_PER_TILE];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ROWS_PER_TILE; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        __m512 xv[X_ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) xv[r] = _mm512_loadu_ps(x + r * k + i);
        for (int j = 0; j < ROWS_PER_TILE; j++) {
            prefetch_weights(w + (j + ROWS_PER_TILE) * k + i); /* the next tile's rows, at this column */
            const __m512 wv = _mm512_loadu_ps(w + j * k + i);
            for (int r = 0; r < rows; r++) acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ROWS_PER_TILE; j++) out[r * out_stride + j] = _mm512_reduce_add_ps(acc[r][j]);
}

/* Four rows of w against up to X_ROWS_PER_PASS of the `left` remaining rows of x; returns how many it took. */
static int64_t dot_4_rows(const float *x, const float *w, int64_t k, float *out, int64_t out_stride, int64_t left) {
    switch (left < X_ROWS_PER_PASS ? left : X_ROWS_PER_PASS) {
    case 1: dot_4xr(x, w, k, out, out_stride, 1); return 1;
    case 2: dot_4xr(x, w, k, out, out_stride, 2); return 2;
    case 3: dot_4xr(x, w, k, out, out_stride, 3); return 3;
    case 4: dot_4xr(x, w, k, out, out_stride, 4); return 4;
    case 5: dot_4xr(x, w, k, out, out_stride, 5); return 5;
    default: dot_4xr(x, w, k, out, out_stride, 6); return 6;
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Four rows of w against one row of x; k must be a multiple of 8. */
static void dot_4x1(const float *x, const float *w, int64_t k, float *out, int64_t out_stride) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        for (int j = ROWS_PER_TILE; j < 2 * ROWS_PER_TILE; j++) prefetch_weights(w + j * k + i);
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
            prefetch_weights(w + (j + ROWS_PER_TILE) * k + i);
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
        float out[X_ROWS_PER_PASS][ROWS_PER_TILE];
        int64_t done = 1;
#if defined(__AVX512F__)
        if (rows == ROWS_PER_TILE && k % 16 == 0) {
            done = dot_4_rows(x + r * k, w + row * k, k, &out[0][0], ROWS_PER_TILE, m - r);
        } else
#endif
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
