/* One output row of 2x2, stride-2 max pooling (pyx/pool.pyx), in C for `restrict`: with
 * the output, its argmax and the input possibly aliasing as far as Cython can say, the
 * compiler keeps the loop scalar and branchy; here it vectorizes it along the row.
 * The rules are pool.pyx's generic ones: the window is visited in row-major order, a value
 * replaces the best so far when it is strictly greater or NaN. */
#ifndef DYNAR_MAXPOOL_ROW_H
#define DYNAR_MAXPOOL_ROW_H
#include <stddef.h>
#include <stdint.h>

#define DYNAR_MAXPOOL_ROW(REAL, NAME)                                                        \
static inline void NAME(REAL *restrict y, int64_t *restrict argmax,                         \
                        const REAL *restrict r0, const REAL *restrict r1, ptrdiff_t wo,     \
                        int64_t first, int64_t W)                                           \
{                                                                                           \
    _Pragma("omp simd")                                                                     \
    for (ptrdiff_t o = 0; o < wo; o++) {                                                    \
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
}

DYNAR_MAXPOOL_ROW(float, maxpool2x2_row_f)
DYNAR_MAXPOOL_ROW(double, maxpool2x2_row_d)
#undef DYNAR_MAXPOOL_ROW

#endif
