/* Flush-to-zero / denormals-are-zero control for the calling thread.
 *
 * Subnormal floats make x86 and ARM cores take microcode/trap paths that run 5-100x slower;
 * training never needs them. The FP control register is per thread, so the caller must run
 * this in every thread that computes (dynar does it once in each OpenMP worker).
 * Portable: x86 uses MXCSR (FTZ bit 15, DAZ bit 6), aarch64 uses FPCR.FZ (bit 24);
 * other targets compile to a no-op that reports 0. */
#ifndef DYNAR_FPMODE_H
#define DYNAR_FPMODE_H

#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64) || (defined(__i386__) && defined(__SSE__))
#include <xmmintrin.h>
#define DYNAR_MXCSR_FTZ_DAZ 0x8040u
static inline int dynar_set_flush_denormals(int on) {
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(on ? (csr | DYNAR_MXCSR_FTZ_DAZ) : (csr & ~DYNAR_MXCSR_FTZ_DAZ));
    return 1;
}
static inline int dynar_get_flush_denormals(void) {
    return (_mm_getcsr() & DYNAR_MXCSR_FTZ_DAZ) == DYNAR_MXCSR_FTZ_DAZ;
}
#elif defined(__aarch64__)
#define DYNAR_FPCR_FZ (1ull << 24)
static inline int dynar_set_flush_denormals(int on) {
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    fpcr = on ? (fpcr | DYNAR_FPCR_FZ) : (fpcr & ~DYNAR_FPCR_FZ);
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
    return 1;
}
static inline int dynar_get_flush_denormals(void) {
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    return (fpcr & DYNAR_FPCR_FZ) != 0;
}
#else
static inline int dynar_set_flush_denormals(int on) { (void)on; return 0; }
static inline int dynar_get_flush_denormals(void) { return 0; }
#endif

#endif
