/* Loops over blocks of rows of image planes stored at some row stride: the inner loops of
 * im2col and its adjoint col2im (pyx/im2col.pyx), and the re-layout of planes between
 * their own width and the padded width the direct convolution reads (pyx/direct.pyx).
 *
 * Rows are a few dozen elements (LeNet's are 28 and 10 wide), too short for a libc call or
 * for a loop whose index arithmetic spills to the stack. Here they are plain loops the
 * compiler vectorizes; the attribute stops GCC from turning them back into libc calls.
 *
 * Except at stride 2 (ResNet's downsampling layers): there the compiler's vector loop over a
 * 16- or 15-wide row spends most of its time in the scalar remainder and the tests choosing
 * it, and a loop of fixed length 16 it unrolls into single-element inserts. So stride-2 rows
 * go in whole vectors written with GCC/Clang vector extensions, in chunks of 16, 8 or 4
 * floats with AVX-512, of 8, 4 or 2 otherwise (8, 4, 2 doubles). A vector of W even
 * elements is two loads, the second starting at element W - 1 so nothing past the last
 * element read is touched, and one shuffle. (The measurements:
 * docs/notes/2026-12-02-kernels.md, "Row loops".) */
#ifndef DYNAR_PLANE_ROWS_H
#define DYNAR_PLANE_ROWS_H
#include <stddef.h>

#if defined(__GNUC__) && !defined(__clang__)
#define DYNAR_NO_LIBC_LOOPS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define DYNAR_NO_LIBC_LOOPS
#endif

/* LOOP with STEP a compile-time 1 where step is 1, so the compiler vectorizes it as a plain
 * copy; else step (stride 2 has its own vector code below). */
#define DYNAR_AT_STEP(step, LOOP)                                                             \
    do {                                                                                      \
        if ((step) == 1) { enum { STEP = 1 }; LOOP }                                          \
        else { const ptrdiff_t STEP = (step); LOOP }                                          \
    } while (0)

/* Compilers without __builtin_shufflevector (GCC before 12) take the plain loops. */
#ifndef DYNAR_VECTOR_SHUFFLES
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define DYNAR_VECTOR_SHUFFLES 1
#endif
#endif
#endif
#ifndef DYNAR_VECTOR_SHUFFLES
#define DYNAR_VECTOR_SHUFFLES 0
#endif

#if DYNAR_VECTOR_SHUFFLES
/* Shuffle masks over two W-lane vectors (lanes 0..W-1 of the first, W..2W-1 of the second,
 * the second loaded from element W - 1 on): EVENS_W picks elements 0, 2, ..., 2W - 2;
 * SPREAD_LO_W / SPREAD_HI_W put lanes 0..W/2-1 / W/2..W-1 of a vector (first operand) on the
 * even elements of the first / second load (lane W of the second operand, 0, elsewhere). */
#define DYNAR_EVENS_16 0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29, 31
#define DYNAR_SPREAD_LO_16 0, 16, 1, 16, 2, 16, 3, 16, 4, 16, 5, 16, 6, 16, 7, 16
#define DYNAR_SPREAD_HI_16 16, 8, 16, 9, 16, 10, 16, 11, 16, 12, 16, 13, 16, 14, 16, 15
#define DYNAR_EVENS_8 0, 2, 4, 6, 9, 11, 13, 15
#define DYNAR_SPREAD_LO_8 0, 8, 1, 8, 2, 8, 3, 8
#define DYNAR_SPREAD_HI_8 8, 4, 8, 5, 8, 6, 8, 7
#define DYNAR_EVENS_4 0, 2, 5, 7
#define DYNAR_SPREAD_LO_4 0, 4, 1, 4
#define DYNAR_SPREAD_HI_4 4, 2, 4, 3
#define DYNAR_EVENS_2 0, 3
#define DYNAR_SPREAD_LO_2 0, 2
#define DYNAR_SPREAD_HI_2 2, 1

/* gather2: dst[k] = src[2k]; scatter2_add: dst[2k] += src[k]; for k < W. */
#define DYNAR_STRIDE2_VECTORS(REAL, SUFFIX, W)                                                \
typedef REAL dynar_v##W##SUFFIX                                                               \
    __attribute__((vector_size((W) * sizeof(REAL)), aligned(sizeof(REAL))));                 \
