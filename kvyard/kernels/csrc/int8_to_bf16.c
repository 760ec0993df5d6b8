/*
 * int8 weights with a fp32 scale per 32 (small_linear_int8.c's format) widened to bfloat16: w = q * scale,
 * computed in fp32 and rounded to nearest even, bit-identical to PyTorch's (q.float() * scale).to(bfloat16).
 *
 * Many rows of x (prefill, large batches) multiply faster as one bf16 matmul on CPUs with AMX or AVX512-BF16
 * than through the int8 kernel, which is built for a few rows; this is the widening step before it. It is
 * bound by memory bandwidth (1.125 bytes read and 2 written per weight), so AVX2 is as fast as wider vectors.
 *
 * Layout: q [n, k] int8, scales [n, k / 32] fp32, out [n, k] bfloat16 as uint16; k % 32 == 0.
 */
#include <stdint.h>
#include "half_float.h"
#include "kvyard_kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32

#if defined(__AVX2__)
/* Eight fp32 values rounded to nearest even and narrowed to bf16 (finite inputs: no NaN here). */
static inline __m128i round_to_bf16(__m256 values) {
    const __m256i bits = _mm256_castps_si256(values);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    return _mm256_castsi256_si128(packed);
}
#endif

static void widen_row(const int8_t *q, const float *scales, uint16_t *out, int64_t k) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        const int8_t *qg = q + g * GROUP;
        uint16_t *og = out + g * GROUP;
        int i = 0;
#if defined(__AVX2__)
        const __m256 scale = _mm256_set1_ps(scales[g]);
        for (; i < GROUP; i += 8) {
            const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + i)));
            const __m256 values = _mm256_mul_ps(_mm256_cvtepi32_ps(wide), scale);
            _mm_storeu_si128((__m128i *)(og + i), round_to_bf16(values));
        }
#endif
        for (; i < GROUP; i++) og[i] = float_to_bf16((float)qg[i] * scales[g]);
    }
}

void kvyard_int8_to_bf16(const int8_t *q, const float *scales, uint16_t *out, int64_t n, int64_t k,
                         int num_threads) {
    const int parallel = n * k >= 4 * 65536;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t row = 0; row < n; row++) widen_row(q + row * k, scales + row * (k / GROUP), out + row * k, k);
}
