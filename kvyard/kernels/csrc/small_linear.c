/*
 * y = x W^T (+ b) for a handful of rows of x, fp32: the decode-step matmul.
 *
 * With few rows the cost is reading W once from memory, so each thread streams its own slice
 * of W's rows exactly once and applies every row of x to it while it is in cache. PyTorch's
 * BLAS path for this shape reaches well under the memory bandwidth on some CPUs.
 *
 * With AVX-512 (and k a multiple of 16), four rows of w go against up to six rows of x per pass, each loaded w
 * vector feeding one FMA per row of x (24 accumulators, 6 x vectors and the w vector: 31 of the 32 registers).
 * The AVX2 path takes up to three rows of x a pass (12 accumulators, 3 x vectors and the w vector). Five rows go
 * as three and two, not three, one and one: a 5-row pass of the bench model's fp32 layers took 0.92-0.95x the time,
 * weights streamed from memory on a 2-core AMD EPYC Zen 2 (one pass had spent 1.5x the time of one row on a Zen 5).
 * Each (weight row, x row) sum is the same chain whatever the rows of x, so its bits do not depend on them.
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
/* Four rows of w against `rows` (1 to 3) rows of x, k a multiple of 8: each loaded w vector feeds one FMA per row of
 * x. Always inlined with a constant `rows`. */
static inline __attribute__((always_inline)) void dot_4xr_avx2(const float *x, const float *w, int64_t k, float *out,
                                                               int64_t out_stride, const int rows) {
    __m256 acc[3][ROWS_PER_TILE];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ROWS_PER_TILE; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 xv[3];
        for (int r = 0; r < rows; r++) xv[r] = _mm256_loadu_ps(x + r * k + i);
        for (int j = 0; j < ROWS_PER_TILE; j++) {
            prefetch_weights(w + (j + ROWS_PER_TILE) * k + i); /* the next tile's rows, at this column */
            const __m256 wv = _mm256_loadu_ps(w + j * k + i);
            for (int r = 0; r < rows; r++) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ROWS_PER_TILE; j++) out[r * out_stride + j] = hsum8(acc[r][j]);
}

/* Four rows of w against up to three of the `left` remaining rows of x; returns how many it took. */
static int64_t dot_4_rows_avx2(const float *x, const float *w, int64_t k, float *out, int64_t out_stride,
                               int64_t left) {
    switch (left < 3 ? left : 3) {
    case 1: dot_4xr_avx2(x, w, k, out, out_stride, 1); return 1;
    case 2: dot_4xr_avx2(x, w, k, out, out_stride, 2); return 2;
    default: dot_4xr_avx2(x, w, k, out, out_stride, 3); return 3;
    }
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
            done = dot_4_rows_avx2(x + r * k, w + row * k, k, &out[0][0], ROWS_PER_TILE, m - r);
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
