/*
 * y = x W^T (+ b) for a handful of rows of x, with W stored in 16 bits (IEEE fp16 or bfloat16): the decode-step
 * matmul of a model whose weights were converted to half precision. x, y and the accumulation stay fp32.
 *
 * Half the bytes of fp32 weights to stream per step. Laid out as small_linear_int8.c: each weight row is one
 * sequential stream, widened to fp32 in registers (F16C for fp16, a 16-bit shift for bf16) once per block of up
 * to 8 rows of x, and threads take tiles of 8 weight rows.
 *
 * With AVX-512 (and k a multiple of 16), 16 weights are widened at a time, and from 16 rows of x on two weight rows
 * go together so each x vector loaded feeds two FMAs, as in small_linear_int8.c.
 *
 * With AVX2 and long rows (k from 1024 on), each (weight row, x row) sum runs as two chains of FMAs, over the even
 * and the odd groups of 8 weights, in blocks of up to 6 rows of x. With one chain a row of x waits on the FMA's
 * latency for every 8 weights, and a row of 1408 weights is too long for the out-of-order core to start the next
 * row meanwhile: at one row of x an MLP down projection (512 x 1408) streamed 19-20 GB/s with one chain, 24-31 GB/s
 * with two, on a 2-core AMD EPYC Zen 2. Rows of 512 keep one chain: there the core overlaps consecutive rows, and
 * two chains (blocks of 6 rows of x, so 8 rows widen each weight twice) were 10-15% slower at 8 rows of x.
 * Each sum is the same chain whatever the rows of x, so its bits do not depend on them.
 *
 * Layout: x [m, k] fp32, w [n, k] 16-bit, bias [n] or NULL, y [m, n]; `is_bf16` picks the 16-bit format.
 */
#include <stdint.h>
#include <string.h>
#include "half_float.h"
#include "kvyard_kernels.h"
#include "prefetch.h"
#include "row_dispatch.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include "vec_math.h"
#define HALF_SIMD 1
#endif

#define WEIGHT_ROWS_PER_TILE 8
#define X_ROWS_PER_BLOCK 8
#define TWO_CHAINS_FROM_K 1024
#define TWO_CHAIN_ROWS 6

#if defined(__AVX512F__)
#define WEIGHT_ROWS_PER_PASS 2
#define PAIRED_FROM_ROWS 16

static inline __m512 widen16(const uint16_t *w, int is_bf16) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)w);
    if (is_bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    return _mm512_cvtph_ps(raw);
}

/* `wrows` consecutive weight rows against `rows` rows of x (k a multiple of 16); out[r * out_stride + w].
 * Always inlined with constant `wrows` and `rows`. */
static inline __attribute__((always_inline)) void dot_rows512(const float *x, int64_t k, const uint16_t *w,
                                                              int is_bf16, float *out, int64_t out_stride,
                                                              const int wrows, const int rows) {
    const int64_t row_bytes = k * (int64_t)sizeof(uint16_t), distance = prefetch_distance(row_bytes, wrows);
    __m512 acc[WEIGHT_ROWS_PER_PASS][X_ROWS_PER_BLOCK];
    for (int v = 0; v < wrows; v++)
        for (int r = 0; r < rows; r++) acc[v][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        __m512 wv[WEIGHT_ROWS_PER_PASS];
        for (int v = 0; v < wrows; v++) {
            prefetch_ahead((const char *)(w + v * k), i * (int64_t)sizeof(uint16_t), row_bytes, distance, wrows);
            wv[v] = widen16(w + v * k + i, is_bf16);
        }
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * k + i);
            for (int v = 0; v < wrows; v++) acc[v][r] = _mm512_fmadd_ps(xv, wv[v], acc[v][r]);
        }
    }
    for (int v = 0; v < wrows; v++)
        for (int r = 0; r < rows; r++) out[r * out_stride + v] = _mm512_reduce_add_ps(acc[v][r]);
}

#define DOT_PAIR(R) dot_rows512(x, k, w, is_bf16, out, n, WEIGHT_ROWS_PER_PASS, R)
#define DOT_ONE(R) dot_rows512(x, k, w, is_bf16, out, n, 1, R)

/* Weight rows from w (at most `left`: 1 asks for one) against `rows` rows of x; returns how many it took. */
static int64_t dot_block512(const float *x, int64_t k, const uint16_t *w, int is_bf16, float *out, int64_t n,
                            int64_t rows, int64_t left) {
    if (left >= WEIGHT_ROWS_PER_PASS) {
        FOR_CONSTANT_ROWS_UP_TO_8(rows, DOT_PAIR)
        return WEIGHT_ROWS_PER_PASS;
    }
    FOR_CONSTANT_ROWS_UP_TO_8(rows, DOT_ONE)
    return 1;
}
#endif

