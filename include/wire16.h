/* 16-bit wire formats for compressed gradient allreduce: IEEE binary16 (fp16) and bfloat16.
 *
 * Both round to nearest, ties to even, like a hardware conversion would. fp16 uses the
 * compiler's _Float16 where it has one (GCC >= 12 on x86-64 with F16C, and aarch64, turn the
 * casts into vector conversion instructions); elsewhere a bit-level conversion with the same
 * results. bfloat16 is the rounding every bf16 path shares (bf16.h). NaN stays NaN (quiet)
 * in both directions.
 */
#ifndef DYNAR_WIRE16_H
#define DYNAR_WIRE16_H
#include <stdint.h>
#include <string.h>
#include "bf16.h"

static inline uint32_t dynar_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float dynar_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#if defined(__FLT16_MAX__) && !defined(DYNAR_SOFT_FP16)
static inline uint16_t dynar_f32_to_f16(float f) {
    _Float16 h = (_Float16) f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}
static inline float dynar_f16_to_f32(uint16_t u) {
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float) h;
}
#else
static inline uint16_t dynar_f32_to_f16(float f) {
    uint32_t x = dynar_f32_bits(f);
    uint16_t sign = (uint16_t) ((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)                        /* inf, or NaN kept quiet */
        return sign | 0x7c00u | (ax > 0x7f800000u ? 0x0200u : 0u);
    if (ax >= 0x477ff000u)                        /* rounds past 65504: overflow to inf */
        return sign | 0x7c00u;
    if (ax < 0x38800000u) {                       /* below 2^-14: an fp16 subnormal or zero */
        /* Adding 0.5 leaves the value's multiples of 2^-24 (the fp16 subnormal step) in the
         * low mantissa bits, rounded to nearest even by the float adder itself. */
        float shifted = dynar_bits_f32(ax) + 0.5f;
        return sign | (uint16_t) (dynar_f32_bits(shifted) - 0x3f000000u);
    }
    /* Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to even. */
    uint32_t odd = (ax >> 13) & 1u;
    ax += ((uint32_t) (15 - 127) << 23) + 0x0fffu + odd;
    return sign | (uint16_t) (ax >> 13);
}
static inline float dynar_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    if (em >= 0x7c00u)                            /* inf / NaN */
        return dynar_bits_f32(sign | 0x7f800000u | ((em & 0x03ffu) << 13));
    if (em >= 0x0400u)                            /* normal */
        return dynar_bits_f32(sign | ((em << 13) + ((uint32_t) (127 - 15) << 23)));
    float mag = (float) em * 5.9604644775390625e-8f; /* subnormal: em * 2^-24, exact */
    return dynar_bits_f32(sign | dynar_f32_bits(mag));
}
#endif

#endif
