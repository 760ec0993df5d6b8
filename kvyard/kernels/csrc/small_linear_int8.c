/*
 * y = x W^T (+ b) for a handful of rows of x, with W stored as int8: the decode-step matmul of an int8 model.
 *
 * Weights: each group of 32 consecutive weights of a row has its own fp32 scale, w[j][i] = q[j][i] * scales[j][i / 32]
 * (as llama.cpp's q8_0 groups them, so one outlier costs precision to 31 neighbours only): 1.125 bytes a weight
 * against fp32's 4.
 *
 * Activations: each row of x is rounded, per group of 32, to int16 with a scale of the group's max |x| / 32767 and
 * round to nearest even. That keeps 15 bits relative to the group's largest value: 256x finer than the int8
 * activations of llama.cpp's q8_0 matmul, and far below the rounding of the weights themselves (127 levels a
 * group). A group's dot product is then integer arithmetic (vpmaddwd: pairs of int16 products summed into int32),
 * exact, and exact again in fp32 (at most 4 x 127 x 32767 a lane, below 2^24); it is converted once and scaled by
 * (x scale x weight scale) into an fp32 accumulator. Widening every weight to fp32 instead, and scaling it, took
 * about twice the vector operations a group at one row of x, and decode there was bound by them, not by memory:
 * on a 2-core AMD EPYC Zen 4 with the bench model's int8 weights (45 MB), the matmuls of a one-row step took
 * 0.75-0.8x the time of the fp32-widening kernel; with the weights in cache, 0.7x.
 *
 * Each weight row is read as one sequential stream (the hardware prefetcher and prefetch.h keep it arriving) and
 * widened to int16 once per block of rows of x, which all use it. Every (weight row, x row) sum runs as two chains,
 * even and odd groups, so that consecutive fp32 additions overlap; the bits of a row's result never depend on how
 * many rows of x are computed with it (a verification pass must reproduce a decode step).
 *
 * Layout: x [m, k] fp32, q [n, k] int8, scales [n, k / 32] fp32, bias [n] or NULL, y [m, n]; k % 32 == 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "kvyard_kernels.h"
#include "prefetch.h"
#include "row_dispatch.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#endif

#define GROUP 32
#define INT16_LEVELS 32767.0f
#define WEIGHT_ROWS_PER_TILE 8
/* Groups whose (x scale x weight scale) products are computed together, one vector, before their dot products. */
#define SCALE_CHUNK 16

/* Rows of x rounded to int16 per group of 32: xq [m, k], and each group's scale, xs [m, k / 32]. */
typedef struct {
    int16_t *values;
    float *scales;
} QuantizedRows;

static inline float group_inverse_scale(float max_abs, float *scale) {
    *scale = max_abs / INT16_LEVELS;
    return max_abs > 0.0f ? INT16_LEVELS / max_abs : 0.0f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define X_ROWS_PER_BLOCK 8
#define FOR_CONSTANT_ROWS FOR_CONSTANT_ROWS_UP_TO_8

static void quantize_group(const float *x, int16_t *out, float *scale) {
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(group_inverse_scale(max_abs, scale));
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse))));
    _mm256_storeu_si256((__m256i *)(out + 16),
                        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse))));
}

/* One weight row q against `rows` rows of x; out[r * out_stride] = their dot products. Always inlined with a
 * constant `rows`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_row(QuantizedRows x, int64_t k, const int8_t *q,
                                                          const float *scales, float *out, int64_t out_stride,
                                                          const int rows) {
    const int64_t groups = k / GROUP;
    __m512 even[X_ROWS_PER_BLOCK], odd[X_ROWS_PER_BLOCK];
    float combined[X_ROWS_PER_BLOCK][SCALE_CHUNK] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += SCALE_CHUNK) {
        const int64_t chunk = groups - g0 < SCALE_CHUNK ? groups - g0 : SCALE_CHUNK;
        const __mmask16 mask = (__mmask16)((1u << chunk) - 1u);
        const __m512 weight_scales = _mm512_maskz_loadu_ps(mask, scales + g0);
        for (int r = 0; r < rows; r++)
            _mm512_store_ps(combined[r], _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x.scales + r * groups + g0),
                                                       weight_scales));
        for (int64_t g = 0; g < chunk; g++) {
            const int64_t offset = (g0 + g) * GROUP;
            if ((g & 1) == 0) prefetch_weights(q + offset + WEIGHT_PREFETCH_BYTES);
            const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + offset)));
            for (int r = 0; r < rows; r++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(x.values + r * k + offset));
                const __m512 sums = _mm512_cvtepi32_ps(_mm512_madd_epi16(xv, w));
                const __m512 scale = _mm512_set1_ps(combined[r][g]);
                if (g & 1)
                    odd[r] = _mm512_fmadd_ps(sums, scale, odd[r]);
                else
                    even[r] = _mm512_fmadd_ps(sums, scale, even[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Two accumulators a row of x and 16 registers: four rows of x a block. */
