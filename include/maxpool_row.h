/* One output row of 2x2, stride-2 max pooling (pyx/pool.pyx), in C for `restrict`: with
 * the output, its argmax and the input possibly aliasing as far as Cython can say, the
 * compiler keeps the loop scalar and branchy; here it vectorizes it along the row.
 * The rules are pool.pyx's generic ones: the window is visited in row-major order, a value
 * replaces the best so far when it is strictly greater or NaN.
 *
 * Rows are covered by chunks of a fixed width (16, 8 or 4 outputs), the last chunk shifted
 * left to end at the row's end, overlapping the one before it. A plain vector loop would
 * leave LeNet's rows of 14 and 5 outputs wholly to its scalar remainder, whose branches on
 * random data mispredict half the time (docs/notes/2026-12-02-kernels.md, "Max-pool rows").
 * Each output is a function of the input alone, so computing a few twice changes nothing. */
#ifndef DYNAR_MAXPOOL_ROW_H
#define DYNAR_MAXPOOL_ROW_H
#include <stddef.h>
#include <stdint.h>

#define DYNAR_MAXPOOL_ROW(REAL, NAME)                                                        \
static inline void NAME##_chunk(REAL *restrict y, int64_t *restrict argmax,                 \
                                const REAL *restrict r0, const REAL *restrict r1,           \
                                ptrdiff_t n, int64_t first, int64_t W)                      \
{                                                                                           \
    _Pragma("omp simd")                                                                     \
    for (ptrdiff_t o = 0; o < n; o++) {                                                     \
        int64_t at = first + 2 * o;                                                         \
        REAL best = r0[2 * o], v;                                                           \
        int take;                                                                           \
        v = r0[2 * o + 1]; take = (v > best) | (v != v);                                    \
        best = take ? v : best; at = take ? first + 2 * o + 1 : at;                         \
        v = r1[2 * o]; take = (v > best) | (v != v);                                        \
        best = take ? v : best; at = take ? first + W + 2 * o : at;                         \
        v = r1[2 * o + 1]; take = (v > best) | (v != v);                                    \
        best = take ? v : best; at = take ? first + W + 2 * o + 1 : at;                     \
        y[o] = best;                                                                        \
        argmax[o] = at;                                                                     \
    }                                                                                       \
}                                                                                           \
                                                                                            \
/* Chunks of the constant width WIDTH over a row of wo >= WIDTH outputs. */                 \
static inline void NAME##_chunks(REAL *restrict y, int64_t *restrict argmax,                \
                                 const REAL *restrict r0, const REAL *restrict r1,          \
                                 ptrdiff_t wo, int64_t first, int64_t W, ptrdiff_t width)   \
{                                                                                           \
    ptrdiff_t o = 0;                                                                        \
    for (;; o += width) {                                                                   \
        if (o + width > wo)                                                                 \
            o = wo - width;                                                                 \
        NAME##_chunk(y + o, argmax + o, r0 + 2 * o, r1 + 2 * o, width, first + 2 * o, W);   \
        if (o + width == wo)                                                                \
            return;                                                                         \
    }                                                                                       \
}                                                                                           \
                                                                                            \
static inline void NAME(REAL *restrict y, int64_t *restrict argmax,                         \
                        const REAL *restrict r0, const REAL *restrict r1, ptrdiff_t wo,     \
                        int64_t first, int64_t W)                                           \
{                                                                                           \
    /* Constant widths, so each call below compiles to straight vector code. */            \
    if (wo >= 16)                                                                           \
        NAME##_chunks(y, argmax, r0, r1, wo, first, W, 16);                                 \
    else if (wo >= 8)                                                                       \
        NAME##_chunks(y, argmax, r0, r1, wo, first, W, 8);                                  \
    else if (wo >= 4)                                                                       \
        NAME##_chunks(y, argmax, r0, r1, wo, first, W, 4);                                  \
    else                                                                                    \
        NAME##_chunk(y, argmax, r0, r1, wo, first, W);                                      \
}

DYNAR_MAXPOOL_ROW(float, maxpool2x2_row_f)
DYNAR_MAXPOOL_ROW(double, maxpool2x2_row_d)
#undef DYNAR_MAXPOOL_ROW

#endif
