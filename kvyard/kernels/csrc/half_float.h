/* Scalar conversions between fp32 and the 16-bit formats (IEEE fp16, bfloat16), rounding to nearest even as
 * PyTorch does, so a value stored by a kernel is bit-identical to the same value stored by torch. The portable
 * paths use these; the AVX2 paths use F16C and shifts, which round the same way. */
#ifndef KVYARD_HALF_FLOAT_H
#define KVYARD_HALF_FLOAT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

static inline float half_to_float(uint16_t h, int is_bf16) {
    if (is_bf16) return bits_to_float((uint32_t)h << 16);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13)); /* inf, nan */
    if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
    if (mantissa == 0) return bits_to_float(sign);
    uint32_t e = 113, m = mantissa; /* subnormal: normalise */
    while (!(m & 0x400)) m <<= 1, e--;
    return bits_to_float(sign | (e << 23) | ((m & 0x3ff) << 13));
}

static inline uint16_t float_to_fp16(float f) {
    const uint32_t bits = float_to_bits(f), sign = (bits >> 16) & 0x8000, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (uint16_t)(sign | 0x7e00);   /* nan */
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  /* 65520 and up round to inf */
    if (magnitude < 0x38800000u) /* below 2^-14: a subnormal in units of 2^-24, the scaling exact */
        return (uint16_t)(sign | (uint32_t)nearbyintf(bits_to_float(magnitude) * 16777216.0f));
    const uint32_t rebiased = magnitude - (112u << 23);
    return (uint16_t)(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1)) >> 13));
}

static inline uint16_t float_to_bf16(float f) {
    const uint32_t bits = float_to_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* nan stays nan */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

#endif
