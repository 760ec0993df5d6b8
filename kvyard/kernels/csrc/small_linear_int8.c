/*
 * y = x W^T (+ b) for a handful of rows of x, with W stored as int8: the decode-step matmul of an int8 model.
 *
 * Each group of 32 consecutive weights of a row has its own fp32 scale: w[j][i] = q[j][i] * scales[j][i / 32]
 * (as llama.cpp's q8_0 groups them, so one outlier costs precision to 31 neighbours only). Decode reads W once
 * per step and is bound by memory bandwidth; int8 with a scale per 32 is 1.125 bytes a weight against fp32's 4.
 * The int8 values are widened to fp32 in registers and accumulated in fp32: x is not quantized.
 *
 * Each weight row is read as one sequential stream and widened once per block of up to 8 rows of x, which all
 * use it before the next group is read (8 accumulators, 4 widened vectors and 2 temporaries fill AVX2's 16
 * registers). Threads take tiles of 8 weight rows. Both choices were measured on 2-core AVX2 machines against
 * reading 4 weight rows at once and widening them again for every row of x: about 2x faster at 1 to 64 rows.
 *
 * With AVX-512, each group of 32 weights is widened and multiplied by its scale once (two 16-lane vectors), then
 * used by every row of the block of x. From 16 rows of x on, two weight rows go together, so every x vector loaded
 * feeds two FMAs (2 x 8 accumulators, 4 weight and 2 x vectors: 22 of the 32 registers); with 5-15 rows the
 * step streams weights from memory, and one weight row at a time kept that stream faster (2-core AMD EPYC Zen 5,
 * weights of 92 MB: 1-8 rows at 0.9-0.65x the AVX2 path's time, 16-64 rows at 0.7-0.55x). With 1-4 rows of x, one
 * weight row leaves too few independent FMA chains to hide their latency, so four go together (2-core Intel Xeon,
 * AVX-512, bench model's shapes: 0.8-0.9x the time at 1 row, 0.65-0.8x at 2-4). How many weight rows go together
 * never changes a result's bits: each (weight row, x row) sum is accumulated in the same order. Applying the scale
 * per weight, not per group's partial sum, rounds differently from the AVX2 path; both are fp32 sums within the
 * tests' tolerance of a float64 reference.
 *
 * Layout: x [m, k] fp32, q [n, k] int8, scales [n, k / 32] fp32, bias [n] or NULL, y [m, n]; k % 32 == 0.
 */
#include <stdint.h>
#include "kvyard_kernels.h"
#include "prefetch.h"
#include "row_dispatch.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#endif

#define GROUP 32
#define WEIGHT_ROWS_PER_TILE 8
#define X_ROWS_PER_BLOCK 8

#if defined(__AVX512F__)
#define MAX_WEIGHT_ROWS_PER_PASS 4
#define PAIRED_FROM_ROWS 16

static inline __m512 widen16_scaled(const int8_t *q, __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), scale);
}

