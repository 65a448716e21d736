/* Row kernels of the Winograd F(2x2, 3x3) convolution (pyx/winograd.pyx).
 *
 * Each works on one row of tiles: tile tx covers band columns 2tx .. 2tx+3, and its 16
 * transformed values live in 16 "streams" (position xi at stream pointer + xi * stride, tile
 * tx at offset tx). They are in C for `restrict`: with 16 output streams and a band that
 * Cython cannot declare non-aliasing, the compiler leaves these loops scalar; here it
 * vectorizes them across tiles. Instantiated for float (suffix _f) and double (_d).
 *
 * The transforms (Lavin & Gray's F(2x2, 3x3)), each applied down the columns, then along
 * the rows of a tile:
 *   input   B^T d B,  B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
 *   output  A^T m A,  A^T = [1 1 1 0; 0 1 -1 -1]
 * and, for backward, their adjoints A g A^T and B v B^T.
 */
#ifndef DYNAR_WINOGRAD_ROWS_H
#define DYNAR_WINOGRAD_ROWS_H
#include <stddef.h>

#define WINO_REAL float
#define WINO_NAME(name) name##_f
#include "winograd_rows.inc"
#undef WINO_REAL
#undef WINO_NAME

#define WINO_REAL double
#define WINO_NAME(name) name##_d
#include "winograd_rows.inc"
#undef WINO_REAL
#undef WINO_NAME

#endif
