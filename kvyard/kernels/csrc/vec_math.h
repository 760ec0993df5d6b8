/* Vector math shared by the AVX2 paths of the kernels. */
#ifndef KVYARD_VEC_MATH_H
#define KVYARD_VEC_MATH_H

#include <immintrin.h>

/* 2^x for x <= 0, exact 0 below -126 (and for -inf): 2^round(x) built in the exponent field times the
 * Cephes exp2f polynomial for the remainder in [-0.5, 0.5]. */
static inline __m256 exp2_nonpositive(__m256 x) {
    const __m256 floor_arg = _mm256_set1_ps(-126.0f);
    const __m256 in_range = _mm256_cmp_ps(x, floor_arg, _CMP_GE_OQ);
    x = _mm256_max_ps(x, floor_arg);
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    const __m256 scaled = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent));
    return _mm256_and_ps(scaled, in_range);
}

/* The sum of a vector's eight lanes. */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

#endif