#ifdef HALF_SIMD
static inline __m256 widen8(const uint16_t *w, int is_bf16) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)w);
    if (is_bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    return _mm256_cvtph_ps(raw);
}

/* One weight row against `rows` rows of x (k a multiple of 8); always inlined with a constant `rows`. */
static inline __attribute__((always_inline)) void dot_row(const float *x, int64_t k, const uint16_t *w,
                                                          int is_bf16, float *out, int64_t out_stride,
                                                          const int rows) {
    __m256 acc[X_ROWS_PER_BLOCK];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        prefetch_weights(w + i + WEIGHT_PREFETCH_BYTES / 2);
        const __m256 wv = widen8(w + i, is_bf16);
        for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), wv, acc[r]);
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = hsum8(acc[r]);
}

/* dot_row with each sum run as two chains, over the 8-column groups at even and at odd offsets, added at the end;
 * at most 6 rows of x (12 accumulators). */
static inline __attribute__((always_inline)) void dot_row_2chains(const float *x, int64_t k, const uint16_t *w,
                                                                  int is_bf16, float *out, int64_t out_stride,
                                                                  const int rows) {
    __m256 even[TWO_CHAIN_ROWS], odd[TWO_CHAIN_ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        prefetch_weights(w + i + WEIGHT_PREFETCH_BYTES / 2);
        const __m256 w_even = widen8(w + i, is_bf16), w_odd = widen8(w + i + 8, is_bf16);
        for (int r = 0; r < rows; r++) {
            even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), w_even, even[r]);
            odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i + 8), w_odd, odd[r]);
        }
    }
    if (i < k) {
        const __m256 w_even = widen8(w + i, is_bf16);
        for (int r = 0; r < rows; r++) even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), w_even, even[r]);
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = hsum8(_mm256_add_ps(even[r], odd[r]));
}
#endif

/* Whether rows of k weights go through dot_row_2chains (dot_block, blocks of TWO_CHAIN_ROWS rows of x). */
static int two_chains(int64_t k) {
#if defined(__AVX512F__)
    if (k % 16 == 0) return 0; /* dot_block512 */
#endif
#ifdef HALF_SIMD
    return k % 8 == 0 && k >= TWO_CHAINS_FROM_K;
#else
    return 0;
#endif
}

static void dot_block(const float *x, int64_t k, const uint16_t *w, int is_bf16, float *out, int64_t n,
                      int64_t rows) {
#ifdef HALF_SIMD
    if (two_chains(k)) {
#define DOT_ROW_2CHAINS(R) dot_row_2chains(x, k, w, is_bf16, out, n, R)
        FOR_CONSTANT_ROWS_UP_TO_6(rows, DOT_ROW_2CHAINS)
        return;
    }
    if (k % 8 == 0) {
#define DOT_ROW(R) dot_row(x, k, w, is_bf16, out, n, R)
        FOR_CONSTANT_ROWS_UP_TO_8(rows, DOT_ROW)
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t i = 0; i < k; i++) total += x[r * k + i] * half_to_float(w[i], is_bf16);
        out[r * n] = total;
    }
}

static void tile(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                 int is_bf16, int64_t first_row) {
    const int64_t end = first_row + WEIGHT_ROWS_PER_TILE < n ? first_row + WEIGHT_ROWS_PER_TILE : n;
    const int64_t block = two_chains(k) ? TWO_CHAIN_ROWS : X_ROWS_PER_BLOCK;
    for (int64_t r0 = 0; r0 < m; r0 += block) {
        const int64_t rows = m - r0 < block ? m - r0 : block;
#if defined(__AVX512F__)
        if (k % 16 == 0) {
            for (int64_t j = first_row; j < end;)
                j += dot_block512(x + r0 * k, k, w + j * k, is_bf16, y + r0 * n + j, n, rows,
                                  m >= PAIRED_FROM_ROWS ? end - j : 1);
        } else
#endif
        {
            for (int64_t j = first_row; j < end; j++)
                dot_block(x + r0 * k, k, w + j * k, is_bf16, y + r0 * n + j, n, rows);
        }
        if (bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = first_row; j < end; j++) y[(r0 + r) * n + j] += bias[j];
    }
}

void kvyard_small_linear_half(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m, int64_t n,
                              int64_t k, int is_bf16, int num_threads) {
    const int64_t num_tiles = (n + WEIGHT_ROWS_PER_TILE - 1) / WEIGHT_ROWS_PER_TILE;
    const int parallel = n * k >= 2 * 65536; /* ~256 KB of weights before a second thread pays */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t t = 0; t < num_tiles; t++) tile(x, w, bias, y, m, n, k, is_bf16, t * WEIGHT_ROWS_PER_TILE);
}