#define X_ROWS_PER_BLOCK 4
#define FOR_CONSTANT_ROWS FOR_CONSTANT_ROWS_UP_TO_4

static __m256i quantize8(__m256 v, __m256 inverse) { return _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse)); }

static void quantize_group(const float *x, int16_t *out, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
    const __m256 c = _mm256_loadu_ps(x + 16), d = _mm256_loadu_ps(x + 24);
    const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a), _mm256_andnot_ps(sign, b)),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, c), _mm256_andnot_ps(sign, d)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const __m256 inverse = _mm256_set1_ps(group_inverse_scale(_mm_cvtss_f32(m), scale));
    /* packs works within 128-bit lanes: 0xD8 puts the four 64-bit quarters back in order */
    const __m256i first = _mm256_packs_epi32(quantize8(a, inverse), quantize8(b, inverse));
    const __m256i second = _mm256_packs_epi32(quantize8(c, inverse), quantize8(d, inverse));
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(first, 0xD8));
    _mm256_storeu_si256((__m256i *)(out + 16), _mm256_permute4x64_epi64(second, 0xD8));
}

/* One group's 32 products against each of `rows` rows of x, scaled, added into acc[r]. The groups' combined scales
 * are multiplied a chunk at a time beforehand and broadcast from memory (a load, not a shuffle), and the even and odd
 * groups run unrolled, without a branch: one thread at one row of x took 0.77-0.82x the time of a loop that did both
 * per group (2-core AMD EPYC Zen 2, the bench model's int8 linears; 0.91-0.97x at 2-64 rows; two threads at one row
 * are bound by memory there, either way). */
static inline __attribute__((always_inline)) void dot_group(QuantizedRows x, int64_t k, const int8_t *qg,
                                                            int64_t offset, const float *combined, int64_t stride,
                                                            __m256 *acc, const int rows) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qg));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qg + 16)));
    for (int r = 0; r < rows; r++) {
        const int16_t *xg = x.values + r * k + offset;
        const __m256i pairs = _mm256_add_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xg), w0),
                                               _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xg + 16)), w1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pairs), _mm256_broadcast_ss(combined + r * stride), acc[r]);
    }
}

static inline __attribute__((always_inline)) void dot_row(QuantizedRows x, int64_t k, const int8_t *q,
                                                          const float *scales, float *out, int64_t out_stride,
                                                          const int rows) {
    const int64_t groups = k / GROUP;
    __m256 even[X_ROWS_PER_BLOCK], odd[X_ROWS_PER_BLOCK];
    float combined[X_ROWS_PER_BLOCK][SCALE_CHUNK] __attribute__((aligned(32)));
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += SCALE_CHUNK) {
        const int64_t chunk = groups - g0 < SCALE_CHUNK ? groups - g0 : SCALE_CHUNK;
        for (int r = 0; r < rows; r++)
            for (int64_t g = 0; g < chunk; g++) combined[r][g] = x.scales[r * groups + g0 + g] * scales[g0 + g];
        int64_t g = 0;
        for (; g + 1 < chunk; g += 2) {
            const int64_t offset = (g0 + g) * GROUP;
            prefetch_weights(q + offset + WEIGHT_PREFETCH_BYTES);
            dot_group(x, k, q + offset, offset, &combined[0][g], SCALE_CHUNK, even, rows);
            dot_group(x, k, q + offset + GROUP, offset + GROUP, &combined[0][g + 1], SCALE_CHUNK, odd, rows);
        }
        if (g < chunk) {
            const int64_t offset = (g0 + g) * GROUP;
            dot_group(x, k, q + offset, offset, &combined[0][g], SCALE_CHUNK, even, rows);
        }
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = hsum8(_mm256_add_ps(even[r], odd[r]));
}
#else
#define X_ROWS_PER_BLOCK 1
#define FOR_CONSTANT_ROWS(rows, CALL) CALL(1);