/* `wrows` consecutive weight rows against `rows` rows of x; out[r * out_stride + w] = their dot products.
 * Always inlined with constant `wrows` and `rows`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, int64_t k, const int8_t *q,
                                                           const float *scales, float *out, int64_t out_stride,
                                                           const int wrows, const int rows) {
    const int64_t groups = k / GROUP, distance = prefetch_distance(k, wrows);
    __m512 acc[MAX_WEIGHT_ROWS_PER_PASS][X_ROWS_PER_BLOCK];
    for (int w = 0; w < wrows; w++)
        for (int r = 0; r < rows; r++) acc[w][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 lo[MAX_WEIGHT_ROWS_PER_PASS], hi[MAX_WEIGHT_ROWS_PER_PASS];
        for (int w = 0; w < wrows; w++) {
            prefetch_ahead((const char *)(q + w * k), g * GROUP, k, distance, wrows);
            const __m512 scale = _mm512_set1_ps(scales[w * groups + g]);
            lo[w] = widen16_scaled(q + w * k + g * GROUP, scale);
            hi[w] = widen16_scaled(q + w * k + g * GROUP + 16, scale);
        }
        for (int r = 0; r < rows; r++) {
            const __m512 x_lo = _mm512_loadu_ps(x + r * k + g * GROUP);
            const __m512 x_hi = _mm512_loadu_ps(x + r * k + g * GROUP + 16);
            for (int w = 0; w < wrows; w++)
                acc[w][r] = _mm512_fmadd_ps(x_hi, hi[w], _mm512_fmadd_ps(x_lo, lo[w], acc[w][r]));
        }
    }
    for (int w = 0; w < wrows; w++)
        for (int r = 0; r < rows; r++) out[r * out_stride + w] = _mm512_reduce_add_ps(acc[w][r]);
}

#define DOT_FOUR(R) dot_rows(x, k, q, scales, out, n, 4, R)
#define DOT_PAIR(R) dot_rows(x, k, q, scales, out, n, 2, R)
#define DOT_ONE(R) dot_rows(x, k, q, scales, out, n, 1, R)

/* Weight rows from q (at most `left`: 1 asks for one) against `rows` rows of x; returns how many it took. */
static int64_t dot_block(const float *x, int64_t k, const int8_t *q, const float *scales, float *out, int64_t n,
                         int64_t rows, int64_t left) {
    if (left >= 4 && rows <= 4) {
        switch (rows) {
        case 1: DOT_FOUR(1); break;
        case 2: DOT_FOUR(2); break;
        case 3: DOT_FOUR(3); break;
        default: DOT_FOUR(4); break;
        }
        return 4;
    }
    if (left >= 2 && rows > 4) {
        FOR_CONSTANT_ROWS_UP_TO_8(rows, DOT_PAIR)
        return 2;
    }
    FOR_CONSTANT_ROWS_UP_TO_8(rows, DOT_ONE)
    return 1;
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Eight int8 weights widened to fp32. */
static inline __m256 widen8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* One weight row q (with its group scales) against `rows` rows of x; out[r * out_stride] = their dot products.
 * Always inlined with a constant `rows`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_row(const float *x, int64_t k, const int8_t *q,
                                                          const float *scales, float *out, int64_t out_stride,
                                                          const int rows) {
    __m256 acc[X_ROWS_PER_BLOCK];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; g++) {
        const int8_t *qg = q + g * GROUP;
        prefetch_weights(qg + WEIGHT_PREFETCH_BYTES);
        const __m256 w0 = widen8(qg), w1 = widen8(qg + 8), w2 = widen8(qg + 16), w3 = widen8(qg + 24);
        const __m256 scale = _mm256_set1_ps(scales[g]);
        for (int r = 0; r < rows; r++) {
            const float *xg = x + r * k + g * GROUP;
            __m256 part = _mm256_mul_ps(_mm256_loadu_ps(xg), w0);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), w1, part);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), w2, part);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w3, part);
            acc[r] = _mm256_fmadd_ps(part, scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = hsum8(acc[r]);
}

static int64_t dot_block(const float *x, int64_t k, const int8_t *q, const float *scales, float *out, int64_t n,
                         int64_t rows, int64_t left) {
    (void)left;
#define DOT_ROW(R) dot_row(x, k, q, scales, out, n, R)
    FOR_CONSTANT_ROWS_UP_TO_8(rows, DOT_ROW)
    return 1;
}
#else
static int64_t dot_block(const float *x, int64_t k, const int8_t *q, const float *scales, float *out, int64_t n,
                         int64_t rows, int64_t left) {
    (void)left;
    for (int64_t r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t g = 0; g < k / GROUP; g++) {
            float part = 0.0f;
            for (int i = 0; i < GROUP; i++) part += x[r * k + g * GROUP + i] * (float)q[g * GROUP + i];
            total += part * scales[g];
        }
        out[r * n] = total;
    }
    return 1;
}
#endif

static void tile(const float *x, const int8_t *q, const float *scales, const float *bias, float *y, int64_t m,
                 int64_t n, int64_t k, int64_t first_row) {
    const int64_t end = first_row + WEIGHT_ROWS_PER_TILE < n ? first_row + WEIGHT_ROWS_PER_TILE : n;
    const int64_t groups = k / GROUP;
#ifdef PAIRED_FROM_ROWS
    const int paired = m >= PAIRED_FROM_ROWS;
#else
    const int paired = 0;
#endif
    for (int64_t r0 = 0; r0 < m; r0 += X_ROWS_PER_BLOCK) {
        const int64_t rows = m - r0 < X_ROWS_PER_BLOCK ? m - r0 : X_ROWS_PER_BLOCK;
        for (int64_t j = first_row; j < end;)
            j += dot_block(x + r0 * k, k, q + j * k, scales + j * groups, y + r0 * n + j, n, rows,
                           paired || rows <= 4 ? end - j : 1);
        if (bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = first_row; j < end; j++) y[(r0 + r) * n + j] += bias[j];
    }
}

void kvyard_small_linear_int8(const float *x, const int8_t *q, const float *scales, const float *bias, float *y,
                              int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t num_tiles = (n + WEIGHT_ROWS_PER_TILE - 1) / WEIGHT_ROWS_PER_TILE;
    const int parallel = n * k >= 4 * 65536; /* as small_linear.c: ~256 KB of weights before a second thread pays */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t t = 0; t < num_tiles; t++) tile(x, q, scales, bias, y, m, n, k, t * WEIGHT_ROWS_PER_TILE);
}
