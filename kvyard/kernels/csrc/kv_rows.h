/*
 * The formats one row of the paged KV cache (one token, one KV head, head_dim values) is stored in, and
 * conversions of a row to and from fp32. The attention kernels read rows only through kv_load_row and the
 * store kernel writes them only through kv_store_row, so every format is defined here once.
 *
 *   KV_FP32, KV_FP16, KV_BF16: head_dim values of 4, 2 or 2 bytes.
 *   KV_INT8: head_dim int8 values q, then the row's fp32 scale s (4 bytes, unaligned); value = q * s with
 *            s = max|x| / 127 and q = round-to-nearest-even(x / s), so |q| <= 127. One scale per token and
 *            head: a block fills one token at a time, and a scale per block would have to be fixed before
 *            its later tokens are seen (clipping them) or the block re-quantized as it fills.
 */
#ifndef KVYARD_KV_ROWS_H
#define KVYARD_KV_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "half_float.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_ROWS_SIMD 1
#endif

enum { KV_FP32 = 0, KV_FP16 = 1, KV_BF16 = 2, KV_INT8 = 3 };

static inline int64_t kv_row_bytes(int kv_dtype, int head_dim) {
    switch (kv_dtype) {
    case KV_FP16:
    case KV_BF16: return 2 * (int64_t)head_dim;
    case KV_INT8: return (int64_t)head_dim + 4;
    default: return 4 * (int64_t)head_dim;
    }
}

static inline float kv_int8_scale(const uint8_t *row, int head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

/* dst[0 .. head_dim) = the row's values in fp32. */
static inline void kv_load_row(const uint8_t *row, int kv_dtype, int head_dim, float *restrict dst) {
    int d = 0;
    if (kv_dtype == KV_FP32) {
        memcpy(dst, row, sizeof(float) * (size_t)head_dim);
        return;
    }
    if (kv_dtype == KV_INT8) {
        const int8_t *q = (const int8_t *)row;
        const float scale = kv_int8_scale(row, head_dim);
#ifdef KV_ROWS_SIMD
        const __m256 s = _mm256_set1_ps(scale);
        for (; d + 8 <= head_dim; d += 8) {
            const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + d)));
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s));
        }
#endif
        for (; d < head_dim; d++) dst[d] = (float)q[d] * scale;
        return;
    }
    const uint16_t *h = (const uint16_t *)row;
    const int is_bf16 = kv_dtype == KV_BF16;
#ifdef KV_ROWS_SIMD
    for (; d + 8 <= head_dim; d += 8) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(h + d));
        const __m256 wide = is_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                                    : _mm256_cvtph_ps(raw);
        _mm256_storeu_ps(dst + d, wide);
    }
#endif
    for (; d < head_dim; d++) dst[d] = half_to_float(h[d], is_bf16);
}

/* The row's values in fp32: the row itself when it is fp32, else `buffer` filled with them. */
static inline const float *kv_row_as_float(const uint8_t *row, int kv_dtype, int head_dim, float *buffer) {
    if (kv_dtype == KV_FP32) return (const float *)row;
    kv_load_row(row, kv_dtype, head_dim, buffer);
    return buffer;
}

static inline float max_abs(const float *x, int n) {
    float largest = 0.0f;
    int i = 0;
#ifdef KV_ROWS_SIMD
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 lanes = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
    float each[8];
    _mm256_storeu_ps(each, lanes);
    for (int j = 0; j < 8; j++) largest = fmaxf(largest, each[j]);
#endif
    for (; i < n; i++) largest = fmaxf(largest, fabsf(x[i]));
    return largest;
}

/* The row for src[0 .. head_dim), rounded to nearest even in every format. */
static inline void kv_store_row(const float *src, int kv_dtype, int head_dim, uint8_t *row) {
    if (kv_dtype == KV_FP32) {
        memcpy(row, src, sizeof(float) * (size_t)head_dim);
        return;
    }
    int d = 0;
    if (kv_dtype == KV_INT8) {
        const float scale = max_abs(src, head_dim) / 127.0f, divisor = scale == 0.0f ? 1.0f : scale;
        int8_t *q = (int8_t *)row;
#ifdef KV_ROWS_SIMD
        const __m256 div = _mm256_set1_ps(divisor), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
        for (; d + 8 <= head_dim; d += 8) {
            const __m256 rounded = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + d), div),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i wide = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, rounded)));
            const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
            _mm_storel_epi64((__m128i *)(q + d), _mm_packs_epi16(halves, halves));
        }
#endif
        for (; d < head_dim; d++) q[d] = (int8_t)fminf(127.0f, fmaxf(-127.0f, rintf(src[d] / divisor)));
        memcpy(row + head_dim, &scale, sizeof scale);
        return;
    }
    uint16_t *h = (uint16_t *)row;
    if (kv_dtype == KV_BF16) {
        for (; d < head_dim; d++) h[d] = float_to_bf16(src[d]);
        return;
    }
#ifdef KV_ROWS_SIMD
    for (; d + 8 <= head_dim; d += 8)
        _mm_storeu_si128((__m128i *)(h + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; d < head_dim; d++) h[d] = float_to_fp16(src[d]);
}

#endif