static void quantize_group(const float *x, int16_t *out, float *scale) {
    float max_abs = 0.0f;
    for (int i = 0; i < GROUP; i++) max_abs = fabsf(x[i]) > max_abs ? fabsf(x[i]) : max_abs;
    const float inverse = group_inverse_scale(max_abs, scale);
    for (int i = 0; i < GROUP; i++) out[i] = (int16_t)lrintf(x[i] * inverse);
}

static void dot_row(QuantizedRows x, int64_t k, const int8_t *q, const float *scales, float *out, int64_t out_stride,
                    const int rows) {
    (void)out_stride, (void)rows;
    float total = 0.0f;
    for (int64_t g = 0; g < k / GROUP; g++) {
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) sum += (int32_t)x.values[g * GROUP + i] * q[g * GROUP + i];
        total += (float)sum * (x.scales[g] * scales[g]);
    }
    *out = total;
}
#endif

static void quantize_rows(const float *x, int64_t m, int64_t k, QuantizedRows out) {
    for (int64_t g = 0; g < m * (k / GROUP); g++) quantize_group(x + g * GROUP, out.values + g * GROUP, out.scales + g);
}

static void tile(QuantizedRows x, const int8_t *q, const float *scales, const float *bias, float *y, int64_t m,
                 int64_t n, int64_t k, int64_t first_row) {
    const int64_t end = first_row + WEIGHT_ROWS_PER_TILE < n ? first_row + WEIGHT_ROWS_PER_TILE : n;
    const int64_t groups = k / GROUP;
    for (int64_t r0 = 0; r0 < m; r0 += X_ROWS_PER_BLOCK) {
        const int64_t rows = m - r0 < X_ROWS_PER_BLOCK ? m - r0 : X_ROWS_PER_BLOCK;
        const QuantizedRows block = {x.values + r0 * k, x.scales + r0 * groups};
        for (int64_t j = first_row; j < end; j++) {
#define DOT_ROW(R) dot_row(block, k, q + j * k, scales + j * groups, y + r0 * n + j, n, R)
            FOR_CONSTANT_ROWS(rows, DOT_ROW)
#undef DOT_ROW
        }
        if (bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = first_row; j < end; j++) y[(r0 + r) * n + j] += bias[j];
    }
}

void kvyard_small_linear_int8(const float *x, const int8_t *q, const float *scales, const float *bias, float *y,
                              int64_t m, int64_t n, int64_t k, int num_threads) {
    /* 64-byte aligned, rounded up to whole 64 bytes as aligned_alloc asks: values, then scales */
    const size_t value_bytes = ((size_t)(m * k) * sizeof(int16_t) + 63) & ~(size_t)63;
    const size_t scale_bytes = ((size_t)(m * (k / GROUP)) * sizeof(float) + 63) & ~(size_t)63;
    char *scratch = aligned_alloc(64, value_bytes + scale_bytes);
    if (scratch == NULL) abort(); /* a few hundred KB at most for the rows this kernel takes */
    const QuantizedRows quantized = {(int16_t *)scratch, (float *)(scratch + value_bytes)};
    quantize_rows(x, m, k, quantized);
    const int64_t num_tiles = (n + WEIGHT_ROWS_PER_TILE - 1) / WEIGHT_ROWS_PER_TILE;
    const int parallel = n * k >= 4 * 65536; /* as small_linear.c: ~256 KB of weights before a second thread pays */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t t = 0; t < num_tiles; t++) tile(quantized, q, scales, bias, y, m, n, k, t * WEIGHT_ROWS_PER_TILE);
    free(scratch);
}
