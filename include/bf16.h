/* bf16 (bfloat16): the upper 16 bits of a float32 (sign, the same 8-bit exponent, 7 of its
 * 23 mantissa bits), and which bf16 instructions this CPU and OS let a process run.
 *
 * Rounding float32 -> bf16 is the one rule every path must share, so that replicas stay
 * bitwise identical whichever kernel ran: round to nearest, ties to even; a NaN stays a NaN
 * of the same sign, made quiet (its payload's upper bits kept); a subnormal float32 becomes
 * a zero of the same sign. The last is what the hardware converters do under the
 * flush-to-zero mode dynar trains in (x86 VCVTNEPS2BF16 treats subnormal inputs as zero
 * always; aarch64 BFCVT does with FPCR.FZ set), so the portable loop below matches them. A
 * bf16 times a bf16 is exact in float32 (8 + 8 significant bits), so float32 kernels fed
 * bf16-rounded operands compute the products bf16 dot-product instructions do. */
#ifndef DYNAR_BF16_H
#define DYNAR_BF16_H

#include <stdint.h>
#include <string.h>

static inline uint16_t dynar_bf16_from_float(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t magnitude = bits & 0x7fffffffu;
    /* Adding 0x7fff plus the lowest kept bit carries into the kept bits exactly when the
     * dropped half is above one half, or at one half with an odd kept part. Finite values
     * past the largest bf16 carry into the exponent and become infinity, as they should. */
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (bits >> 16) | 0x0040u;
    uint32_t signed_zero = (bits >> 16) & 0x8000u;
    uint32_t result = magnitude > 0x7f800000u ? quiet_nan
                    : magnitude < 0x00800000u ? signed_zero : rounded;
    return (uint16_t) result;
}

static inline float dynar_bf16_to_float(uint16_t half)
{
    uint32_t bits = (uint32_t) half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The float32 holding the bf16 nearest `value`: bf16 arithmetic on float32 kernels. */
static inline float dynar_bf16_round(float value)
{
    return dynar_bf16_to_float(dynar_bf16_from_float(value));
}

/* Bits of dynar_bf16_features(). */
#define DYNAR_BF16_AVX512 1     /* x86 AVX512_BF16: VDPBF16PS, VCVTNEPS2BF16 */
#define DYNAR_BF16_AMX 2        /* x86 AMX-BF16 tiles, with the OS's permission granted */
#define DYNAR_BF16_ARM 4        /* aarch64 FEAT_BF16: BFDOT, BFMMLA, BFCVT */

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux keeps the AMX tile registers (8 KB of state) out of a process until it asks:
 * arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). Granted for the whole process. */
#define DYNAR_ARCH_REQ_XCOMP_PERM 0x1023
#define DYNAR_XFEATURE_XTILEDATA 18

static inline uint64_t dynar_xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t) hi << 32) | lo;
}

static inline int dynar_bf16_features(void)
{
    unsigned int a, b, c, d;
    int features = 0;
    if (__get_cpuid_max(0, 0) < 7 || !__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))
        return 0;                                   /* no leaf 7, or no OSXSAVE */
    uint64_t xcr0 = dynar_xgetbv0();
    unsigned int b7, c7, d7, a71, b71, c71, d71;
    __cpuid_count(7, 0, a, b7, c7, d7);
    __cpuid_count(7, 1, a71, b71, c71, d71);
    /* AVX-512 needs the OS to save the opmask and all 32 zmm registers (XCR0 bits 5-7); the
     * kernels use AVX512F and AVX512BW (EBX bits 16, 30) besides AVX512_BF16. */
    int avx512_state = (xcr0 & 0xe6u) == 0xe6u;
    if (avx512_state && (b7 & (1u << 16)) && (b7 & (1u << 30)) && (a71 & (1u << 5)))
        features |= DYNAR_BF16_AVX512;
    /* AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24), tile state enabled in XCR0 (17, 18). */
    if ((d7 & (1u << 22)) && (d7 & (1u << 24)) && (xcr0 & (3u << 17)) == (3u << 17)
            && syscall(SYS_arch_prctl, DYNAR_ARCH_REQ_XCOMP_PERM,
                       DYNAR_XFEATURE_XTILEDATA) == 0)
        features |= DYNAR_BF16_AMX;
    return features;
}

#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#define DYNAR_HWCAP2_BF16 (1ul << 14)

static inline int dynar_bf16_features(void)
{
    return (getauxval(AT_HWCAP2) & DYNAR_HWCAP2_BF16) ? DYNAR_BF16_ARM : 0;
}

#else
static inline int dynar_bf16_features(void) { return 0; }
#endif

#endif
