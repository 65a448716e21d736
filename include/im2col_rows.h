/* The stride-1 inner loops of im2col and its adjoint col2im (pyx/conv.pyx), over a block
 * of `rows` output rows of one row of the col matrix, each `wo` long, of which [lo, hi) maps
 * to input pixels and the rest to horizontal padding. Per output row these were a memcpy
 * and two memsets of a few dozen bytes (im2col), and a short Cython loop whose index
 * arithmetic spilled to the stack (col2im): on LeNet's 28- and 10-wide rows, overhead was
 * over half the time. Here they are plain loops the compiler vectorizes; the attribute
 * stops GCC from turning the copies back into libc calls. */
#ifndef DYNAR_IM2COL_ROWS_H
#define DYNAR_IM2COL_ROWS_H
#include <stddef.h>

#if defined(__GNUC__) && !defined(__clang__)
#define DYNAR_NO_LIBC_LOOPS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define DYNAR_NO_LIBC_LOOPS
#endif

/* dst: (rows, wo), contiguous; row r's [lo, hi) comes from src + r * ld, the rest is 0. */
#define DYNAR_IM2COL_ROWS(REAL, NAME)                                                        \
DYNAR_NO_LIBC_LOOPS static void NAME(REAL *restrict dst, const REAL *restrict src,          \
                                     ptrdiff_t rows, ptrdiff_t ld, ptrdiff_t wo,            \
                                     ptrdiff_t lo, ptrdiff_t hi)                            \
{                                                                                           \
    for (ptrdiff_t r = 0; r < rows; r++, dst += wo, src += ld) {                            \
        for (ptrdiff_t o = 0; o < lo; o++)                                                  \
            dst[o] = 0;                                                                     \
        for (ptrdiff_t o = 0; o < hi - lo; o++)                                             \
            dst[lo + o] = src[o];                                                           \
        for (ptrdiff_t o = hi; o < wo; o++)                                                 \
            dst[o] = 0;                                                                     \
    }                                                                                       \
}                                                                                           \
                                                                                            \
/* dst + r * ld += row r's [lo, hi) of src: (rows, wo), contiguous. */                      \
DYNAR_NO_LIBC_LOOPS static void NAME##_add(REAL *restrict dst, const REAL *restrict src,    \
                                           ptrdiff_t rows, ptrdiff_t ld, ptrdiff_t wo,      \
                                           ptrdiff_t lo, ptrdiff_t hi)                      \
{                                                                                           \
    for (ptrdiff_t r = 0; r < rows; r++, dst += ld, src += wo)                              \
        for (ptrdiff_t o = 0; o < hi - lo; o++)                                             \
            dst[o] += src[lo + o];                                                          \
}

DYNAR_IM2COL_ROWS(float, im2col_rows_f)
DYNAR_IM2COL_ROWS(double, im2col_rows_d)
#undef DYNAR_IM2COL_ROWS

#endif
