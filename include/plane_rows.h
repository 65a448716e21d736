/* Loops over blocks of rows of image planes stored at some row stride: the inner loops of
 * im2col and its adjoint col2im (pyx/conv.pyx), and the re-layout of planes between
 * their own width and the padded width the direct convolution reads (pyx/direct.pyx).
 *
 * Per row, these were libc calls (a memcpy and two memsets of a few dozen bytes for im2col)
 * or short Cython loops whose index arithmetic spilled to the stack (col2im): on LeNet's
 * 28- and 10-wide rows, overhead was over half their time. Here they are plain loops the
 * compiler vectorizes; the attribute stops GCC from turning them back into libc calls. */
#ifndef DYNAR_PLANE_ROWS_H
#define DYNAR_PLANE_ROWS_H
#include <stddef.h>

#if defined(__GNUC__) && !defined(__clang__)
#define DYNAR_NO_LIBC_LOOPS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define DYNAR_NO_LIBC_LOOPS
#endif

/* LOOP with STEP a compile-time 1 or 2 where step is (the strides of nearly every network),
 * so the compiler vectorizes it (a stride-2 gather is two loads and a permute); else step. */
#define DYNAR_AT_STEP(step, LOOP)                                                             \
    do {                                                                                      \
        if ((step) == 1) { enum { STEP = 1 }; LOOP }                                          \
        else if ((step) == 2) { enum { STEP = 2 }; LOOP }                                     \
        else { const ptrdiff_t STEP = (step); LOOP }                                          \
    } while (0)

#define DYNAR_PLANE_ROWS(REAL, SUFFIX)                                                       \
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
        DYNAR_AT_STEP(step, for (ptrdiff_t o = 0; o < hi - lo; o++)                         \
                                dst[lo + o] = src[o * STEP];);                              \
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
        DYNAR_AT_STEP(step, for (ptrdiff_t o = 0; o < hi - lo; o++)                         \
                                dst[o * STEP] += src[lo + o];);                             \
}

DYNAR_PLANE_ROWS(float, f)
DYNAR_PLANE_ROWS(double, d)
#undef DYNAR_PLANE_ROWS

#endif