static inline void gather2_##W##SUFFIX(REAL *restrict dst, const REAL *restrict src)         \
{                                                                                             \
    const dynar_v##W##SUFFIX lo = *(const dynar_v##W##SUFFIX *)src;                          \
    const dynar_v##W##SUFFIX hi = *(const dynar_v##W##SUFFIX *)(src + (W) - 1);              \
    *(dynar_v##W##SUFFIX *)dst = __builtin_shufflevector(lo, hi, DYNAR_EVENS_##W);           \
}                                                                                             \
static inline void scatter2_add_##W##SUFFIX(REAL *restrict dst, const REAL *restrict src)    \
{                                                                                             \
    const dynar_v##W##SUFFIX add = *(const dynar_v##W##SUFFIX *)src, zero = {0};             \
    const dynar_v##W##SUFFIX lo = *(dynar_v##W##SUFFIX *)dst;                                \
    const dynar_v##W##SUFFIX hi = *(dynar_v##W##SUFFIX *)(dst + (W) - 1);                    \
    *(dynar_v##W##SUFFIX *)dst = lo + __builtin_shufflevector(add, zero, DYNAR_SPREAD_LO_##W); \
    *(dynar_v##W##SUFFIX *)(dst + (W) - 1) =                                                 \
        hi + __builtin_shufflevector(add, zero, DYNAR_SPREAD_HI_##W);                         \
}

DYNAR_STRIDE2_VECTORS(float, f, 16)
DYNAR_STRIDE2_VECTORS(float, f, 8)
DYNAR_STRIDE2_VECTORS(float, f, 4)
DYNAR_STRIDE2_VECTORS(float, f, 2)
DYNAR_STRIDE2_VECTORS(double, d, 8)
DYNAR_STRIDE2_VECTORS(double, d, 4)
DYNAR_STRIDE2_VECTORS(double, d, 2)
#undef DYNAR_STRIDE2_VECTORS

/* gather2 over a row of n elements in chunks of W, the last one ending with the row (it may
 * rewrite a few elements of the one before, with the same values). */
#define DYNAR_GATHER2_CHUNKS(SUFFIX, W, n, dst, src)                                          \
    do {                                                                                      \
        ptrdiff_t i = 0;                                                                      \
        for (; i + (W) <= (n); i += (W))                                                      \
            gather2_##W##SUFFIX((dst) + i, (src) + 2 * i);                                    \
        if (i < (n))                                                                          \
            gather2_##W##SUFFIX((dst) + (n) - (W), (src) + 2 * ((n) - (W)));                  \
    } while (0)

/* dst[i] = src[2i] for i < n: chunks of the widest of W0 > W1 > W2 that fits, ONE(i) for each
 * element of a row shorter than W2. */
#define DYNAR_GATHER2_ROW(SUFFIX, W0, W1, W2, n, dst, src, ONE)                               \
    do {                                                                                      \
        if ((n) >= (W0)) DYNAR_GATHER2_CHUNKS(SUFFIX, W0, n, dst, src);                       \
        else if ((n) >= (W1)) DYNAR_GATHER2_CHUNKS(SUFFIX, W1, n, dst, src);                  \
        else if ((n) >= (W2)) DYNAR_GATHER2_CHUNKS(SUFFIX, W2, n, dst, src);                  \
        else for (ptrdiff_t i = 0; i < (n); i++) { ONE }                                      \
    } while (0)

/* dst[2i] += src[i] for i < n: chunks of W0, then one of W1 and one of W2 if they fit, then
 * ONE(i) for the last elements. (Chunks must not overlap here: adding twice is wrong, and a
 * load of what the chunk before just stored in part stalls.) */
#define DYNAR_SCATTER2_ADD_ROW(SUFFIX, W0, W1, W2, n, dst, src, ONE)                          \
    do {                                                                                      \
        ptrdiff_t i = 0;                                                                      \
        for (; i + (W0) <= (n); i += (W0))                                                    \
            scatter2_add_##W0##SUFFIX((dst) + 2 * i, (src) + i);                              \
        if (i + (W1) <= (n)) {                                                                \
            scatter2_add_##W1##SUFFIX((dst) + 2 * i, (src) + i);                              \
            i += (W1);                                                                        \
        }                                                                                     \
        if (i + (W2) <= (n)) {                                                                \
            scatter2_add_##W2##SUFFIX((dst) + 2 * i, (src) + i);                              \
            i += (W2);                                                                        \
        }                                                                                     \
        for (; i < (n); i++) { ONE }                                                          \
    } while (0)
#else
#define DYNAR_GATHER2_ROW(SUFFIX, W0, W1, W2, n, dst, src, ONE)                               \
    do {                                                                                      \
        for (ptrdiff_t i = 0; i < (n); i++) { ONE }                                           \
    } while (0)
#define DYNAR_SCATTER2_ADD_ROW DYNAR_GATHER2_ROW
#endif

/* Ask for the cache lines of bytes at p ahead of their first use. */
static inline void prefetch_bytes(const void *p, ptrdiff_t bytes)
{
#if defined(__GNUC__)
    for (ptrdiff_t o = 0; o < bytes; o += 64)
        __builtin_prefetch((const char *)p + o);
#else
    (void)p; (void)bytes;
#endif
}

/* The row loops for one element type; W0 > W1 > W2: its stride-2 chunk widths (64, 32 and
 * 16 bytes). */
#define DYNAR_PLANE_ROWS(REAL, SUFFIX, W0, W1, W2)                                          \
/* dst + r * dst_ld = the n elements at src + r * src_ld, for r < rows. */                   \
DYNAR_NO_LIBC_LOOPS static void rows_copy_##SUFFIX(REAL *restrict dst, ptrdiff_t dst_ld,    \
                                                   const REAL *restrict src,                \
                                                   ptrdiff_t src_ld, ptrdiff_t rows,        \
                                                   ptrdiff_t n)                             \
{                                                                                           \
    for (ptrdiff_t r = 0; r < rows; r++, dst += dst_ld, src += src_ld)                      \
        for (ptrdiff_t o = 0; o < n; o++)                                                   \
            dst[o] = src[o];                                                                \
}                                                                                           \
                                                                                            \
/* im2col: dst (rows, wo), contiguous; row r's [lo, hi) from src + r * ld, every step-th    \
 * element, the rest 0. */                                                                  \
DYNAR_NO_LIBC_LOOPS static void rows_unfold_##SUFFIX(REAL *restrict dst,                    \
                                                     const REAL *restrict src,              \
                                                     ptrdiff_t rows, ptrdiff_t ld,          \
                                                     ptrdiff_t wo, ptrdiff_t lo,            \
                                                     ptrdiff_t hi, ptrdiff_t step)          \
{                                                                                           \
    for (ptrdiff_t r = 0; r < rows; r++, dst += wo, src += ld) {                            \
        for (ptrdiff_t o = 0; o < lo; o++)                                                  \
            dst[o] = 0;                                                                     \
        if (step == 2)                                                                      \
            DYNAR_GATHER2_ROW(SUFFIX, W0, W1, W2, hi - lo, dst + lo, src,                   \
                              dst[lo + i] = src[2 * i];);                                   \
        else                                                                                \
            DYNAR_AT_STEP(step, for (ptrdiff_t o = 0; o < hi - lo; o++)                     \
                                    dst[lo + o] = src[o * STEP];);                          \
        for (ptrdiff_t o = hi; o < wo; o++)                                                 \
            dst[o] = 0;                                                                     \
    }                                                                                       \
}                                                                                           \
                                                                                            \
/* col2im, the adjoint: every step-th element of dst + r * ld += row r's [lo, hi) of src     \
 * (rows, wo), contiguous. */                                                               \
DYNAR_NO_LIBC_LOOPS static void rows_fold_add_##SUFFIX(REAL *restrict dst,                  \
                                                       const REAL *restrict src,            \
                                                       ptrdiff_t rows, ptrdiff_t ld,        \
                                                       ptrdiff_t wo, ptrdiff_t lo,          \
                                                       ptrdiff_t hi, ptrdiff_t step)        \
{                                                                                           \
    for (ptrdiff_t r = 0; r < rows; r++, dst += ld, src += wo)                              \
        if (step == 2)                                                                      \
            DYNAR_SCATTER2_ADD_ROW(SUFFIX, W0, W1, W2, hi - lo, dst, src + lo,              \
                                   dst[2 * i] += src[lo + i];);                             \
        else                                                                                \
            DYNAR_AT_STEP(step, for (ptrdiff_t o = 0; o < hi - lo; o++)                     \
                                    dst[o * STEP] += src[lo + o];);                         \
}

/* Float chunks no wider than a vector register: for AVX2, GCC builds a 16-float shuffle out
 * of scalar loads through the stack, which stall on store forwarding (stride-2 layers ran
 * 15% slower: docs/notes/2026-12-05-avx2-panel-gemm.md). Tests set the width to check both. */
#ifndef DYNAR_ROW_CHUNK_FLOATS
#if defined(__AVX512F__)
#define DYNAR_ROW_CHUNK_FLOATS 16
#else
#define DYNAR_ROW_CHUNK_FLOATS 8
#endif
#endif
#if DYNAR_ROW_CHUNK_FLOATS == 16
DYNAR_PLANE_ROWS(float, f, 16, 8, 4)
#else
DYNAR_PLANE_ROWS(float, f, 8, 4, 2)
#endif
DYNAR_PLANE_ROWS(double, d, 8, 4, 2)
#undef DYNAR_PLANE_ROWS

#endif
